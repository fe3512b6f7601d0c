"""Resuming a run: which checkpoint (`--resume RUN_DIR` takes the newest complete one), which recipe (the run's own
config.yaml plus command-line overrides), whether the overrides keep the run exact, and rewinding the run directory
to the checkpoint's step so that nothing is logged or kept twice.

Overrides that only schedule, log or place the work (`EXACT_KEYS`) keep the resumed run an exact continuation. Any
other change (learning rate, data, rollout, model, algorithm...) is allowed, since continuing with other settings
is sometimes the point, and named in a warning. What cannot resume correctly is refused (ConfigError): moving
between a sharded (FSDP2 under torchrun) and a full optimizer state, a prompt set of another size, and a
`trainer.steps` below the checkpoint's step.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vlmrl.config import Config, to_dict
from vlmrl.errors import ConfigError, PathError
from vlmrl.trainer.checkpoint import PARTIAL, checkpoint_problem, checkpoint_step, step_checkpoints

# what may change on resume without changing a single number of the training (its schedule of evaluations and
# checkpoints, its logging, its threads; trainer.distributed is checked on its own)
EXACT_KEYS = {
    "trainer.steps", "trainer.eval_every", "trainer.save_every", "trainer.save_every_minutes",
    "trainer.keep_checkpoints", "trainer.log_rollouts_every", "trainer.tensorboard", "trainer.wandb_project",
    "trainer.threads", "trainer.output_dir", "trainer.distributed", "trainer.max_nonfinite_steps",
    "eval.batch_size", "eval.pass_k", "eval.temperatures", "eval.ood",
}
EXACT_SECTIONS = ("control.",)  # `--control` cannot be combined with --resume: never read by a resumed run
EVAL_SECTIONS = ("eval.",)  # the held-out evaluation: changes eval rows, not the training


@dataclass
class ResumePoint:
    run_dir: Path
    checkpoint: Path
    step: int
    notes: list[str] = field(default_factory=list)  # warnings for the user (incomplete checkpoints skipped)


def find_resume_point(path: str | Path) -> ResumePoint:
    """`RUN_DIR` -> its newest complete checkpoint (newer incomplete ones are skipped with a note); a checkpoint
    folder -> that checkpoint, which must be complete. PathError when there is nothing to resume from."""
    path = Path(path)
    if not path.is_dir():
        raise PathError(f"--resume {path}: no such folder (give a run directory or RUN_DIR/checkpoint-N)")
    if checkpoint_step(path) is not None or path.name.endswith(PARTIAL) or (path / "trainer_state.pt").exists():
        problem = checkpoint_problem(path)
        if problem:
            latest = newest_complete(path.parent)
            hint = f"; the newest complete one is {latest}" if latest else ""
            raise PathError(f"--resume {path}: cannot resume from it: {problem}{hint} (--resume {path.parent} "
                            "takes the newest complete checkpoint)")
        return ResumePoint(path.parent, path, _step_of(path))
    notes = []
    for step, ckpt in reversed(step_checkpoints(path).items()):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            for partial in sorted(path.glob(f"checkpoint-*{PARTIAL}")):
                problem = checkpoint_problem(partial) or "its save stopped before the final rename"
                notes.append(f"resume: skipped {partial.name}: {problem}; resuming from {ckpt.name}")
            return ResumePoint(path, ckpt, step, notes)
        notes.append(f"resume: skipped {ckpt.name}: {problem}")
    if not (path / "config.yaml").exists():
        raise PathError(f"--resume {path}: not a vlmrl run directory (no config.yaml, no checkpoint-N)")
    raise PathError(f"--resume {path}: no complete checkpoint to resume from (the run stopped before checkpoint-0, "
                    f"the RL start, was written); start the run again")


def newest_complete(run_dir: Path) -> Path | None:
    for _, ckpt in reversed(step_checkpoints(run_dir).items()):
        if checkpoint_problem(ckpt) is None:
            return ckpt
    return None


def _step_of(ckpt: Path) -> int:
    step = checkpoint_step(ckpt)
    if step is None:
        import torch

        step = torch.load(ckpt / "trainer_state.pt", weights_only=False)["step"]
    return step


def run_recipe(path: str | Path) -> Path:
    """The recipe a resumed run continues with: RUN_DIR/config.yaml (for a checkpoint path: its run's), else the
    checkpoint's own copy."""
    path = Path(path)
    if not path.is_dir():
        raise PathError(f"--resume {path}: no such folder (give a run directory or RUN_DIR/checkpoint-N)")
    run_dir = path.parent if checkpoint_step(path) is not None or path.name.endswith(PARTIAL) else path
    for candidate in (run_dir / "config.yaml", path / "config.yaml"):
        if candidate.exists():
            return candidate
    raise PathError(f"--resume {path}: no config.yaml in {run_dir}: not a vlmrl run directory")


def _flat(data, prefix: str = "") -> dict:
    if isinstance(data, dict) and data and all(isinstance(k, str) for k in data) and prefix.count(".") < 2:
        out = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): data}


