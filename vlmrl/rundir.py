"""A run directory's layout on disk: its `checkpoint-N` folders and whether each finished saving.

A checkpoint's save writes `checkpoint-N.partial/`, then the `COMPLETE` marker (each file's size) last, then renames
the folder to `checkpoint-N` (`vlmrl.trainer.checkpoint` writes them). Reading that layout needs no model and no
trainer, so it lives here, below everything that resolves a model reference (`vlmrl.models.preflight`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

MARKER = "COMPLETE"
PARTIAL = ".partial"
_NAME = re.compile(r"checkpoint-(\d+)")


def checkpoint_step(path: str | Path) -> int | None:
    """N for a folder named `checkpoint-N` (None for anything else, `.partial` folders included)."""
    match = _NAME.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def partial_path(path: str | Path) -> Path:
    """Where `path` is written before it is complete: `checkpoint-N.partial`, beside it."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL)


def checkpoint_problem(path: str | Path) -> str | None:
    """None for a complete checkpoint; else what is wrong with it, in words."""
    path = Path(path)
    if not path.is_dir():
        return "not a folder"
    if not (path / MARKER).exists():
        reason = "its save was interrupted" if path.name.endswith(PARTIAL) else "a save that did not finish"
        return f"no {MARKER} marker ({reason})"
    try:
        files = json.loads((path / MARKER).read_text())["files"]
    except (ValueError, KeyError):
        return f"an unreadable {MARKER} marker"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} when it was saved"
    return None


def step_checkpoints(run_dir: str | Path) -> dict[int, Path]:
    """The run's `checkpoint-N` folders by step, complete or not (`.partial` folders are not among them)."""
    out = {}
    for p in Path(run_dir).glob("checkpoint-*"):
        step = checkpoint_step(p)
        if step is not None and p.is_dir():
            out[step] = p
    return dict(sorted(out.items()))


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's step checkpoints whose save finished (their COMPLETE marker is written last), oldest first."""
    return [p for p in step_checkpoints(run_dir).values() if checkpoint_problem(p) is None]
