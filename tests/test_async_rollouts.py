"""Asynchronous rollouts with bounded staleness (vlmrl/trainer/asynchronous.py): staleness 0 is synchronous training
bit for bit, staleness S trains each step on exactly the version S behind, answers older than the bound are dropped
and counted, a failed or stuck producer stops the run with a clear error, and resume is exact."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch

import vlmrl.trainer.asynchronous as asynchronous
from vlmrl.errors import TrainingError
from vlmrl.trainer.run import train

from .test_train_e2e import SMALL

GRPO = ["sft.steps=2", "trainer.lr=3e-2", "trainer.steps=4", "rollout.prompts_per_step=2", "rollout.group_size=3",
        "trainer.log_rollouts_every=0"]


# answers of different lengths score differently even for an untrained model, so every step moves the weights
REWARD = "def score(completions, **columns):\n    return [float(len(c) % 3) for c in completions]\n"


def run(tmp_path: Path, name: str, *extra: str, resume: Path | None = None) -> dict:
    from vlmrl.config import load_config

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    cfg = load_config(None, [*SMALL, *GRPO, f"trainer.output_dir={tmp_path / name}",
                             f"rewards=[{{name: '{reward}:score', isolate: false}}]", *extra])
    return train(cfg, resume=resume)


def weights(run_dir: str | Path, step: int) -> dict[str, torch.Tensor]:
    from vlmrl.models import load_policy

    model = load_policy(Path(run_dir) / f"checkpoint-{step}").model
    return {n: p.detach() for n, p in model.named_parameters()}


def train_rows(run_dir: str | Path) -> list[dict]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "train"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# dynamic sampling (fill), and a curriculum whose draws follow every answer's pass rate (observed by the producer)
DAPO = ["algorithm.dynamic_sampling=true", "algorithm.resample_draw=fill", "curriculum.order=learnability"]


@pytest.mark.parametrize("extra", [[], DAPO], ids=["grpo", "dapo-curriculum"])
def test_staleness_zero_is_synchronous_training_bit_for_bit(tmp_path, extra):
    sync = run(tmp_path, "sync", *extra)
    zero = run(tmp_path, "zero", "rollout.asynchronous=true", "rollout.max_staleness=0", *extra)
    assert same(weights(sync["run_dir"], 4), weights(zero["run_dir"], 4))
    rows = train_rows(zero["run_dir"])
    assert [r["async/staleness"] for r in rows] == [0.0] * 4
    assert [r["reward/total/mean"] for r in rows] == [r["reward/total/mean"] for r in train_rows(sync["run_dir"])]


def test_staleness_one_trains_on_the_version_before(tmp_path, monkeypatch):
    """Every step after the first trains on answers sampled by the weights one update older; recorded by watching
    which weights the producer's copy holds when it samples each step."""
    seen: dict[int, dict[str, torch.Tensor]] = {}
    real = asynchronous.generate_step  # (stage I on the producer's thread; the scorer takes stage II)

    def spy(ctx, samples):
        seen[ctx.step] = {n: p.detach().clone() for n, p in ctx.policy.model.named_parameters()}
        return real(ctx, samples)

    monkeypatch.setattr(asynchronous, "generate_step", spy)
    out = run(tmp_path, "one", "rollout.asynchronous=true", "rollout.max_staleness=1", "trainer.save_every=1",
              "trainer.keep_checkpoints=0")
    rows = train_rows(out["run_dir"])
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert sorted(seen) == [1, 2, 3, 4, 5]  # (step 5: made for a longer run, saved with the last checkpoint)
    for step in range(1, 6):  # step s sampled by version max(0, s - 2): checkpoint-(s - 2)'s weights
        w = weights(out["run_dir"], max(0, step - 2))
        shared = list(seen[step])
        assert all(torch.equal(seen[step][n], w[n]) for n in shared), step
        if step > 2:  # and not the weights one update newer
            newer = weights(out["run_dir"], step - 1)
            assert not all(torch.equal(seen[step][n], newer[n]) for n in shared), step
    assert "mismatch/k3" in rows[1] and rows[1]["mismatch/k3"] > 0  # the stale answers' gap is measured
    assert rows[0]["mismatch/k3"] < 1e-6  # (step 1: sampled by the weights it trains)


@pytest.mark.parametrize("extra", [[], DAPO], ids=["grpo", "dapo-curriculum"])
def test_resume_is_exact_with_the_saved_answers(tmp_path, extra):
    """Dynamic sampling and the curriculum draw from the run's stream on the producer's thread, in step order: the run
    repeats, and resumed from a checkpoint (the saved answers, the signal share) ends where it would have."""
    args = ["rollout.asynchronous=true", "rollout.max_staleness=2", *extra]
    whole = run(tmp_path, "whole", *args)
    again = run(tmp_path, "again", *args)
    assert same(weights(whole["run_dir"], 4), weights(again["run_dir"], 4))
    first = run(tmp_path, "part", *args, "trainer.steps=2")
    assert (Path(first["run_dir"]) / "checkpoint-2" / asynchronous.PENDING_FILE).exists()
    resumed = run(tmp_path, "part", *args, resume=Path(first["run_dir"]))
    assert same(weights(whole["run_dir"], 4), weights(resumed["run_dir"], 4))
    if extra:
        rows = train_rows(whole["run_dir"])
        assert all("dynamic_sampling/rounds" in r for r in rows)
        pending = torch.load(Path(first["run_dir"]) / "checkpoint-2" / asynchronous.PENDING_FILE, weights_only=False)
        assert sorted(pending["produced"]) == [3, 4] and pending["signal_share"] is not None