def check_resume(cfg: Config, point: ResumePoint, state: dict, sharded_now: bool) -> list[str]:
    """Compare the resumed run's config with the one the checkpoint was trained with: warnings for changes that make
    the run inexact, ConfigError for those it cannot resume under (module docstring)."""
    t, step, name = cfg.trainer, point.step, point.checkpoint.name
    if t.steps < step:
        raise ConfigError(f"trainer.steps={t.steps} is before {name}'s step {step}: give trainer.steps >= {step}")
    sharded_then = state.get("sharded_optimizer", state.get("optimizer") is None)
    if sharded_then != sharded_now and not state.get("optimizer_empty", step == 0):
        then, now = ("a sharded (FSDP2)", "a full") if sharded_then else ("a full", "a sharded (FSDP2)")
        raise ConfigError(f"{name} holds {then} optimizer state and this run needs {now} one: resume with the "
                          f"checkpoint's trainer.distributed={state.get('distributed', '?')} (under torchrun as "
                          f"before), or start a new run from its weights (model.name_or_path={point.checkpoint})")
    saved = point.checkpoint / "config.yaml"
    if not saved.exists():
        return []
    old, new = _flat(yaml.safe_load(saved.read_text()) or {}), _flat(to_dict(cfg))
    notes = []
    for key in sorted(k for k in new if k in old and old[k] != new[k]):
        change = f"{key} changed ({old[key]!r} -> {new[key]!r}) since {name}"
        if key == "trainer.steps" and t.lr_schedule != "constant":
            notes.append(f"resume: {change} under trainer.lr_schedule={t.lr_schedule}: the learning-rate schedule "
                         "is stretched, so the resumed run is not an exact continuation")
        elif key in EXACT_KEYS or key.startswith(EXACT_SECTIONS):
            continue
        elif key.startswith(EVAL_SECTIONS):
            notes.append(f"resume: {change}: evaluations after step {step} are measured differently from those "
                         "before it")
        else:
            notes.append(f"resume: {change}: the resumed run is not an exact continuation (this setting changes "
                         "the training)")
    return notes


def rewind_checkpoints(point: ResumePoint) -> list[str]:
    """Remove what lies past the resume point: interrupted saves (`.partial` folders) and complete checkpoints newer
    than it (resuming from an older checkpoint rewinds the run; copy the run directory first to branch it)."""
    notes = []
    for leftover in [*point.run_dir.glob(f"checkpoint-*{PARTIAL}"), *point.run_dir.glob("checkpoint-*.old")]:
        shutil.rmtree(leftover)  # an interrupted save's folder; never resumed from
    for step, ckpt in step_checkpoints(point.run_dir).items():
        if step > point.step:
            shutil.rmtree(ckpt)
            notes.append(f"resume: removed {ckpt.name}, newer than {point.checkpoint.name}: the run continues from "
                         f"step {point.step}")
    return notes
