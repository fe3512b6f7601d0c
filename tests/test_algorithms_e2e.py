"""Every algorithm recipe runs end to end on a very small model; micro-batching never changes the update."""

import copy
import json
from pathlib import Path

import pytest
import torch

from vlmrl.config import load_config
from vlmrl.models import load_policy
from vlmrl.rewards import RewardSpec
from vlmrl.trainer.rl import (
    StepContext,
    build_trajectories,
    collect_and_score,
    dynamic_sampling,
    first_round_size,
    resample_size,
)
from vlmrl.trainer.run import train
from vlmrl.trainer.update import micro_batches, row_tokens, update

from .test_train_e2e import SMALL

ROOT = Path(__file__).resolve().parents[1]
# every recipe on the embedded model (GPU recipes name hub models; the judge recipe needs its server: own test)
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")
                 if p.name != "quickstart_judge.yaml" and not p.name.startswith("reclip")  # (own config, own tests)
                 and load_config(p).model.name_or_path == "tiny")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_two_steps(recipe, tmp_path):
    extra = ["rollout.prompts_per_step=6"] if recipe == "reinforce_pp_single.yaml" else []
    cfg = load_config(ROOT / "recipes" / recipe, SMALL + extra + [f"trainer.output_dir={tmp_path / 'run'}",
                                                                   "trainer.steps=2", "sft.steps=3"])
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["phase"] == "train"]
    assert len(steps) == 2
    for r in steps:
        assert all(v == v for v in r.values() if isinstance(v, float)), f"NaN in {r}"  # NaN != NaN
        if cfg.algorithm.beta > 0:
            assert "kl" in r
        if cfg.algorithm.advantage == "gae":
            assert "value_loss" in r
        if cfg.algorithm.policy_loss == "dpo":
            assert "dpo/pairs" in r
        if cfg.algorithm.dynamic_sampling:
            assert "dynamic_sampling/rounds" in r


def _context(policy, cfg, **algo):
    a = copy.deepcopy(cfg.algorithm)
    for k, v in algo.items():
        setattr(a, k, v)
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return StepContext(policy, opt, sched, [RewardSpec("accuracy", 1.0, {"strict": False})], cfg.rollout, a,
                       copy.deepcopy(cfg.trainer), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("aggregation,chunking", [("token-mean", {"micro_batch": 1}),
                                                  ("seq-mean-token-mean", {"micro_batch": 1}),
                                                  ("seq-mean-token-sum-norm", {"micro_batch": 1}),
                                                  ("token-mean", {"micro_batch_tokens": 3}),
                                                  ("seq-mean-token-sum-norm", {"micro_batch_tokens": 3})])
def test_micro_batching_does_not_change_the_update(tiny_model_dir, count_samples, aggregation, chunking):
    """Invariant 5 (docs/concepts.md): micro-batches (of one row, or by token budget, longest rows first and each chunk's
    completions trimmed to its longest) and the whole batch give the same parameters after one step."""
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6"])
    a, b = load_policy(tiny_model_dir), load_policy(tiny_model_dir)
    ctx_a = _context(a, cfg, loss_aggregation=aggregation)
    batch = collect_and_score(ctx_a, count_samples[:3])
    batch.rewards.total = torch.tensor([1.0, 0.0, 0.5, 0.0] * 3)  # make every group carry signal
    traj = build_trajectories(ctx_a, batch)
    ctx_b = _context(b, cfg, loss_aggregation=aggregation)
    if "micro_batch_tokens" in chunking:  # a budget of about 3 rows: several chunks of several rows
        prompt_len, completion_len = row_tokens(batch.prompts, traj)
        budget = chunking["micro_batch_tokens"] * int(prompt_len.max() + completion_len.max())
        chunking = {"micro_batch_tokens": budget}
        chunks = micro_batches(torch.arange(12), (prompt_len, completion_len), 0, budget)
        assert 2 < len(chunks) < 12 and sorted(torch.cat(chunks).tolist()) == list(range(12))
    for key, value in chunking.items():
        setattr(ctx_b.trainer, key, value)
    update(ctx_a, batch.prompts, traj)
    update(ctx_b, batch.prompts, traj)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    moved = max((pa[k] - p0).abs().max().item() for k, p0 in load_policy(tiny_model_dir).model.named_parameters())
    assert moved > 1e-4  # the step did something
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=1e-5), k


def test_dynamic_sampling_refills_with_groups_that_carry_signal(tiny_model_dir, count_samples):
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.prompts_per_step=3"])
    policy = load_policy(tiny_model_dir)
    ctx = _context(policy, cfg, dynamic_sampling=True, max_resample_rounds=2)
    pool = iter(count_samples[3:])
    first = collect_and_score(ctx, count_samples[:3])
    # rewards: group 0 all equal (dropped), groups 1 and 2 differ (kept)
    first.rewards.total = torch.tensor([1.0] * 4 + [1.0, 0.0, 0.0, 0.0] + [0.0, 0.0, 1.0, 1.0])
    out = dynamic_sampling(ctx, first, lambda k: [next(pool) for _ in range(k)], 3)
    assert out.stats["dynamic_sampling/rounds"] >= 1  # two groups were not enough: it sampled again
    assert out.stats["dynamic_sampling/prompts"] == 3 * (1 + out.stats["dynamic_sampling/rounds"])
    n_groups = len(out.samples)
    assert n_groups <= 3 and out.rollout.completion_ids.shape[0] == 4 * n_groups
    assert out.samples[0]["id"] == count_samples[1]["id"] and out.samples[1]["id"] == count_samples[2]["id"]
    assert out.rewards.total[:8].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    # the kept rows still answer their own prompts: prompt_index and prompts line up with the samples
    assert out.rollout.prompt_index.tolist() == [p for p in range(n_groups) for _ in range(4)]
    assert out.prompts.sample_ids == [s["id"] for s in out.samples]


