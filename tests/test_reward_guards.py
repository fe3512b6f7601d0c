"""Guards against gaming a learned reward (issue 55 item 3): the KL budget by hand, a run the budget ends with its
checkpoint and held-out evaluation at that step, and a run the over-optimisation watch ends (the ensemble's
disagreement penalty: tests/test_reward_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_train_e2e import small_config
from vlmrl.config import load_config
from vlmrl.trainer import run as run_module
from vlmrl.trainer.reward_guards import KLBudget
from vlmrl.trainer.run import train


def test_kl_budget_by_hand():
    cfg = load_config(None, ["trainer.kl_budget=0.1"])
    guard = KLBudget(cfg)
    for step in range(1, 10):
        assert guard.update(step, {"kl": 0.05}) is None
    said = guard.update(10, {"kl": 0.96})  # mean (9 x 0.05 + 0.96) / 10 = 0.141
    assert said and "0.1410" in said and "trainer.kl_budget=0.1" in said
    assert KLBudget(load_config(None, [])).update(1, {"kl": 9.0}) is None  # no budget: never


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_kl_budget_ends_the_run_with_its_checkpoint_and_evaluation(tmp_path):
    # the entropy bonus moves the policy every step, whether or not the random model's groups have a signal
    summary = train(small_config(tmp_path, "trainer.steps=14", "trainer.kl_budget=1e-9",
                                 "algorithm.dynamic_sampling=false", "algorithm.entropy_coef=0.1"))
    run = tmp_path / "run"
    rows = _rows(run)
    train_steps = [r["step"] for r in rows if r["phase"] == "train"]
    assert train_steps == list(range(1, 11)), train_steps  # the 10th step fills the window: the run ends there
    assert all(r["kl"] > 0 for r in rows if r["phase"] == "train" and r["step"] > 1)  # a reference at beta 0
    assert summary["stopped_at"] == 10 and "kl_budget" in summary["guard_stop"]
    assert summary["checkpoint"].endswith("checkpoint-10") and (run / "checkpoint-10" / "COMPLETE").exists()
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 10] and summary["final"]["greedy/accuracy"] == evals[-1][
        "greedy/accuracy"]
    assert any("stopped by a guard" in n for n in summary["notes"])


def test_stop_on_overoptimisation_ends_the_run_at_the_evaluation_that_saw_it(tmp_path, monkeypatch):
    seen = []

    class Tripping:  # the watch itself is tested by hand in test_watch; here: what the run does when it fires
        def __init__(self, cfg):
            pass

        def update(self, step, metrics):
            seen.append(step)
            return "the learned reward rose while accuracy fell" if step == 4 else None

    monkeypatch.setattr(run_module, "OverOptimisationWatch", Tripping)
    summary = train(small_config(tmp_path, "trainer.steps=8", "trainer.eval_every=2",
                                 "trainer.stop_on_overoptimisation=true", "algorithm.dynamic_sampling=false"))
    assert seen == [0, 2, 4] and summary["stopped_at"] == 4  # the start is the watch's first evaluation
    assert summary["guard_stop"] == "the learned reward rose while accuracy fell"
    assert (tmp_path / "run" / "checkpoint-4" / "COMPLETE").exists()
    monkeypatch.undo()
    summary = train(small_config(tmp_path / "off", "trainer.steps=4", "trainer.eval_every=2",
                                 "algorithm.dynamic_sampling=false"))
    assert "guard_stop" not in summary  # off by default
