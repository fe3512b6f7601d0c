"""ReCLIP end to end on tiny CLIP/SigLIP students built in code: runs, gradients, determinism, CLI, export."""

import json

import pytest
import torch
from transformers import CLIPModel

from vlmrl.cli import main
from vlmrl.reclip.config import ConfigError, JudgeConfig, RLConfig, load_reclip_config
from vlmrl.reclip.judge import SceneGraphJudge
from vlmrl.reclip.scenes import make_scenes
from vlmrl.reclip.step import Scorer, StepContext, reclip_step
from vlmrl.reclip.store import InputStore
from vlmrl.reclip.students import hf_student_from_config, load_student
from vlmrl.reclip.trainer import train_reclip

TOWER = "{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2}"
VISION = "{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, patch_size: 16}"
TINY = [f"student.config={{model_type: clip, projection_dim: 16, text_config: {TOWER}, vision_config: {VISION}}}",
        "student.name_or_path=config", "student.image_size=56", "data.train.n=24", "data.eval.n=12",
        "warmup.steps=2", "warmup.batch_size=8", "rl.batch_size=8", "rl.candidates=4", "trainer.threads=1",
        "trainer.log_every=1"]
TINY_CONFIG = {"model_type": "clip", "projection_dim": 16,
               "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 2},
               "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "patch_size": 16}}


def tiny_config(tmp_path, *extra):
    return load_reclip_config(None, TINY + [f"trainer.output_dir={tmp_path / 'run'}", *extra])


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_three_step_reclip_run_on_a_tiny_clip(tmp_path):
    cfg = tiny_config(tmp_path, "rl.steps=3", "rl.kl_weight=0.1", "rl.anchor_weight=0.5", "rl.text_negatives=true",
                      "rl.bank_size=16", "rl.bank_refresh=2")
    summary = train_reclip(cfg)
    run = tmp_path / "run"
    rows = [r for r in records(run) if r["phase"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert torch.isfinite(torch.tensor(r["loss"]))
        assert -1.0 <= r["t2i/reward_mean"] <= 1.0 and -1.0 <= r["i2t/reward_mean"] <= 1.0
        assert r.get("judge/calls", 0) + r.get("judge/cache_hits", 0) == 2 * 8 * 4  # 2 directions x B x K
    for key in ("t2i/R@1", "t2i/R@10", "i2t/R@5", "comp/acc", "comp/relation", "zeroshot/mean"):
        assert 0.0 <= summary["final"][key] <= 1.0 and key in summary["start"]
    feedback = [json.loads(x) for x in (run / "feedback.jsonl").read_text().splitlines()]
    assert feedback and all(f["feedback"].startswith("[") for f in feedback if "feedback" in f)
    # the student is a standard checkpoint: CLIPModel loads it, and load_student gives encode_text / encode_image
    CLIPModel.from_pretrained(run / "student")
    student = load_student(run / "student")
    scenes = make_scenes(2, "test", 0)
    assert student.encode_text([s.caption for s in scenes]).shape == (2, 16)
    emb = student.encode_image([s.image for s in scenes])
    assert emb.shape == (2, 16) and torch.allclose(emb.norm(dim=-1), torch.ones(2), atol=1e-5)


def test_reclip_step_sends_gradients_into_both_towers():
    items = make_scenes(8, "train", 0)
    student = hf_student_from_config(TINY_CONFIG, [it.caption for it in items], seed=0, image_size=56)
    opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.0)
    rl = RLConfig(batch_size=8, candidates=4, directions=["t2i"])  # one direction: its query tower and its pool
    ctx = StepContext(student, InputStore(student, [it.image for it in items]), items, rl,
                      Scorer(SceneGraphJudge(), JudgeConfig()), opt, torch.Generator().manual_seed(0))
    reclip_step(ctx, list(range(8)))
    text_grad = student.model.text_model.embeddings.token_embedding.weight.grad
    vision_grad = student.model.vision_model.embeddings.patch_embedding.weight.grad
    assert text_grad.abs().sum() > 0 and vision_grad.abs().sum() > 0


def test_same_seed_same_numbers(tmp_path):
    a = train_reclip(tiny_config(tmp_path / "a", "rl.steps=2", "trainer.save_students=false"))
    b = train_reclip(tiny_config(tmp_path / "b", "rl.steps=2", "trainer.save_students=false"))
    assert a["final"] == b["final"]
    losses = [[r["loss"] for r in records(tmp_path / x / "run") if r["phase"] == "train"] for x in ("a", "b")]
    assert losses[0] == losses[1]


def test_infonce_baseline_and_siglip_student(tmp_path):
    siglip = TINY[0].replace("model_type: clip, projection_dim: 16, ", "model_type: siglip, ")
    cfg = load_reclip_config(None, TINY + [siglip, "rl.steps=1", "rl.method=infonce", "trainer.save_students=false",
                                           f"trainer.output_dir={tmp_path / 'run'}"])
    summary = train_reclip(cfg)
    assert "t2i/R@1" in summary["final"] and "student" not in summary


def test_cli_train_eval_export(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["reclip", "train", *TINY, "rl.steps=1", f"trainer.output_dir={out}"]
    assert main(args) == 0
    assert "comp/acc" in capsys.readouterr().out
    metrics = tmp_path / "eval.json"
    assert main(["reclip", "eval", str(out / "student"), "--n", "6", "--out", str(metrics)]) == 0
    assert "t2i/R@1" in json.loads(metrics.read_text())
    assert main(["reclip", "export", str(out / "student"), str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").exists()


def test_config_errors_name_the_key(tmp_path, capsys):
    with pytest.raises(ConfigError, match="rl.candidates"):
        load_reclip_config(None, ["rl.candidates=100"])
    with pytest.raises(ConfigError, match="unknown key 'rl.candidate'"):
        load_reclip_config(None, ["rl.candidate=4"])
    with pytest.raises(ConfigError, match="rl.method"):
        load_reclip_config(None, ["rl.method=ppo"])
    assert main(["reclip", "train", "rl.selection=best"]) == 2
    assert "rl.selection" in capsys.readouterr().err


def test_scene_graph_judge_on_user_captions_stops_before_the_run(tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(tmp_path / "a.png")
    data = tmp_path / "caps.jsonl"
    data.write_text(json.dumps({"image": "a.png", "caption": "a red square"}) + "\n")
    args = ["reclip", "train", *TINY, f"data.train={{path: {data}}}", f"data.eval={{path: {data}}}",
            f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    assert "judge.name=exact" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_config_changed_in_code_is_checked_before_anything_is_built(tmp_path):
    cfg = load_reclip_config(None, [f"trainer.output_dir={tmp_path / 'run'}"])
    cfg.rl.candidates = cfg.rl.batch_size + 1
    with pytest.raises(ConfigError, match=r"rl.candidates=65 > rl.batch_size=64"):
        train_reclip(cfg)
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_continues_exactly(tmp_path):
    """4 RL steps straight, against 2 then a resume from checkpoint-2: the same losses, rewards and final weights
    (the bank refreshed at step 1 and 4, so steps 3 and 4 need the checkpoint's bank; the KL reference too)."""
    from safetensors.torch import load_file

    common = ["rl.steps=4", "rl.bank_size=16", "rl.bank_refresh=3", "rl.kl_weight=0.1", "rl.selection=sample",
              "data.train.n=32"]
    straight = train_reclip(tiny_config(tmp_path / "a", *common, "trainer.save_every=2"))
    assert (tmp_path / "a" / "run" / "checkpoint-2" / "state.pt").exists()
    assert not (tmp_path / "a" / "run" / "checkpoint-4").exists()  # the end is the student itself
    resumed = train_reclip(tiny_config(tmp_path / "b", *common, f"trainer.resume={tmp_path / 'a' / 'run' / 'checkpoint-2'}"))
    assert resumed["resumed_from"].endswith("checkpoint-2") and resumed["start"] == straight["start"]
    assert resumed["final"] == straight["final"]
    rows = {x: [r for r in records(tmp_path / x / "run") if r["phase"] == "train"] for x in ("a", "b")}
    assert [r["step"] for r in rows["b"]] == [3, 4]
    for a, b in zip(rows["a"][2:], rows["b"], strict=True):
        assert (a["loss"], a["t2i/reward_mean"], a["grad_norm"]) == (b["loss"], b["t2i/reward_mean"], b["grad_norm"])
    w = [load_file(next((tmp_path / x / "run" / "student").glob("*.safetensors"))) for x in ("a", "b")]
    assert all(torch.equal(w[0][k], w[1][k]) for k in w[0])


def test_resume_from_a_folder_without_a_checkpoint_says_what_to_pass(tmp_path):
    with pytest.raises(ConfigError, match="pass a RUN_DIR/checkpoint-STEP folder"):
        train_reclip(tiny_config(tmp_path, f"trainer.resume={tmp_path}"))
