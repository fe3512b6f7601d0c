"""Agents on the colocated vLLM engine, and image caches after a weight push, against a stand-in for `vllm.LLM` only
(`VLLMEngine`, its requests and the turn loop are the real code): per turn it records the token ids, images, seeds
and budgets it receives, and sleep, wake, weight loads and cache resets in order; it answers from a script with
token ids a tokenizer would never produce for the text (one token per character), so ids that were re-tokenised
instead of kept show."""

from __future__ import annotations

import copy
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from vlmrl.agent import AgentLimits, AgentSpec, agent_rollout
from vlmrl.agent.env import ToolEnvironment
from vlmrl.agent.rollout import agent_metrics, turn_seed
from vlmrl.agent.tools import BUILTIN_TOOLS
from vlmrl.config import LoraConfig, load_config
from vlmrl.errors import DataError
from vlmrl.models import load_policy
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.vllm_engine import LAUNCHER_KEYS, VLLMEngine, batch_requests

from .test_vllm_engine import FakeLLM

ZOOM = '<tool_call>{"name":"zoom","arguments":{"box":[0,0,28,28]}}</tool_call>'
CALC = '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'
ZOOM_LONGER = '<tool_call>{"name":"zoom","arguments":{"box":[10,10,30,30]}}</tool_call>'
ANSWER = "<answer>5</answer>"


def tool_env(sample, tools, context):
    return ToolEnvironment(sample, tools, context)


class ScriptedLLM(FakeLLM):
    """Stands in for `vllm.LLM` (the phases, weight loads and cache resets recorded as tests/test_vllm_engine.py's
    FakeLLM does). `script(call, answer)` gives the message (text, or token ids) of answer number `answer` (requests
    in order, n answers each) of generate call number `call`; it comes back one token per character, then the first
    stop token, cut at the request's `max_tokens`, with log-prob -0.01 * (position + 1)."""

    tokenizer = None
    script = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[list[dict]] = []  # per generate call, per request: what it received

    def generate(self, prompts, params, use_tqdm=False):
        call = len(self.calls)
        self.events.append("generate")
        received, outputs, answer = [], [], 0
        for prompt, p in zip(prompts, params, strict=True):
            image = prompt.get("multi_modal_data", {}).get("image")
            received.append({"ids": list(prompt["prompt_token_ids"]), "n": p.n, "seed": p.seed,
                             "max_tokens": p.max_tokens, "mm": prompt.get("mm_processor_kwargs"),
                             "images": [] if image is None else image if isinstance(image, list) else [image]})
            completions = []
            for _ in range(p.n):
                message = type(self).script(call, answer)
                answer += 1
                ids = message if isinstance(message, list) else \
                    [self.tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in message]
                ids = (ids + [p.stop_token_ids[0]])[:p.max_tokens]
                completions.append(SimpleNamespace(token_ids=ids, logprobs=[
                    {t: SimpleNamespace(logprob=-0.01 * (k + 1))} for k, t in enumerate(ids)]))
            outputs.append(SimpleNamespace(outputs=completions))
        self.calls.append(received)
        return outputs


class OldLLM(ScriptedLLM):
    """A vLLM without `reset_encoder_cache` (older releases)."""

    reset_encoder_cache = None


@pytest.fixture
def engine_for(monkeypatch):
    """engine_for(policy, script, llm=ScriptedLLM): a `VLLMEngine` (sleeping between phases) over the stand-in."""

    def make(policy, script=lambda call, answer: ANSWER, llm=ScriptedLLM):
        cls = type("LLM", (llm,), {"tokenizer": policy.processor.tokenizer, "script": staticmethod(
            (lambda call, answer: script[call][answer]) if isinstance(script, dict) else script)})
        module = types.ModuleType("vllm")
        module.LLM, module.SamplingParams = cls, lambda **kwargs: SimpleNamespace(**kwargs)
        monkeypatch.setitem(sys.modules, "vllm", module)
        for key in LAUNCHER_KEYS:
            monkeypatch.setenv(key, "x")
            monkeypatch.delenv(key)
        return VLLMEngine("unused", {"sleep": True}, seed=0)

    return make


def _unpadded(batch, row: int) -> list[int]:
    return batch.input_ids[row][batch.attention_mask[row].bool()].tolist()


def _one_placeholder(ids: list[int], image: int) -> list[int]:
    """`ids` with every run of image placeholders cut to one (the zoom task's images never touch)."""
    return [t for k, t in enumerate(ids) if t != image or k == 0 or ids[k - 1] != image]


def _expanded_length(ids: list[int], sent: int, image: int) -> int:
    """How many of the trainer's `ids` the first `sent` ids with one placeholder per image stand for."""
    return next(n for n in range(len(ids) + 1) if len(_one_placeholder(ids[:n], image)) == sent and
                (n == len(ids) or ids[n] != image))


