"""Environment steps off the decoding loop (vlmrl.agent.steps): a trajectory's step starts while the other rows still
decode, steps run beside each other, and the trajectories are the ones the sequential loop gives, bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

import vlmrl.agent.rollout as agent_rollout_module
from vlmrl.agent import AgentLimits, agent_rollout
from vlmrl.agent.env import Observation
from vlmrl.agent.steps import EnvSteps
from vlmrl.rollout.batch import make_prompts


def ends_soon(policy, boost: float = 4.0):
    """A random tiny model rarely samples its end token: make it likely, so turns end at different decoding steps."""
    head, eos = policy.family.lm_head, policy.eos_token_ids[0]

    def biased(hidden):
        logits = head(hidden)
        logits[..., eos] += boost
        return logits

    policy.family.lm_head = biased


class Look:
    """Answers every message with text that depends on it and an image, for three turns (deterministic, per
    trajectory: the sequential loop and the overlapped one must agree)."""

    def __init__(self, sample, tools, context):
        self.context, self.turns = context, 0

    def step(self, message):
        self.turns += 1
        return Observation([{"type": "text", "text": f"seen {len(message)} chars, turn {self.turns}"},
                            {"type": "image", "image": self.context.images[0]}])


def rollout(policy, samples, env, workers, limits=None, seeds=(3, 4, 5, 6)):
    limits = limits or AgentLimits(max_turns=3, turn_tokens=10, max_total_tokens=400, max_images=4)
    return agent_rollout(policy, make_prompts(policy, samples), samples, 4, limits, {}, env, 1.0,
                         prompt_seeds=list(seeds[:len(samples)]), max_pixels=84 * 84, env_workers=workers).rollout


def test_overlapped_steps_give_the_sequential_trajectories_bit_for_bit(policy, count_samples):
    """16 trajectories, 3 turns, budgets that bind for some rows: 8 workers (steps started mid-decoding) against 1
    (every step after the turn, in order): the same ids, masks, log-probs, truncation, texts, turns and
    conversation tensors."""
    ends_soon(policy)
    samples = count_samples[:4]
    a, b = rollout(policy, samples, Look, 1), rollout(policy, samples, Look, 8)
    turns = a.columns["num_turns"]
    assert max(turns) == 3 and min(turns) < 3 and a.truncated.any() and not a.truncated.all()  # the loop was exercised
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.truncated, b.truncated)
    assert a.texts == b.texts and a.columns["turns"] == b.columns["turns"]
    assert torch.equal(a.context.input_ids, b.context.input_ids)
    assert a.context.vision.keys() == b.context.vision.keys()
    for key in a.context.vision:
        assert torch.equal(a.context.vision[key], b.context.vision[key])


def test_a_step_starts_while_other_rows_still_decode(policy, count_samples, monkeypatch):
    """The first row to end its turn has its environment stepped before the turn's generation call returns: the
    step waits on nothing the decoding does, and a later decoding step waits (up to 10 s) until it has run."""
    ends_soon(policy, boost=2.0)
    stepped, returned = threading.Event(), []
    generate = agent_rollout_module.generate

    def watching(*args, on_token=None, **kwargs):
        def waiting(tokens, alive):
            if not alive.all():  # some row has ended: its step was started; give it the time to run
                stepped.wait(10)
            return on_token(tokens, alive)
        out = generate(*args, on_token=waiting, **kwargs)
        returned.append(stepped.is_set())
        return out

    monkeypatch.setattr(agent_rollout_module, "generate", watching)

    class Mark(Look):
        def step(self, message):
            stepped.set()
            return super().step(message)

    out = rollout(policy, count_samples[:2], Mark, 8,
                  AgentLimits(max_turns=1, turn_tokens=12, max_total_tokens=400), seeds=(11, 12))
    ended_by_token = [int(out.completion_ids[j, int(out.completion_mask[j].sum()) - 1]) in policy.eos_token_ids
                      for j in range(len(out.texts))]
    lengths = out.completion_mask.sum(1)
    assert any(ended_by_token) and lengths.min() < lengths.max()  # rows ended at different steps
    assert returned == [True]  # stepped before the call returned


@pytest.mark.parametrize("workers, wait, ok", [(4, 5.0, True), (1, 0.2, False)])
def test_steps_run_beside_each_other(policy, count_samples, workers, wait, ok):
    """Four trajectories whose environments each wait for all four (a barrier): they all get through with 4 workers;
    with one worker the first waits alone (the barrier breaks: each error ends that episode, counted)."""
    ends_soon(policy, boost=8.0)  # every row ends its first turn at once
    barrier = threading.Barrier(4, timeout=wait)

    class Together(Look):
        def step(self, message):
            barrier.wait()
            return Observation(done=True)

    out = rollout(policy, count_samples[:1], Together, workers, AgentLimits(1, 4, 400), seeds=(5,))
    errors = [t[0]["errors"] for t in out.columns["turns"]]
    assert errors == ([[]] * 4 if ok else [["env_raised"]] * 4)


def test_an_environment_that_raises_on_a_worker_ends_only_its_episode(policy, count_samples):
    ends_soon(policy, boost=8.0)

    class Sometimes(Look):
        def __init__(self, sample, tools, context):
            super().__init__(sample, tools, context)
            self.bad = sample["id"] == count_samples[0]["id"]

        def step(self, message):
            if self.bad:
                raise ValueError("the simulator crashed")
            return Observation(done=True)

    out = rollout(policy, count_samples[:2], Sometimes, 8, AgentLimits(2, 4, 400), seeds=(5, 6))
    errors = [t[0]["errors"] for t in out.columns["turns"]]
    assert errors[:4] == [["env_raised"]] * 4 and errors[4:] == [[]] * 4
    assert out.columns["turns"][0][0]["env_error"] == "ValueError: the simulator crashed"


def test_the_early_text_must_be_the_calls_text(policy):
    """The step started mid-call decodes the row itself; the rollout checks it against the call's text and stops
    with an internal error rather than going on with an environment that saw other words."""
    tok, eos = policy.processor.tokenizer, policy.eos_token_ids[0]
    seen = []

    class Env:
        def step(self, message):
            seen.append(message)
            return Observation(done=True)

    steps = EnvSteps(2, tok, policy.eos_token_ids)
    try:
        steps.begin([Env()])
        ids = tok("<answer>5</answer>", add_special_tokens=False)["input_ids"] + [eos]
        watched = steps.watch(lambda tokens, alive: None)
        for i in ids:
            watched(torch.tensor([i]), torch.tensor([True]))
        obs, error = steps.result(0, "<answer>5</answer>")
        assert obs.done and error is None and seen == ["<answer>5</answer>"]
        steps.begin([Env()])
        for i in ids:
            watched(torch.tensor([i]), torch.tensor([True]))
        with pytest.raises(RuntimeError, match="env_workers=1"):
            steps.result(0, "<answer>6</answer>")
    finally:
        steps.close()
