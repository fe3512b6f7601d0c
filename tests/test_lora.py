"""LoRA through PEFT, frozen towers, gradient checkpointing, the adapter-disabled reference, and merge + reload."""

from __future__ import annotations

import json

import pytest
import torch

from vlmrl.cli import main
from vlmrl.config import LoraConfig, ModelConfig
from vlmrl.data import make_task, vocabulary_texts
from vlmrl.models import load_policy
from vlmrl.models.forward import sequence_logprobs
from vlmrl.models.reference import Reference
from vlmrl.models.tiny_families import build_tiny_family
from vlmrl.models.trainable import (
    add_lora,
    configure_training,
    freeze,
    merge_checkpoint,
    parameter_counts,
)
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.generate import generate
from vlmrl.trainer.run import train

from .test_train_e2e import small_config

pytest.importorskip("peft")
FAMILIES = ("qwen2_vl", "idefics3", "llava", "gemma3")  # decoders named language_model / text_model; CLIP/SigLIP/ViT


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    torch.set_num_threads(1)
    return {f: build_tiny_family(f, tmp_path_factory.mktemp(f), vocabulary_texts(0)) for f in FAMILIES}


@pytest.fixture(scope="module")
def rollout(dirs):
    """Prompts (one with no image) and sampled answers of the tiny Qwen2-VL."""
    policy = load_policy(dirs["qwen2_vl"])
    samples = make_task("shapes_count", 3, "train", seed=1) + [{"id": "t", "images": [], "problem": "1+1?"}]
    prompts = make_prompts(policy, samples)
    return prompts, generate(policy, prompts, 2, 5, 1.0, generator=torch.Generator().manual_seed(0))


def logprobs(policy, prompts, r) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logprobs(policy, prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0).logprobs


