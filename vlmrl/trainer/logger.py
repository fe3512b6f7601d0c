"""Metrics go to a JSONL file always, to TensorBoard event files by default, and to Weights & Biases when a project
is configured; library code never prints."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path


class MetricsLogger:
    """One JSON object per record in `metrics.jsonl`; scalars mirrored to TensorBoard under the same names."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = start_wandb(wandb_project, self.run_dir, config) if wandb_project else None
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
        if self._wandb is not None:  # each phase on its own x-axis (sft steps, generation steps)
            self._wandb.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
            self._wandb.log({f"{phase}/{k}": v for k, v in record.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def log_rollouts(self, entries: list[dict]) -> None:
        """Append gallery entries to rollouts.jsonl; an entry's PIL `image` is saved as gallery/step<N>-<id>.png and
        replaced by that path, relative to the run directory."""
        with open(self.run_dir / "rollouts.jsonl", "a") as f:
            for entry in entries:
                if hasattr(entry.get("image"), "save"):
                    entry = {**entry, "image": save_gallery_image(entry["image"], self.run_dir, entry)}
                f.write(json.dumps(entry, default=str) + "\n")  # a custom reward's details may be any object

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def save_gallery_image(image, run_dir: Path, entry: dict) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(entry.get("id", "image")))
    rel = f"gallery/step{entry.get('step', 0)}-{name}.png"
    (run_dir / "gallery").mkdir(exist_ok=True)
    image.save(run_dir / rel)
    return rel


def start_wandb(project: str, run_dir: Path, config: dict | None):
    """A W&B run logging to `project` (offline mode and API keys are wandb's own environment variables)."""
    try:
        import wandb
    except ImportError:
        raise ImportError(f"trainer.wandb_project={project!r} needs the wandb package: pip install 'vlmrl[wandb]' "
                          "(or unset trainer.wandb_project; metrics.jsonl and TensorBoard are always written)") from None
    return wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config or {})


def _plain(v):
    if hasattr(v, "item"):
        return v.item()
    return v
