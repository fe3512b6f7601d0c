"""Metrics as TensorBoard reads them: every finite number of every record, one event per record."""

import math

import pytest

from vlmrl.trainer.logger import MetricsLogger, rewind_logs


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_every_finite_scalar_of_every_record(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log({"loss": 0.5, "count": 3, "flag": True, "name": "x", "bad": math.nan, "none": None}, 0, "sft")
    for step in (1, 2):
        logger.log({"loss": 1.0 / step, "reward/accuracy/mean": 0.25 * step, "inf": math.inf}, step, "train")
    logger.log({"greedy/accuracy": 0.7}, 2, "eval")
    logger.close()
    got = scalars(tmp_path)
    assert set(got) == {"sft/loss", "sft/count", "train/loss", "train/reward/accuracy/mean", "eval/greedy/accuracy"}
    assert got["sft/count"] == [(0, 3.0)]
    assert got["train/loss"] == [(1, 1.0), (2, 0.5)]
    assert got["train/reward/accuracy/mean"] == [(1, 0.25), (2, 0.5)]
    assert got["eval/greedy/accuracy"] == [(2, pytest.approx(0.7))]


def test_rewinding_keeps_the_values_up_to_the_step(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        logger.log({"loss": float(step), "accuracy": step / 10}, step, "train")
    logger.close()
    rewind_logs(tmp_path, 2)
    got = scalars(tmp_path)
    assert got["train/loss"] == [(1, 1.0), (2, 2.0)]
    assert [s for s, _ in got["train/accuracy"]] == [1, 2]