def perturb_adapters(policy, seed: int = 0) -> None:
    """Random B matrices: what training does to the adapters, in one deterministic line."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapts_the_decoder_only_by_default(dirs, family):
    policy = load_policy(dirs[family])
    total = parameter_counts(policy)["params/total"]
    add_lora(policy, LoraConfig(r=4), dirs[family])
    fam = policy.family
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in fam.model.named_parameters() if ".lora_A" in n}
    assert adapted and all(n.startswith(f"model.{fam.language_attr}.") for n in adapted)
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    counts = parameter_counts(policy)
    assert counts["params/trainable"] < 0.5 * total
    # include_vision: the vision tower's linear layers get adapters too (never the projector)
    vision = load_policy(dirs[family])
    add_lora(vision, LoraConfig(r=4, include_vision=True), dirs[family])
    names = [n for n, _ in vision.family.model.named_parameters() if ".lora_A" in n]
    assert any(n.startswith(fam.vision_prefixes) for n in names)
    assert not any(n.startswith(fam.projector_prefixes) for n in names)


def test_target_modules_select_layers_and_unknown_names_fail(dirs):
    policy = load_policy(dirs["qwen2_vl"])
    add_lora(policy, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), dirs["qwen2_vl"])
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in policy.model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match=r"qkv_proj.*no linear layer.*'q_proj'"):
        add_lora(load_policy(dirs["qwen2_vl"]), LoraConfig(r=2, target_modules=["qkv_proj"]), dirs["qwen2_vl"])


def test_reference_under_lora_is_the_policy_with_adapters_disabled(dirs, rollout):
    prompts, r = rollout
    policy = load_policy(dirs["qwen2_vl"])
    start = logprobs(policy, prompts, r)
    add_lora(policy, LoraConfig(r=4), dirs["qwen2_vl"])
    assert torch.allclose(logprobs(policy, prompts, r), start, atol=1e-6)  # B = 0: adapters start as the identity
    perturb_adapters(policy)
    trained = logprobs(policy, prompts, r)
    assert (trained - start).abs().max() > 1e-2
    ref = Reference.of(policy)
    assert ref.shares_weights  # no second copy of the model
    policy.model.train()
    assert torch.allclose(ref.logprobs(prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0), start,
                          atol=1e-5)
    assert policy.model.training  # mode restored
    assert torch.allclose(logprobs(policy, prompts, r), trained, atol=1e-6)  # adapters back on after the block


def test_full_finetuning_reference_is_a_frozen_copy(dirs, rollout):
    prompts, r = rollout
    policy = load_policy(dirs["qwen2_vl"])
    ref = Reference.of(policy)
    assert not ref.shares_weights and not any(p.requires_grad for p in ref.frozen.model.parameters())
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05)
    assert (ref.logprobs(prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0)
            - logprobs(policy, prompts, r)).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_frozen_towers_do_not_move(dirs, rollout, family):
    policy = load_policy(dirs[family])
    frozen = freeze(policy, vision=True)
    fam = policy.family
    names = dict(fam.model.named_parameters())
    assert frozen > 0
    assert all(not p.requires_grad for n, p in names.items()
               if n.startswith(fam.vision_prefixes) and not n.startswith(fam.projector_prefixes))
    assert all(p.requires_grad for n, p in names.items() if n.startswith(fam.projector_prefixes))
    freeze(policy, projector=True)
    assert all(not p.requires_grad for n, p in names.items() if n.startswith(fam.projector_prefixes))
    assert any(p.requires_grad for n, p in names.items() if n.startswith(f"model.{fam.language_attr}."))


def test_gradient_checkpointing_gives_the_same_gradients(dirs, rollout):
    prompts, r = rollout
    grads = []
    for ckpt in (False, True):
        policy = configure_training(load_policy(dirs["qwen2_vl"]), ModelConfig(gradient_checkpointing=ckpt))
        layers = policy.family.language_model.layers
        assert all(layer.gradient_checkpointing == ckpt for layer in layers)
        policy.model.train()
        out = sequence_logprobs(policy, prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0).logprobs
        out.sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:  # (without checkpointing the prompt's KV cache is shared: another summation order, ~1e-6)
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4), n


def test_adapter_checkpoint_merges_and_reloads(dirs, rollout, tmp_path):
    prompts, r = rollout
    policy = load_policy(dirs["qwen2_vl"])
    add_lora(policy, LoraConfig(r=4, alpha=8), dirs["qwen2_vl"])
    perturb_adapters(policy, seed=3)
    expected = logprobs(policy, prompts, r)
    policy.save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt/adapter_config.json").read_text())
    assert not (tmp_path / "ckpt/model.safetensors").exists()  # adapters only
    assert not cfg["base_model_name_or_path"].startswith("/")  # relative: the run directory can move
    reloaded = load_policy(tmp_path / "ckpt")
    assert reloaded.has_adapters and torch.allclose(logprobs(reloaded, prompts, r), expected, atol=1e-5)
    merged_dir = merge_checkpoint(tmp_path / "ckpt", tmp_path / "merged")
    assert not (merged_dir / "adapter_config.json").exists()
    merged = load_policy(merged_dir)
    assert not merged.has_adapters
    assert torch.allclose(logprobs(merged, prompts, r), expected, atol=1e-5)
    from transformers import AutoModelForImageTextToText

    assert AutoModelForImageTextToText.from_pretrained(merged_dir) is not None


def test_train_with_lora_saves_adapters_and_exports(tmp_path):
    """`vlmrl train` with model.lora: SFT (full) -> base saved -> adapters for RL with a KL to the adapter-disabled
    reference -> adapter checkpoints -> `vlmrl export --merge` -> `vlmrl train --resume` continues."""
    cfg = small_config(tmp_path, "trainer.steps=2", "trainer.save_every=1", "model.lora.r=4", "algorithm.beta=0.05")
    summary = train(cfg)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all("kl" in row for row in rows if row["phase"] == "train")
    assert (run / "lora_base/model.safetensors").exists()
    for ckpt in ("checkpoint-0", "checkpoint-1", "checkpoint-2"):
        assert (run / ckpt / "adapter_config.json").exists() and not (run / ckpt / "model.safetensors").exists()
    assert summary["checkpoint"].endswith("checkpoint-2")
    with pytest.raises(ValueError, match="--merge"):
        from vlmrl.models.cli import cmd_export
        cmd_export(type("A", (), {"checkpoint": run / "checkpoint-2", "out": tmp_path / "x", "merge": False,
                                  "dtype": "float32"})())
    assert main(["export", str(run / "checkpoint-2"), str(tmp_path / "merged"), "--merge"]) == 0
    assert (tmp_path / "merged/model.safetensors").exists()
    straight = next(row for row in rows if row["phase"] == "train" and row["step"] == 2)
    resumed = train(small_config(tmp_path, "trainer.steps=2", "model.lora.r=4", "algorithm.beta=0.05"),
                    resume=run / "checkpoint-1")
    assert resumed["checkpoint"].endswith("checkpoint-2")
    # the resumed run logged step 2 again (in place of the straight run's row) with the straight run's numbers:
    # adapters, optimizer, RNG all restored
    again = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step2 = [row for row in again if row["phase"] == "train" and row["step"] == 2]
    assert len(step2) == 1
    for key in ("loss", "kl", "reward/total/mean"):
        assert step2[0][key] == pytest.approx(straight[key], abs=1e-6), key


def test_autocast_only_on_cuda(dirs):
    """bf16 autocast is the default on CUDA; on CPU the forward runs in the weights' dtype (float32 here)."""
    import contextlib

    policy = load_policy(dirs["qwen2_vl"])
    assert policy.family.autocast_dtype == torch.bfloat16
    assert isinstance(policy.family.autocast(), contextlib.nullcontext)  # CPU: no autocast
    hidden = policy.family.forward_hidden(torch.randn(1, 3, 32), torch.ones(1, 3, dtype=torch.long),
                                          torch.arange(3).expand(3, 1, 3))
    assert hidden.dtype == torch.float32
    assert load_policy(dirs["qwen2_vl"], autocast=False).family.autocast_dtype is None


@pytest.mark.parametrize(("recipe", "budget_gib"), [("qwen2_5_vl_3b_lora.yaml", 24), ("qwen2_5_vl_3b_full.yaml", 80)])
def test_gpu_recipes_load_and_their_memory_estimate_fits(recipe, budget_gib):
    """The GPU recipes are valid, and the estimate in docs/models.md (untested on a GPU) leaves a margin."""
    from pathlib import Path

    from vlmrl.config import load_config
    from vlmrl.models.memory import estimate, prompt_length

    cfg = load_config(Path(__file__).resolve().parents[1] / "recipes" / recipe)
    est = estimate(cfg, prompt_length(cfg))
    assert est["params"] == pytest.approx(3.75, abs=0.01)  # Qwen2.5-VL-3B-Instruct, counted on the meta device
    assert est["peak"] < 0.7 * budget_gib
    if cfg.model.lora.r:
        assert est["reference"] == 0.0 and est["gradients+adamw"] < 1.0