def test_every_turn_sends_the_trainers_ids_all_images_own_seed_and_budget(policy, count_samples, engine_for):
    samples, group, seeds = count_samples[:2], 2, [11, 12]
    # turn 0: zoom, answer, zoom, zoom; turn 1 (trajectories 0, 2, 3): calculate, zoom, answer; turn 2 (0, 2)
    script = {0: [ZOOM, ANSWER, ZOOM_LONGER, ZOOM], 1: [CALC, ZOOM, ANSWER], 2: [ANSWER, ANSWER]}
    engine = engine_for(policy, script)
    llm, tok = engine.llm, policy.processor.tokenizer
    limits = AgentLimits(max_turns=3, turn_tokens=80, max_total_tokens=300, max_images=2)
    prompts = make_prompts(policy, samples)
    out = agent_rollout(policy, prompts, samples, group, limits, BUILTIN_TOOLS, tool_env, 1.0, prompt_seeds=seeds,
                        max_pixels=84 * 84, engine=engine)
    # awake from the first turn to the last: no sleep (which frees the prefix cache) or reset between turns
    assert llm.events == ["sleep", "wake", "generate", "generate", "generate", "sleep"]
    assert out.rollout.columns["num_turns"] == [3, 1, 3, 2]
    # turn 0: one request per prompt, G answers from the prompt's seed, its images, the turn's budget
    first = llm.calls[0]
    assert [q["n"] for q in first] == [group] * 2 and [q["seed"] for q in first] == seeds
    image = policy.processor.image_token_id
    assert [q["ids"] for q in first] == [_one_placeholder(_unpadded(prompts, p), image) for p in range(2)]
    assert [q["images"] for q in first] == [s["images"] for s in samples]
    assert [q["max_tokens"] for q in first] == [80, 80] and first[0]["mm"] == {"min_pixels": 56 * 56,
                                                                                 "max_pixels": 84 * 84}
    context, episodes = out.rollout.context, out.episodes
    budgets_differ = False
    for turn in (1, 2):
        live = [i for i, e in enumerate(episodes) if len(e.turns) > turn]
        sent = llm.calls[turn]
        assert len(sent) == len(live)
        budgets = []
        for q, i in zip(sent, live, strict=True):
            e, p = episodes[i], i // group
            prompt = _unpadded(prompts, p)
            trainer = _unpadded(context, i)  # the row every log-prob pass of the update runs on
            # sent with one placeholder per image (vLLM expands it to the image's features): the trainer's ids
            n = _expanded_length(trainer, len(q["ids"]), policy.processor.image_token_id)
            assert q["ids"] == _one_placeholder(trainer[:n], policy.processor.image_token_id)
            assert trainer[:n] == prompt + e.ids[:n - len(prompt)]
            # what this turn sampled is exactly what follows in the trainer's row: ids kept, never re-tokenised
            message = script[turn][live.index(i)]
            sampled = [tok(c, add_special_tokens=False)["input_ids"][0] for c in message] + [policy.eos_token_ids[0]]
            assert trainer[n:n + len(sampled)] == sampled
            assert tok(message, add_special_tokens=False)["input_ids"] + [policy.eos_token_ids[0]] != sampled
            shown = sum(len(t["images"]) for t in e.turns[:turn])
            assert q["images"] == list(samples[p]["images"]) + e.images[:shown] and q["n"] == 1
            assert q["seed"] == turn_seed(seeds[p], i % group, turn)
            budget = min(limits.turn_tokens, limits.max_total_tokens - (n - len(prompt)))
            assert q["max_tokens"] == budget
            budgets.append(budget)
        budgets_differ |= len(set(budgets)) > 1
    assert budgets_differ  # the episodes' own room, not one budget for the call
    assert len(llm.calls[2][0]["images"]) == 2 and len(llm.calls[2][1]["images"]) == 3  # every image so far
    # the engine's log-probs are the rollout's sampling log-probs, on the policy's tokens only
    r = out.rollout
    first_turn = len(ZOOM) + 1
    assert torch.allclose(r.logprobs[0, :first_turn], -0.01 * torch.arange(1, first_turn + 1).float())
    assert bool((r.logprobs[r.completion_mask == 0] == 0).all())


def test_placeholders_that_do_not_match_the_images_name_the_sample_and_turn(policy, count_samples, engine_for):
    samples = count_samples[:1]
    engine = engine_for(policy, {0: [ZOOM], 1: [ANSWER]})
    prompts = make_prompts(policy, samples)
    out = agent_rollout(policy, prompts, samples, 1, AgentLimits(2, 80, 300, 2), BUILTIN_TOOLS, tool_env, 1.0,
                        prompt_seeds=[3], max_pixels=84 * 84, engine=engine)
    context, images = out.rollout.context, [list(samples[0]["images"]) + out.episodes[0].images]
    assert len(batch_requests(policy, context, images, [1], [8], 1, 2)[0].images) == 2
    sid = samples[0]["id"]
    with pytest.raises(DataError, match=f"sample {sid!r}, turn 2: .* 1 image"):  # the tool's image lost
        batch_requests(policy, context, [images[0][:1]], [1], [8], 1, 2)
    with pytest.raises(DataError, match=f"sample {sid!r}, turn 2"):  # a placeholder without its image
        stray = copy.copy(context)
        stray.input_ids = context.input_ids.clone()
        stray.input_ids[0, -1] = policy.processor.image_token_id
        batch_requests(policy, stray, images, [1], [8], 1, 2)


