"""Checkpoints: a `save_pretrained` folder (model + processor) plus the training state needed to resume exactly.

A checkpoint is written whole or not at all. `save_checkpoint` writes `checkpoint-N.partial/`, flushes every file to
disk, writes the `COMPLETE` marker last (each file's size, so later damage shows too) and only then renames the
folder to `checkpoint-N`. A process killed at any moment leaves the previous checkpoints as they were plus, at worst,
a `.partial` folder that nothing resumes from (`checkpoint_problem` says why).

Test-only fault injection: with `VLMRL_TEST_KILL_IN_SAVE=N` in the environment, the process SIGKILLs itself while
writing `checkpoint-N`, after the weights and before the marker (tests/test_resume.py uses it). Nothing else reads it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch

from vlmrl.config import Config, save_config
from vlmrl.errors import PathError
from vlmrl.models.policy import Policy
from vlmrl.rundir import (
    MARKER,
    PARTIAL,  # noqa: F401  (re-exported with the rest of the layout that vlmrl.rundir holds)
    checkpoint_problem,
    checkpoint_step,
    partial_path,
    step_checkpoints,
)

STATE_FILE = "trainer_state.pt"
KILL_IN_SAVE = "VLMRL_TEST_KILL_IN_SAVE"


def rng_state(generator: torch.Generator | None = None) -> dict:
    """Every random stream a step may draw from: torch (CPU, and each CUDA device when CUDA is up), Python, NumPy,
    and the trainer's own generator (prompt order, minibatch shuffles)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "generator": generator.get_state() if generator is not None else None, "cuda": cuda}


def restore_rng(state: dict, generator: torch.Generator | None = None) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)
    if generator is not None and state.get("generator") is not None:
        generator.set_state(state["generator"])


def begin_checkpoint(path: str | Path) -> Path:
    """A fresh, empty `checkpoint-N.partial/` (what an earlier, interrupted save left there is removed)."""
    staging = partial_path(path)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def save_checkpoint(path: str | Path, policy: Policy, config: Config, state: dict, state_dict: dict | None = None,
                    staged: bool = False) -> Path:
    """Write `path/` with the model and processor (loadable by `from_pretrained` / `vlmrl eval`), the resolved config
    and `trainer_state.pt` (step, optimizer, scheduler, RNG and data-order state), atomically (module docstring).

    `staged`: `begin_checkpoint(path)` was called and other ranks wrote their parts (FSDP2 optimizer shards, RNG
    states) into the `.partial` folder; they are kept and listed in the marker like the rest."""
    path = Path(path)
    staging = partial_path(path) if staged else begin_checkpoint(path)
    if state_dict is None:
        policy.save_pretrained(staging)
    else:  # FSDP2: the consolidated weights gathered from every rank's shard
        policy.model.save_pretrained(staging, state_dict=state_dict)
        policy.processor.save_pretrained(staging)
    save_config(config, staging / "config.yaml")
    if os.environ.get(KILL_IN_SAVE) == str(checkpoint_step(path)):
        os.kill(os.getpid(), signal.SIGKILL)  # test-only: die mid-save, weights written, no state, no marker
    torch.save(state, staging / STATE_FILE)
    files = {str(f.relative_to(staging)): f.stat().st_size for f in sorted(staging.rglob("*")) if f.is_file()}
    for name in files:
        _fsync(staging / name)
    (staging / MARKER).write_text(json.dumps({"step": state.get("step"), "files": files}, indent=1) + "\n")
    _fsync(staging / MARKER)
    publish(staging, path)
    return path


def publish(staging: Path, path: Path) -> None:
    """Rename the complete `staging` folder to `path`. An older folder of that name (a rewound run's) is moved aside
    first and deleted after, so at every moment one complete copy exists."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(staging, path)
    _fsync(path.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rotate_checkpoints(run_dir: str | Path, keep: int, newest: int, final: int) -> list[Path]:
    """Delete step checkpoints older than `newest` beyond the `keep` newest (0 = keep all). checkpoint-0 (the RL
    start, which the reference model and the vLLM engine load) and checkpoint-`final` are never deleted, nor any
    checkpoint newer than `newest`. Returns the deleted folders."""
    if keep <= 0:
        return []
    candidates = [p for step, p in step_checkpoints(run_dir).items() if 0 < step <= newest and step != final]
    doomed = candidates[:-keep]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def save_rank_rng(staging: Path, rank: int, generator: torch.Generator | None) -> None:
    """Ranks other than 0 keep their own RNG states beside rank 0's trainer_state.pt."""
    torch.save(rng_state(generator), staging / f"rng-rank{rank}.pt")


def load_rank_rng(path: str | Path, rank: int, state: dict) -> dict:
    """This rank's RNG states from checkpoint `path`: its own file, or rank 0's (single-process checkpoints)."""
    file = Path(path) / f"rng-rank{rank}.pt"
    return torch.load(file, weights_only=False) if rank and file.exists() else state["rng"]


def load_state(path: str | Path) -> dict:
    problem = checkpoint_problem(path)
    if problem is None and not (Path(path) / STATE_FILE).exists():
        problem = f"no {STATE_FILE}: not a vlmrl training checkpoint"
    if problem:
        raise PathError(f"{path}: cannot resume from it: {problem}")
    return torch.load(Path(path) / STATE_FILE, weights_only=False)
