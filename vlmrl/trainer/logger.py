"""Metrics go to a JSONL file always and to TensorBoard event files by default; library code never prints."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    """One JSON object per record in `metrics.jsonl`; scalars mirrored to TensorBoard under the same names."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, metrics: dict, step: int, phase: str) -> None:
        record = {"phase": phase, "step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    if value is not None and math.isfinite(value):
                        self._tb.add_scalar(f"{phase}/{key}", value, step)

    def log_rollouts(self, entries: list[dict]) -> None:
        with open(self.run_dir / "rollouts.jsonl", "a") as f:
            for entry in entries:
                f.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v
