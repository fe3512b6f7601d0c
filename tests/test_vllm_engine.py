"""rollout.engine=vllm: the conversion of vLLM's outputs, the step's wiring (recomputed old log-probs, the logged gap,
weights pushed after every update) with a stand-in engine, the engine class itself over a stand-in `vllm` module
(weight pushes that leave a bf16 LoRA base bit-identical, the names and values pushed, sleep, the launcher's
environment, the pixel budget, the deadline). The real engine is tests/test_vllm_real.py's."""

import copy
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from vlmrl.config import LoraConfig, load_config
from vlmrl.models import load_policy
from vlmrl.models.reference import Reference
from vlmrl.rewards import RewardSpec
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.generate import generate
from vlmrl.rollout.vllm_engine import (
    LAUNCHER_KEYS,
    VLLMEngine,
    _hf_name,
    _image_budget,
    launcher_env,
    to_rollout,
    weights_to_push,
)
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
    assert r.prompt_index.tolist() == [0, 0, 1, 1]
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
        self.pushes, self.calls, self.modes = 0, 0, []

    def generate(self, policy, prompts, samples, group_size, max_new_tokens, temperature, top_k, top_p, seeds):
        self.calls += 1
        self.modes.append(policy.model.training)  # the live model's mode while the engine samples
        r = generate(policy, prompts, group_size, max_new_tokens, temperature, top_k, top_p, prompt_seeds=seeds)
        r.logprobs = (r.logprobs - 0.05) * r.completion_mask
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
    assert metrics["rollout/logprob_gap_max"] == pytest.approx(0.05, abs=1e-4)
    assert metrics["rollout/logprob_gap_mean"] == pytest.approx(0.05, abs=1e-4)
    assert metrics["clip_fraction"] == 0.0  # ratios are 1 at the first (only) update of a freshly sampled batch


def test_an_engine_leaves_the_live_models_mode_alone(tiny_model_dir, count_samples):
    """With an engine, stage I only prepares prompts with the policy: an asynchronous producer thread runs it beside
    the update on the live model, and switching that model to eval mode would turn gradient checkpointing and dropout
    off for the update micro-batches that overlap (22 of 36 in a stand-in run before the fix)."""
    from vlmrl.trainer.rl import produce

    cfg = load_config(None, ["rollout.group_size=2", "rollout.max_new_tokens=4"])
    policy = load_policy(tiny_model_dir)
    policy.model.train()
    engine = StandInEngine()
    ctx = StepContext(policy, None, None, [RewardSpec("format", 1.0)], cfg.rollout, copy.deepcopy(cfg.algorithm),
                      cfg.trainer, generator=torch.Generator().manual_seed(0), engine=engine)
    produce(ctx, count_samples[:2])
    assert engine.modes == [True] and policy.model.training


# -- the engine class over a stand-in `vllm` module ------------------------------------------------------------------
class FakeLLM:
    """What VLLMEngine calls on `vllm.LLM`: records the constructor's arguments and environment, the phases, the
    weights handed to `load_weights` (materialised, as vLLM's loader would consume them) and the requests."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.env = {k: os.environ.get(k) for k in LAUNCHER_KEYS}
        self.events: list[str] = []
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.requests: list[dict] = []

    def sleep(self, level):
        assert level == 1
        self.events.append("sleep")

    def wake_up(self):
        self.events.append("wake")

    def collective_rpc(self, method, args=()):
        """The worker of vLLM 0.32: a model runner that reloads weights from an iterator (no tied head to re-pack)."""
        model = SimpleNamespace(load_weights=self.load_weights, modules=lambda: [])
        runner = SimpleNamespace(get_model=lambda: model,
                                 reload_weights=lambda weights_iterator=None: self.load_weights(weights_iterator))
        return [method(SimpleNamespace(model_runner=runner), *args)]

    def load_weights(self, weights):
        self.events.append("load")
        self.loaded = [(name, t.clone()) for name, t in weights]

    def reset_prefix_cache(self):
        self.events.append("reset_prefix")

    def reset_encoder_cache(self):
        self.events.append("reset_encoder")

    def reset_mm_cache(self):
        self.events.append("reset_mm")

    def generate(self, requests, params, use_tqdm=False):
        self.events.append("generate")
        self.requests = requests
        return [SimpleNamespace(outputs=[_completion([p.eos], [-0.5])] * p.n) for p in params]


def _clear_launcher_env(monkeypatch):
    for key in LAUNCHER_KEYS:  # set first, so that monkeypatch records (and later restores) the original state
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A `vllm` module with FakeLLM and a SamplingParams that keeps its arguments; no launcher variables set."""
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM

    def sampling_params(**kwargs):
        return SimpleNamespace(eos=kwargs["stop_token_ids"][0], **kwargs)

    module.SamplingParams = sampling_params
    monkeypatch.setitem(sys.modules, "vllm", module)
    _clear_launcher_env(monkeypatch)
    return module