def test_answers_older_than_the_bound_are_dropped_and_counted(tmp_path):
    first = run(tmp_path, "part", "rollout.asynchronous=true", "rollout.max_staleness=2", "trainer.steps=2")
    resumed = run(tmp_path, "part", "rollout.asynchronous=true", "rollout.max_staleness=0",
                  resume=Path(first["run_dir"]))
    rows = train_rows(resumed["run_dir"])
    late = [r for r in rows if r["step"] > 2]
    # steps 3 and 4 were produced by version 0 (staleness 2 and 3 > 0 at steps 3, 4): dropped, sampled again
    assert [r["async/dropped_steps"] for r in late] == [1.0, 2.0]
    assert [r["async/staleness"] for r in late] == [0.0, 0.0]


@pytest.mark.parametrize("stage", ["generate_step", "score_step", "produce"])
def test_a_failing_producer_stops_the_run_with_its_error(tmp_path, monkeypatch, stage):
    """Stage I or stage II raising (each on its own thread), or the whole step (staleness 0: no scorer thread)."""
    def broken(*args, **kwargs):
        raise ValueError("reward server said no")

    monkeypatch.setattr(asynchronous, stage, broken)
    with pytest.raises(TrainingError, match="rollout producer failed: ValueError: reward server said no"):
        run(tmp_path, "broken", "rollout.asynchronous=true",
            f"rollout.max_staleness={0 if stage == 'produce' else 1}")


@pytest.mark.parametrize("stage, said", [("generate_step", "generating step 1's answers"),
                                         ("score_step", "generating nothing (and scoring step 1's)")])
def test_a_stuck_producer_stops_the_run_instead_of_hanging(tmp_path, monkeypatch, stage, said):
    def stuck(*args, **kwargs):
        time.sleep(30)

    monkeypatch.setattr(asynchronous, stage, stuck)
    t0 = time.perf_counter()
    with pytest.raises(TrainingError, match=f"producer_timeout=2 s: the producer has been {re.escape(said)}"):
        run(tmp_path, "stuck", "rollout.asynchronous=true", "rollout.producer_timeout=2")
    assert time.perf_counter() - t0 < 25


def test_scoring_overlaps_the_next_steps_generation_and_changes_nothing(tmp_path, monkeypatch):
    """Staleness 1, no dynamic sampling or curriculum: stage II of step k (rewards, judge calls) runs while step k + 1
    generates (each scoring waits, up to 2 s, for the next step's generation to begin, and does not wait in vain),
    and the run ends bit for bit where the same run with each step scored before the next generates ends."""
    started: dict[int, threading.Event] = {}
    overlapped: dict[int, bool] = {}
    gen, score = asynchronous.generate_step, asynchronous.score_step

    def generating(ctx, samples):
        started.setdefault(ctx.step, threading.Event()).set()
        return gen(ctx, samples)

    def scoring(ctx, samples, generated):
        overlapped[ctx.step] = started.setdefault(ctx.step + 1, threading.Event()).wait(2)
        return score(ctx, samples, generated)

    with monkeypatch.context() as patch:
        patch.setattr(asynchronous, "generate_step", generating)
        patch.setattr(asynchronous, "score_step", scoring)
        piped = run(tmp_path, "piped", "rollout.asynchronous=true", "rollout.max_staleness=1")
    assert [overlapped[k] for k in (1, 2, 3, 4)] == [True] * 4  # (step 5, asked for ahead, has no step 6 after it)
    init = asynchronous.AsyncRollouts.__init__

    def unpiped(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pipelined = False

    monkeypatch.setattr(asynchronous.AsyncRollouts, "__init__", unpiped)
    serial = run(tmp_path, "serial", "rollout.asynchronous=true", "rollout.max_staleness=1")
    assert same(weights(piped["run_dir"], 4), weights(serial["run_dir"], 4))
    assert [r["reward/total/mean"] for r in train_rows(piped["run_dir"])] == \
        [r["reward/total/mean"] for r in train_rows(serial["run_dir"])]


def test_agents_train_on_asynchronous_rollouts(tmp_path):
    """Multi-turn rollouts with tools run in the producer like single-turn ones: the agentic recipe trains on
    answers one version old, the mismatch measured over its policy turns."""
    from vlmrl.config import load_config

    recipe = Path(__file__).resolve().parents[1] / "recipes/agentic_zoom.yaml"
    cfg = load_config(recipe, [*SMALL, f"trainer.output_dir={tmp_path / 'run'}", "trainer.steps=3", "sft.steps=4",
                               "agent.turn_tokens=24", "algorithm.dynamic_sampling=false",
                               "rollout.asynchronous=true", "rollout.max_staleness=1"])
    train(cfg)
    rows = train_rows(tmp_path / "run")
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("agent/turns_per_episode" in r and "mismatch/k3" in r for r in rows)