def test_a_placeholder_the_policy_sampled_ends_its_trajectory_on_vllm(policy, count_samples, engine_for):
    tok, pad = policy.processor.tokenizer, policy.processor.image_token_id
    zoom = [tok(c, add_special_tokens=False)["input_ids"][0] for c in ZOOM]
    engine = engine_for(policy, {0: [zoom + [pad], ZOOM], 1: [ANSWER]})
    samples = count_samples[:1]
    out = agent_rollout(policy, make_prompts(policy, samples), samples, 2, AgentLimits(2, 80, 300, 2),
                        BUILTIN_TOOLS, tool_env, 1.0, prompt_seeds=[5], max_pixels=84 * 84, engine=engine)
    # vLLM would take the sampled id for an image slot: that trajectory ends, the other goes on
    assert len(engine.llm.calls[1]) == 1 and out.rollout.columns["num_turns"] == [1, 2]
    assert agent_metrics(out.rollout.columns)["agent/ended/sampled_placeholder"] == 1.0


def _pushed_resets(engine, policy) -> list[str]:
    before = len(engine.llm.events)
    engine.push_weights(policy)
    return engine.llm.events[before:]


def test_every_push_resets_the_prefix_encoder_and_image_caches(tiny_model_dir, count_samples, engine_for):
    """vLLM 0.32 reloads weights with the model runner's encoder cache cleared, so the scheduler's record of cached
    image features must be cleared after every push, whatever trained (else a repeated image is a cache miss the
    engine loops on; tests/test_vllm_real.py shows it on the real engine)."""
    from vlmrl.models.trainable import add_lora, freeze

    full = load_policy(tiny_model_dir)  # everything trains, the tower and the projector too
    engine = engine_for(full)
    assert engine.llm.kwargs["enable_prefix_caching"] is True
    every = ["wake", "load", "reset_prefix", "reset_encoder", "reset_mm", "sleep"]
    assert _pushed_resets(engine, full) == every
    # single-turn rollouts too: generate, push, generate (the repeated image is encoded with the pushed weights)
    prompts = make_prompts(full, count_samples[:2])
    engine.generate(full, prompts, count_samples[:2], 2, 4, 1.0, 0, 1.0, [1, 2])
    engine.push_weights(full)
    engine.generate(full, prompts, count_samples[:2], 2, 4, 1.0, 0, 1.0, [1, 2])
    assert engine.llm.events[-12:] == ["wake", "generate", "sleep", *every, "wake", "generate", "sleep"]
    frozen = load_policy(tiny_model_dir)
    freeze(frozen, vision=True, projector=True)
    assert _pushed_resets(engine, frozen) == every  # text weights only, every cache all the same
    pytest.importorskip("peft")
    lora = add_lora(load_policy(tiny_model_dir), LoraConfig(r=4, alpha=8), tiny_model_dir)
    assert _pushed_resets(engine, lora) == every
    # a vLLM that cannot reset its encoder cache is refused, not left with stale features
    old = engine_for(full, llm=OldLLM)
    with pytest.raises(RuntimeError, match="reset_encoder_cache"):
        old.push_weights(frozen)


def test_an_agentic_step_on_vllm_samples_every_turn_awake_then_pushes(tiny_model_dir, count_samples, engine_for):
    from tests.test_algorithms_e2e import _context
    from vlmrl.trainer.rl import rl_step

    cfg = load_config(None, ["rollout.group_size=2", "rollout.max_new_tokens=6"])
    policy = load_policy(tiny_model_dir)
    engine = engine_for(policy, lambda call, answer: ZOOM if call % 2 == 0 else ANSWER)
    ctx = _context(policy, cfg)
    ctx.agent, ctx.engine = AgentSpec(AgentLimits(2, 80, 300, 2), BUILTIN_TOOLS, tool_env, 84 * 84), engine
    for step in (1, 2):
        ctx.step = step
        before = len(engine.llm.events)
        metrics, _ = rl_step(ctx, count_samples[:2])
        assert engine.llm.events[before:] == ["wake", "generate", "generate", "sleep", "wake", "load", "reset_prefix",
                                              "reset_encoder", "reset_mm", "sleep"]
        assert metrics["agent/turns_per_episode"] == 2.0 and metrics["agent/images_per_episode"] == 1.0
        assert 0.0 <= metrics["rollout/logprob_gap_mean"] < float("inf")
    # each step's prompts have their own seeds; a step's turn 1 seeds follow from them
    seeds = [q["seed"] for q in engine.llm.calls[0]] + [q["seed"] for q in engine.llm.calls[2]]
    assert len(set(seeds)) == 4
