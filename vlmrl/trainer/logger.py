"""Metrics go to a JSONL file always, to TensorBoard event files by default, and to Weights & Biases when a project
is configured; library code never prints.

Every record has a phase and a step. `sft` and `data` rows have their own step axes (SFT steps; 0); `train`,
`eval` and `summary` rows share the RL step axis, the one a resumed run rewinds (`rewind_logs`).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

RL_AXIS = ("train", "eval", "summary")


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
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._tb = EventFileWriter(str(self.run_dir / "tensorboard"))

    def log(self, metrics: dict, step: int, phase: str) -> None:
        record = {"phase": phase, "step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            event = scalar_event(record, step, phase)
            if event.summary.value:  # (a record of text only writes no event)
                self._tb.add_event(event)
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
                if entry.get("turns"):  # multi-turn: every tool image as gallery/step<N>-<id>-a<answer>-t<turn>-<k>.png
                    entry = {**entry, "turns": [
                        [{**t, "images": [save_gallery_image(im, self.run_dir, entry, f"-a{a}-t{i}-{k}")
                                          for k, im in enumerate(t.get("images") or [])]}
                         for i, t in enumerate(episode)] for a, episode in enumerate(entry["turns"])]}
                f.write(json.dumps(entry, default=str) + "\n")  # a custom reward's details may be any object

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def scalar_event(record: dict, step: int, phase: str):
    """One TensorBoard event holding every finite number of `record` as the scalar `phase/key` (what
    `SummaryWriter.add_scalar` writes, but one event per record instead of one per key: an RL step's ~80 scalars
    took 7.9 ms one at a time, BENCHMARKS.md)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    values = [Summary.Value(tag=f"{phase}/{key}", simple_value=float(value)) for key, value in record.items()
              if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"
              and math.isfinite(value)]
    return Event(wall_time=time.time(), step=step, summary=Summary(value=values))


def kept_after_rewind(phase: str, step: int, to: int, rerun_eval: bool) -> bool:
    """Whether a record survives rewinding the run to RL step `to`: everything off the RL axis (sft, data) does;
    on it, what came before `to`, and at `to` the train row and the evaluation (unless the resumed run evaluates
    step `to` again). Summary rows describe a finished run, and go."""
    if phase not in RL_AXIS:
        return True
    if phase == "summary":
        return False
    return step < to or (step == to and (phase == "train" or not rerun_eval))


def rewind_logs(run_dir: str | Path, to: int, rerun_eval: bool = False) -> list[str]:
    """Drop what a run resumed at RL step `to` will log again, from metrics.jsonl, rollouts.jsonl, gallery/ and the
    TensorBoard events (rewritten without those events), so that no curve holds a step twice. Returns notes on what
    was dropped. Rows cut short by a kill (a last line that is not JSON) are dropped too."""
    run_dir, notes = Path(run_dir), []
    keep = lambda phase, step: kept_after_rewind(phase, step, to, rerun_eval)  # noqa: E731
    rows = _rewrite_jsonl(run_dir / "metrics.jsonl", lambda r: keep(r.get("phase"), r.get("step", 0)))
    entries = _rewrite_jsonl(run_dir / "rollouts.jsonl", lambda r: r.get("step", 0) <= to)
    for image in (run_dir / "gallery").glob("step*-*.png"):
        step = re.match(r"step(\d+)-", image.name)
        if step and int(step.group(1)) > to:
            image.unlink()
    values = _rewind_tensorboard(run_dir / "tensorboard", keep)
    if rows or entries or values:
        notes.append(f"resume: dropped what was logged after checkpoint-{to} ({rows} metrics.jsonl rows, {entries} "
                     f"rollouts.jsonl entries, {values} TensorBoard values); the resumed run logs those steps again")
    return notes


def _rewrite_jsonl(path: Path, keep) -> int:
    if not path.exists():
        return 0
    lines, out = path.read_text().splitlines(), []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a row a kill cut short
            continue
        if keep(record):
            out.append(line)
    if len(out) != len(lines):
        _replace_text(path, "".join(line + "\n" for line in out))
    return len(lines) - len(out)


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _rewind_tensorboard(folder: Path, keep) -> int:
    """Read every event file, keep the last value of each (tag, step) that `keep(phase, step)` allows, write them to
    one file in place of the old ones. Idempotent: a kill half-way leaves at worst a value twice in the old files,
    which the next rewind removes."""
    files = sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []
    if not files:
        return 0
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    header, values, total = None, {}, 0
    for file in files:
        for raw in RawEventFileLoader(str(file)).Load():
            event = Event.FromString(raw)
            if event.HasField("file_version"):
                header = header or event
            for value in event.summary.value:
                total += 1
                if keep(value.tag.split("/", 1)[0], event.step):
                    values[(value.tag, event.step)] = (event.wall_time, value)
    tmp = folder / "rewind.tmp"  # no "tfevents" in the name: TensorBoard does not read it
    with open(tmp, "wb") as f:
        writer = RecordWriter(f)
        if header is not None:
            writer.write(header.SerializeToString())
        for (_, step), (wall_time, value) in sorted(values.items(), key=lambda kv: (kv[1][0], kv[0][1])):
            event = Event(wall_time=wall_time, step=step)
            event.summary.value.add().CopyFrom(value)
            writer.write(event.SerializeToString())
        writer.flush()
    os.replace(tmp, files[0])
    for file in files[1:]:
        file.unlink()
    return total - len(values)


def save_gallery_image(image, run_dir: Path, entry: dict, suffix: str = "") -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(entry.get("id", "image")))
    rel = f"gallery/step{entry.get('step', 0)}-{name}{suffix}.png"
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
