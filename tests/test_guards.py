"""No silent failures in the update: a non-finite step is skipped, counted and (K in a row) stops the run; a failed
reward trains nothing; `minibatches` gives that many optimizer steps; the schedule waits for a real step."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2VLForConditionalGeneration

from vlmrl.algorithms.losses import POLICY_LOSSES, PolicyLossOutput
from vlmrl.config import load_config
from vlmrl.errors import TrainingError
from vlmrl.models import load_policy
from vlmrl.rewards import REWARDS, RewardFailure, RewardSpec
from vlmrl.trainer.guard import NonfiniteGuard, guarded_step
from vlmrl.trainer.rl import StepContext, build_trajectories, collect_and_score, rl_step
from vlmrl.trainer.run import train
from vlmrl.trainer.update import update

from .test_train_e2e import SMALL


def varied(completions, **_):
    """A reward that differs within a group even for an untrained model, so a step has a gradient."""
    return [float(len(c)) for c in completions]


def nan_on_calls(monkeypatch, calls: set[int] | None = None, start: int | None = None):
    """Make the ppo_clip loss NaN (loss and gradient) on the given calls (1-based), or on every call from `start`."""
    real, seen = POLICY_LOSSES["ppo_clip"], []

    def loss(*args, **kwargs) -> PolicyLossOutput:
        out = real(*args, **kwargs)
        seen.append(1)
        k = len(seen)
        if (calls and k in calls) or (start is not None and k >= start):
            return out._replace(per_token_loss=out.per_token_loss * float("nan"))
        return out

    monkeypatch.setitem(POLICY_LOSSES, "ppo_clip", loss)


def run_config(tmp_path, *extra):
    return load_config(None, SMALL + [f"trainer.output_dir={tmp_path / 'run'}", "sft.steps=0", "data.eval.n=2",
                                      "trainer.tensorboard=false", "rewards=[{name: varied_test}]", *extra])


@pytest.fixture
def varied_reward(monkeypatch):
    varied.__vlmrl_inline__ = True
    monkeypatch.setitem(REWARDS, "varied_test", varied)


def test_a_nan_step_is_skipped_counted_and_the_run_finishes(tmp_path, monkeypatch, varied_reward):
    nan_on_calls(monkeypatch, calls={2})  # step 2's loss (one loss call per step here)
    summary = train(run_config(tmp_path, "trainer.steps=3", "trainer.save_every=1"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["phase"] == "train"]
    assert [r["nonfinite_steps"] for r in steps] == [0, 1, 1]  # a cumulative curve: the jump is the skipped step
    assert [r["optimizer_steps"] for r in steps] == [1, 0, 1]
    assert summary["final"] and (tmp_path / "run" / "checkpoint-3").is_dir()  # the run went on to the end
    w = {k: Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "run" / f"checkpoint-{k}").state_dict()
         for k in (1, 2, 3)}
    assert all(torch.isfinite(v).all() for k in w for v in w[k].values())
    assert all(torch.equal(w[1][n], w[2][n]) for n in w[1])  # the NaN step left the weights as they were
    assert any(not torch.equal(w[2][n], w[3][n]) for n in w[2])  # and the next step trained again


def test_k_nonfinite_steps_in_a_row_stop_the_run_naming_the_step(tmp_path, monkeypatch, varied_reward):
    nan_on_calls(monkeypatch, start=2)
    with pytest.raises(TrainingError, match=r"step 3: 2 optimizer steps in a row .* Likely causes: .*trainer\.lr"):
        train(run_config(tmp_path, "trainer.steps=5", "trainer.max_nonfinite_steps=2"))


# -- one update on a fixed batch -------------------------------------------------------------------------------------
def context(tiny_model_dir, *overrides, rewards=None) -> StepContext:
    cfg = load_config(None, ["rollout.group_size=3", "rollout.max_new_tokens=6", *overrides])
    policy = load_policy(tiny_model_dir)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return StepContext(policy, opt, sched, rewards or [RewardSpec("accuracy", 1.0, {"strict": False})], cfg.rollout,
                       cfg.algorithm, cfg.trainer, generator=torch.Generator().manual_seed(0))


def count_steps(optimizer) -> list[int]:
    calls = []
    optimizer.register_step_post_hook(lambda *_: calls.append(1))
    return calls


def params(ctx) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in ctx.policy.model.named_parameters()}


def signal_batch(ctx, samples):
    batch = collect_and_score(ctx, samples)
    batch.rewards.total = torch.tensor([1.0, 0.0, 0.0] * len(samples))  # every answer has a non-zero advantage
    return batch


def test_minibatches_gives_exactly_that_many_optimizer_steps(tiny_model_dir, count_samples):
    ctx = context(tiny_model_dir, "trainer.minibatches=4")
    batch = signal_batch(ctx, count_samples[:2])  # 6 rows: torch.chunk(4) would make 3 minibatches
    calls = count_steps(ctx.optimizer)
    metrics = update(ctx, batch.prompts, build_trajectories(ctx, batch))
    assert len(calls) == 4 and metrics["optimizer_steps"] == 4
    assert ctx.scheduler.last_epoch == 1 and metrics["nonfinite_steps"] == 0


def test_skipped_steps_leave_weights_and_schedule_alone(tiny_model_dir, count_samples, monkeypatch):
    ctx = context(tiny_model_dir)
    batch = signal_batch(ctx, count_samples[:2])
    traj = build_trajectories(ctx, batch)
    before, calls = params(ctx), count_steps(ctx.optimizer)
    nan_on_calls(monkeypatch, calls={1})
    metrics = update(ctx, batch.prompts, traj)  # a NaN loss: skipped and counted
    assert calls == [] and metrics["optimizer_steps"] == 0 and metrics["nonfinite_steps"] == 1
    assert ctx.scheduler.last_epoch == 0 and not ctx.optimizer.state  # no step, no AdamW state, no lr step
    assert all(torch.equal(before[k], v) for k, v in params(ctx).items())
    batch.rewards.total = torch.ones(6)  # every group all-equal: every advantage 0, an all-zero gradient
    metrics = update(ctx, batch.prompts, build_trajectories(ctx, batch))
    assert calls == [] and metrics["optimizer_steps"] == 0 and ctx.scheduler.last_epoch == 0
    assert metrics["nonfinite_steps"] == 1 and ctx.guard.streak == 0  # a finite step ends the streak
    metrics = update(ctx, batch.prompts, build_trajectories(ctx, signal_batch(ctx, count_samples[:2])))
    assert calls == [1] and metrics["optimizer_steps"] == 1 and ctx.scheduler.last_epoch == 1


def test_guarded_step_skips_an_infinite_gradient_even_with_a_finite_loss():
    w = torch.nn.Parameter(torch.ones(3))
    opt, guard = torch.optim.AdamW([w], lr=0.1), NonfiniteGuard()
    (w * torch.tensor([1.0, float("inf"), 1.0])).sum().backward()
    out = guarded_step([(opt, [w])], 1.0, 1.0, guard, ctx_dist(), step=7, limit=2)
    assert not out.finite and out.stepped == [False] and guard.total == 1 and torch.equal(w.detach(), torch.ones(3))
    (w * torch.tensor([1.0, float("nan"), 1.0])).sum().backward()
    with pytest.raises(TrainingError, match="step 7: 2 optimizer steps in a row"):
        guarded_step([(opt, [w])], 1.0, 1.0, guard, ctx_dist(), step=7, limit=2)


def ctx_dist():
    from vlmrl.trainer.distributed import DistInfo

    return DistInfo()


# -- a failed reward is not a penalty --------------------------------------------------------------------------------
def flaky(completions, **_):
    """1.0 for every answer, except the second of the batch, whose scoring 'timed out'."""
    return [RewardFailure("timed out") if i == 1 else 1.0 for i in range(len(completions))]


def test_a_failed_reward_in_an_all_equal_group_trains_nothing(tiny_model_dir, count_samples, monkeypatch):
    flaky.__vlmrl_inline__ = True
    monkeypatch.setitem(REWARDS, "flaky_test", flaky)
    ctx = context(tiny_model_dir, "rollout.group_size=4", rewards=[RewardSpec("flaky_test")])
    batch = collect_and_score(ctx, count_samples[:2])
    assert batch.rewards.failed.tolist() == [False, True] + [False] * 6
    assert batch.rewards.total.tolist()[:4] == [1.0, 0.0, 1.0, 1.0]  # the failed one has no score, not a low one
    traj = build_trajectories(ctx, batch)
    assert torch.equal(traj.advantages, torch.zeros(8))  # the others are not pushed up by the failure
    assert traj.loss_mask[1].sum() == 0 and traj.loss_mask[0].sum() > 0  # the failed answer gets no loss
    before = params(ctx)
    metrics, _ = rl_step(ctx, count_samples[:2])
    assert metrics["reward/failed_samples"] == 1 and metrics["reward/total/mean"] == 1.0
    assert metrics["zero_variance_groups"] == 1.0 and metrics["optimizer_steps"] == 0
    assert all(torch.equal(before[k], v) for k, v in params(ctx).items())  # nothing to learn: weights unchanged