def _lora_policy(model_dir, dtype="bfloat16", seed=0):
    """A LoRA policy (r=4, alpha=8) with random B, so adapters change the weights."""
    from vlmrl.models.trainable import add_lora

    pytest.importorskip("peft")
    policy = add_lora(load_policy(model_dir, dtype=dtype), LoraConfig(r=4, alpha=8), model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return policy


def _reference_logprobs(policy, prompts, r):
    return Reference.of(policy).logprobs(prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0)


def test_lora_pushes_leave_the_bf16_base_and_the_reference_bit_identical(tiny_model_dir, count_samples, fake_vllm):
    policy = _lora_policy(tiny_model_dir)
    model = policy.model
    assert model.dtype == torch.bfloat16
    prompts = make_prompts(policy, count_samples[:2])
    r = generate(policy, prompts, 2, 4, 1.0, generator=torch.Generator().manual_seed(0))
    ref_before = _reference_logprobs(policy, prompts, r)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = VLLMEngine(tiny_model_dir)
    for _ in range(100):
        assert engine.push_weights(policy) > 0
    for n, p in model.named_parameters():  # base weights and adapters alike
        assert torch.equal(p, before[n]), n
    assert not any(getattr(m, "merged", False) for m in model.modules())
    assert torch.equal(_reference_logprobs(policy, prompts, r), ref_before)
    # control: the merge-then-unmerge round trip this replaces does move bf16 weights, so the checks above can fail
    other = copy.deepcopy(model)
    other.merge_adapter()
    other.unmerge_adapter()
    assert any(not torch.equal(p, before[n]) for n, p in other.named_parameters() if ".base_layer." in n)


def test_pushed_lora_weights_are_the_float32_merge_under_the_base_names(tiny_model_dir, fake_vllm):
    policy = _lora_policy(tiny_model_dir, seed=1)
    engine = VLLMEngine(tiny_model_dir)
    count = engine.push_weights(policy)
    pushed = dict(engine.llm.loaded)
    assert count == len(engine.llm.loaded) == len(pushed)
    adapted = {n.removesuffix(".lora_A") for n, m in policy.model.named_modules() if n.endswith(".lora_A")}
    plain = {n for n, _ in load_policy(tiny_model_dir).model.named_parameters()}
    assert set(pushed) == plain  # every weight, under the names the plain model (and vLLM's checkpoint) uses
    base = load_policy(tiny_model_dir, dtype="bfloat16").model
    for name, tensor in pushed.items():  # what is not adapted goes as the base has it
        if name.removesuffix(".weight") not in {a.removeprefix("base_model.model.") for a in adapted}:
            assert torch.equal(tensor, base.get_parameter(name)), name
    for name in adapted:
        layer = policy.model.get_submodule(name)
        w, a, b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert layer.scaling["default"] == 2.0
        expected = (w.float() + 2.0 * (b.float() @ a.float())).to(torch.bfloat16)
        got = pushed[name.removeprefix("base_model.model.") + ".weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected), name
        assert not torch.equal(got, w)
    # disabled adapters: the base weights as they are
    with policy.model.disable_adapter():
        merged = dict(weights_to_push(policy.model))
    for name in adapted:
        assert torch.equal(merged[name.removeprefix("base_model.model.") + ".weight"],
                           policy.model.get_submodule(name).base_layer.weight)


class _LoraLike(torch.nn.Module):
    """The attributes of a PEFT LoRA layer that the merge reads: two adapters, one active; a transposed base."""

    def __init__(self, fan_in_fan_out: bool):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base_layer = torch.nn.Linear(4, 6).requires_grad_(False)
        if fan_in_fan_out:  # Conv1D-style storage: [in, out]
            self.base_layer.weight = torch.nn.Parameter(torch.randn(4, 6, generator=g), requires_grad=False)
        self.lora_A = torch.nn.ModuleDict({k: torch.nn.Linear(4, 2, bias=False) for k in ("a", "b")})
        self.lora_B = torch.nn.ModuleDict({k: torch.nn.Linear(2, 6, bias=False) for k in ("a", "b")})
        self.scaling = {"a": 0.5, "b": 3.0}
        self.fan_in_fan_out = fan_in_fan_out
        self.active_adapters = ["a", "missing"]
        self.disable_adapters = False


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
def test_merge_sums_the_active_adapters_present_and_respects_fan_in_fan_out(fan_in_fan_out):
    model = torch.nn.Module()
    model.proj = _LoraLike(fan_in_fan_out)
    layer = model.proj
    pushed = dict(weights_to_push(model))
    assert list(pushed) == ["proj.weight", "proj.bias"]  # the merged weight, then the rest of the layer as it is
    merged = pushed["proj.weight"]
    delta = 0.5 * (layer.lora_B["a"].weight @ layer.lora_A["a"].weight)
    assert not merged.requires_grad
    assert torch.allclose(merged, layer.base_layer.weight + (delta.T if fan_in_fan_out else delta))
    layer.disable_adapters = True
    assert torch.equal(dict(weights_to_push(model))["proj.weight"], layer.base_layer.weight)


def test_a_push_hands_over_every_weight_the_frozen_ones_too(tiny_model_dir, fake_vllm):
    from vlmrl.models.trainable import freeze

    policy = load_policy(tiny_model_dir)
    freeze(policy, vision=True)
    engine = VLLMEngine(tiny_model_dir)
    everything = dict(policy.model.named_parameters())
    assert engine.push_weights(policy) == len(everything) > sum(p.requires_grad for p in everything.values())
    assert [n for n, _ in engine.llm.loaded] == list(everything)
    assert all(torch.equal(t, everything[n]) for n, t in engine.llm.loaded)
    # PEFT names as the base model names them
    assert _hf_name("base_model.model.model.layers.0.q_proj.base_layer.weight") == "model.layers.0.q_proj.weight"
    assert _hf_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"


def test_push_weights_goes_back_to_sleep_and_only_generate_wakes(policy, count_samples, fake_vllm):
    engine = VLLMEngine("unused", {"sleep": True})
    assert engine.asleep and engine.llm.events == ["sleep"]
    engine.push_weights(policy)  # (the tiny policy's vision tower trains: its image caches are reset too)
    assert engine.asleep and engine.llm.events == ["sleep", "wake", "load", "reset_prefix", "reset_encoder", "reset_mm",
                                                   "sleep"]
    prompts = make_prompts(policy, count_samples[:2])
    r = engine.generate(policy, prompts, count_samples[:2], 2, 4, 1.0, 0, 1.0, [1, 2])
    assert engine.asleep and engine.llm.events[-3:] == ["wake", "generate", "sleep"]
    assert r.completion_ids.shape == (4, 4)
    # the pixel budget reached vLLM with the images
    assert [q["mm_processor_kwargs"] for q in engine.llm.requests] == [{"min_pixels": 56 * 56,
                                                                         "max_pixels": 84 * 84}] * 2
    awake = VLLMEngine("unused", {"sleep": False})
    awake.push_weights(policy)
    assert not awake.asleep and "sleep" not in awake.llm.events and "wake" not in awake.llm.events


def test_engine_starts_outside_torchrun_with_a_world_of_one(fake_vllm):
    engine = VLLMEngine("unused", seed=3)
    kwargs = engine.llm.kwargs
    assert kwargs["distributed_executor_backend"] == "external_launcher" and kwargs["seed"] == 3
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    env = engine.llm.env  # set before the LLM was created
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert 0 < int(env["MASTER_PORT"]) < 65536


def test_launcher_env_fills_a_single_process_and_keeps_torchrun_values(monkeypatch):
    _clear_launcher_env(monkeypatch)
    env = launcher_env()
    assert env["RANK"] == "0" and env["LOCAL_RANK"] == "0" and env["WORLD_SIZE"] == "1"
    assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    assert {k: os.environ[k] for k in LAUNCHER_KEYS} == env
    # a single process on another GPU: LOCAL_RANK follows the device; a port set by hand is kept
    _clear_launcher_env(monkeypatch)
    monkeypatch.setenv("MASTER_PORT", "29511")
    env = launcher_env("cuda:2")
    assert env["LOCAL_RANK"] == "2" and env["MASTER_PORT"] == "29511"
    # torchrun's values are left alone
    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}
    for key, value in torchrun.items():
        monkeypatch.setenv(key, value)
    assert launcher_env() == torchrun and launcher_env("cuda:1") == torchrun and launcher_env("cuda") == torchrun
    assert {k: os.environ[k] for k in LAUNCHER_KEYS} == torchrun
    with pytest.raises(ValueError, match="LOCAL_RANK=1"):
        launcher_env("cuda:3")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(RuntimeError, match="MASTER_PORT"):
        launcher_env()


def test_image_budget_is_the_processors_pixel_budget(tiny_model_dir, policy):
    assert _image_budget(policy) == {"min_pixels": 56 * 56, "max_pixels": 84 * 84}  # the tiny model's own
    budget = load_policy(tiny_model_dir, min_pixels=100 * 100, max_pixels=200 * 200)
    assert _image_budget(budget) == {"min_pixels": 100 * 100, "max_pixels": 200 * 200}
    # an older image processor: min_pixels / max_pixels attributes
    old = SimpleNamespace(processor=SimpleNamespace(image_processor=SimpleNamespace(
        size={"height": 224, "width": 224}, min_pixels=3136, max_pixels=12544)))
    assert _image_budget(old) == {"min_pixels": 3136, "max_pixels": 12544}
    assert _image_budget(SimpleNamespace(processor=SimpleNamespace())) == {}


def test_an_engine_call_that_does_not_return_stops_at_its_deadline(policy, count_samples, fake_vllm):
    """A generation that never returns (vLLM 0.32 looped on an encoder-cache miss) is an error naming the call after
    `rollout.vllm.timeout` seconds, not a wait forever."""
    import threading
    import time

    from vlmrl.rollout.vllm_engine import EngineTimeout

    release = threading.Event()
    engine = VLLMEngine("unused", {"sleep": False, "timeout": 0.5})
    engine.llm.generate = lambda *args, **kwargs: release.wait(30)
    prompts = make_prompts(policy, count_samples[:1])
    t0 = time.perf_counter()
    with pytest.raises(EngineTimeout, match=r"generation \(1 requests\) did not return within 0.5 s"):
        engine.generate(policy, prompts, count_samples[:1], 2, 4, 1.0, 0, 1.0, [1])
    assert time.perf_counter() - t0 < 5
    release.set()


def test_each_images_placeholder_run_goes_to_vllm_as_one_placeholder():
    """vLLM expands each image's placeholder itself (it expanded the trainer's already-expanded run again)."""
    from vlmrl.rollout.vllm_compat import check_prompt_ids, engine_prompt_ids

    p = 9  # the placeholder id; two images of 3 and 2 features, then text
    ids = [1, 5, p, p, p, 6, 5, p, p, 6, 7]
    assert engine_prompt_ids(ids, p, [3, 2]) == [1, 5, p, 6, 5, p, 6, 7]
    assert engine_prompt_ids([1, 2], p, []) == [1, 2]
    with pytest.raises(ValueError, match="image 1's placeholder run is not 3"):
        engine_prompt_ids(ids, p, [3, 3])
    with pytest.raises(ValueError, match="1 placeholder run"):
        engine_prompt_ids(ids[:6], p, [3, 2])
    check_prompt_ids(ids, ids, "s")
    with pytest.raises(RuntimeError, match="a prompt of 13 tokens where the trainer's has 11 .first difference at "
                                           "token 5"):
        check_prompt_ids(ids, [1, 5, p, p, p, p, p, 6, 5, p, p, 6, 7], "s")