@pytest.mark.parametrize("found,generated,size", [
    (4, 16, 48),  # 12 missing at 4 of 16: 12 * 16 / 4 prompts
    (15, 100, 7),  # 1 missing at 15 of 100: ceil(100 / 15)
    (0, 16, 96),  # nothing found: the rest of the budget, (1 + 6) * 16 - 16
    (10, 16, 10),  # the share says 10 * 16 / 10 = 9.6 -> 10: never fewer than the missing groups
    (12, 110, 2),  # 4 missing would need ceil(4 * 110 / 12) = 37, but only 112 - 110 = 2 prompts are left
    (12, 112, 0),  # the budget is spent: stop
    (16, 40, 0),  # the batch is full
])
def test_resample_size_fill_draws_what_the_signal_share_says(tiny_model_dir, found, generated, size):
    cfg = load_config(None, ["rollout.prompts_per_step=16"])
    ctx = _context(load_policy(tiny_model_dir), cfg, dynamic_sampling=True, max_resample_rounds=6,
                   resample_draw="fill")
    assert resample_size(ctx, found, generated) == size
    ctx.algorithm.resample_draw = "batch"  # the default: every round draws a batch
    assert resample_size(ctx, found, generated) == 16


def test_dynamic_sampling_fill_draws_the_missing_share_in_one_round(tiny_model_dir, count_samples):
    """One group of three carried a signal, so the next round draws (3 - 1) * 3 / 1 = 6 prompts at once (the budget
    of 1 + 2 rounds of 3 leaves 6): one generation call where "batch" would make two."""
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.prompts_per_step=3"])
    ctx = _context(load_policy(tiny_model_dir), cfg, dynamic_sampling=True, max_resample_rounds=2,
                   resample_draw="fill")
    asked, pool = [], iter(count_samples[3:])

    def draw(k):
        asked.append(k)
        return [next(pool) for _ in range(k)]

    first = collect_and_score(ctx, count_samples[:3])
    first.rewards.total = torch.tensor([1.0] * 4 + [1.0, 0.0, 0.0, 0.0] + [0.0] * 4)
    out = dynamic_sampling(ctx, first, draw, 3)
    assert asked[0] == 6
    assert out.stats["dynamic_sampling/prompts"] == 3 + sum(asked) <= 9
    assert out.samples[0]["id"] == count_samples[1]["id"] and len(out.samples) <= 3
    assert out.rollout.prompt_index.tolist() == [p for p in range(len(out.samples)) for _ in range(4)]


def test_under_torchrun_every_round_is_a_multiple_of_the_ranks(tiny_model_dir):
    """With 2 processes each rank generates for as many prompts: 7 and 17 prompts become 8 and 18 (the step's
    budget, (1 + 6) x 16, is already a multiple)."""
    from vlmrl.trainer.distributed import DistInfo

    cfg = load_config(None, ["rollout.prompts_per_step=16"])
    ctx = _context(load_policy(tiny_model_dir), cfg, dynamic_sampling=True, max_resample_rounds=6,
                   resample_draw="fill")
    ctx.dist = DistInfo("ddp", 0, 2, 0, "cpu")
    assert resample_size(ctx, 15, 100) == 8  # ceil(100 / 15) = 7 in one process
    assert resample_size(ctx, 12, 110) == 2 and resample_size(ctx, 0, 16) == 96
    ctx.signal_share = 0.95  # ceil(16 / 0.95) = 17 in one process
    assert first_round_size(ctx) == 18


@pytest.mark.parametrize("share,size", [(None, 16), (0.25, 64), (0.9, 18), (1.0, 16), (0.1, 112), (0.0, 112)])
def test_first_round_fill_draws_for_the_last_steps_signal_share(tiny_model_dir, share, size):
    """16 groups wanted: 16 / share prompts (64 at a quarter; ceil(17.8) = 18 at 0.9), never fewer than 16 nor more
    than (1 + 6) x 16; no share yet (the first step) draws 16, and so does the batch draw whatever the share."""
    cfg = load_config(None, ["rollout.prompts_per_step=16"])
    ctx = _context(load_policy(tiny_model_dir), cfg, dynamic_sampling=True, max_resample_rounds=6,
                   resample_draw="fill")
    ctx.signal_share = share
    assert first_round_size(ctx) == size
    ctx.algorithm.resample_draw = "batch"
    assert first_round_size(ctx) == 16
