"""ReCLIP checkpoints: `trainer.save_every` writes RUN_DIR/checkpoint-STEP/state.pt during RL, and
`trainer.resume=RUN_DIR/checkpoint-STEP` continues from it exactly.

A checkpoint holds what the next step reads: the student's weights and the optimizer's state, both random streams
(batches and candidates), the memory bank (its items and embeddings, so a resume between two refreshes sees the same
bank), the KL reference's weights when `rl.kl_weight` > 0, and the warm-start's held-out metrics. Not the judgements'
memo: a resumed run judges again what it had remembered, so `judge/calls` and `judge/cache_hits` differ from an
unbroken run, while every reward, loss and weight is the same. Under trainer.distributed=fsdp2 the sharded blocks'
weights and Adam moments are gathered whole (every rank takes part) and saved as one file like any other run's;
a resume shards them again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlmrl.errors import ConfigError
from vlmrl.reclip.step import Bank, StepContext

NAME = "state.pt"


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save(ctx: StepContext, batches: torch.Generator, step: int, run_dir: Path, start: dict) -> Path:
    """Write run_dir/checkpoint-`step`/state.pt: every rank calls it (fsdp2 gathers the shards), rank 0 writes
    (every rank holds the same state)."""
    folder = Path(run_dir) / f"checkpoint-{step}"
    if ctx.par.sharded:  # the weights and optimizer state by parameter name, whole
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        weights = ctx.par.full_state_dict(ctx.student)
        moments = get_optimizer_state_dict(ctx.student, ctx.optimizer, options=_full_options())
    else:
        weights, moments = ctx.student.state_dict(), ctx.optimizer.state_dict()
    if ctx.par.rank != 0:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    bank = None if ctx.bank is None else {"items": ctx.bank.items, "images": ctx.bank.images, "texts": ctx.bank.texts}
    state = {"step": step, "student": weights, "optimizer": moments, "by_name": ctx.par.sharded,
             "candidates": ctx.generator.get_state(), "batches": batches.get_state(), "bank": bank,
             "reference": None if ctx.reference is None else ctx.reference.state_dict(), "start": start}
    tmp = folder / (NAME + ".tmp")
    torch.save(state, tmp)
    tmp.replace(folder / NAME)  # a checkpoint is whole or absent
    return folder


def load(path: str | Path) -> dict[str, Any]:
    """A checkpoint folder's state; a folder without one stops with what to pass instead."""
    file = Path(path) / NAME
    if not file.is_file():
        raise ConfigError(f"trainer.resume={path}: no {NAME} there; pass a RUN_DIR/checkpoint-STEP folder that a run "
                          f"with trainer.save_every > 0 wrote")
    return torch.load(file, map_location="cpu", weights_only=False)


def restore(ctx: StepContext, batches: torch.Generator, state: dict[str, Any]) -> int:
    """Put a checkpoint's state back (the optimizer must exist, built for the RL phase); returns its step."""
    if ctx.par.sharded and not state.get("by_name"):
        raise ConfigError("trainer.resume: this checkpoint was written by a run without fsdp2 (its optimizer state "
                          "is by position, not by parameter name); resume it with the trainer.distributed it was "
                          "written with")
    if state.get("by_name"):  # whole tensors (into shards under fsdp2), moments by parameter name
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(ctx.student, state["student"], options=_full_options())
        set_optimizer_state_dict(ctx.student, ctx.optimizer, state["optimizer"], options=_full_options())
    else:
        ctx.student.load_state_dict(state["student"])
        ctx.optimizer.load_state_dict(state["optimizer"])
    ctx.generator.set_state(state["candidates"])
    batches.set_state(state["batches"])
    bank = state["bank"]
    ctx.bank = None if bank is None else Bank(bank["items"], bank["images"], bank["texts"])
    if state["reference"] is not None and ctx.reference is not None:
        ctx.reference.load_state_dict(state["reference"])
    return int(state["step"])
