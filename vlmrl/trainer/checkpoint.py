"""Checkpoints: a `save_pretrained` folder (model + processor) plus the training state needed to resume exactly."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from vlmrl.config import Config, save_config
from vlmrl.models.policy import Policy

STATE_FILE = "trainer_state.pt"


def rng_state(generator: torch.Generator | None = None) -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "generator": generator.get_state() if generator is not None else None}


def restore_rng(state: dict, generator: torch.Generator | None = None) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if generator is not None and state.get("generator") is not None:
        generator.set_state(state["generator"])


def save_checkpoint(path: str | Path, policy: Policy, config: Config, state: dict,
                    state_dict: dict | None = None) -> Path:
    """Write `path/` with the model and processor (loadable by `from_pretrained` / `vlmrl eval`), the resolved config
    and `trainer_state.pt` (step, optimizer, scheduler, RNG and data-order state)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if state_dict is None:
        policy.save_pretrained(path)
    else:  # FSDP2: the consolidated weights gathered from every rank's shard
        policy.model.save_pretrained(path, state_dict=state_dict)
        policy.processor.save_pretrained(path)
    save_config(config, path / "config.yaml")
    torch.save(state, path / STATE_FILE)
    return path


def load_state(path: str | Path) -> dict:
    file = Path(path) / STATE_FILE
    if not file.exists():
        raise FileNotFoundError(f"{path} has no {STATE_FILE}: not a vlmrl training checkpoint (cannot resume)")
    return torch.load(file, weights_only=False)
