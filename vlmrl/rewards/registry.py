"""Reward registry, weighted composition, and safe calling: the "score" stage of the loop.

A reward function is a plain callable (TRL's contract):

    def my_reward(completions: list[str], solution: list[str], **columns) -> list[float | None]

Every dataset column arrives as a keyword argument holding a list aligned with `completions`, plus
`completion_truncated` (and `completion_lengths` when the trainer has them). `None` means "not applicable to this
sample". Adding a reward is a function and a decorator:

    @register_reward("my_reward")
    def my_reward(completions, solution, **_): ...

`compute_rewards` calls each reward once per batch and never lets one crash the loop: an exception or a return of
the wrong length makes that component None for every sample, a NaN/inf/non-number makes that sample's value None,
and each lost value is counted in `RewardOutput.failures`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

RewardFn = Callable[..., Sequence[Any]]

REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` under `name` in REWARDS. Re-registering the same function (a module reload) is
    allowed; a different function under a taken name is a ValueError."""

    def decorator(fn: RewardFn) -> RewardFn:
        existing = REWARDS.get(name)
        if existing is not None and _qualname(existing) != _qualname(fn):
            raise ValueError(f"reward {name!r} is already registered by {_qualname(existing)}")
        REWARDS[name] = fn
        return fn

    return decorator


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _load_file(path: Path) -> Any:
    """Import a Python file as a module, once per absolute path (cached in sys.modules)."""
    path = path.resolve()
    name = f"vlmrl_user_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def resolve_reward(name: str) -> RewardFn:
    """The reward function for `name`: a registered name, "path/to/file.py:function" (a file path, relative to the
    working directory), or "package.module:function". Unknown names raise ValueError listing REWARDS."""
    if name in REWARDS:
        return REWARDS[name]
    target, sep, attr = name.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(
            f"unknown reward {name!r}; registered rewards: {', '.join(sorted(REWARDS))}; "
            "or give 'path/to/file.py:function' or 'package.module:function'"
        )
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"reward {name!r}: file {target!r} not found (relative to {Path.cwd()})")
        module = _load_file(path)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"reward {name!r}: cannot import module {target!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {target!r} has no callable {attr!r}")
    return fn


@dataclass
class RewardSpec:
    """One component of the reward: `weight * REWARDS[name](completions, **columns, **kwargs)`.

    `label` names the component in `components` and metrics (default: `name`); set it to use one reward twice,
    e.g. strict accuracy with weight 1 and non-strict accuracy with weight 0 as a diagnostic."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    label: str | None = None

    @property
    def key(self) -> str:
        return self.label or self.name


@dataclass
class RewardOutput:
    """Scores of one batch.

    total: float32 [N], sum over components of weight * value, skipping None; a sample where every component is
        None or failed gets 0.0 and is counted in `no_reward`.
    components: per component key, the N values (None = not applicable or failed).
    failures: per component key, how many of the N values were lost to a failure (an exception or a wrong-length
        return loses all N; a NaN/inf/non-number loses one).
    errors: per component key, the first failure's message (absent when it did not fail).
    """

    total: torch.Tensor
    components: dict[str, list[float | None]]
    failures: dict[str, int]
    no_reward: int
    errors: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Flat metrics: reward/{key}/mean, /std (population std over non-None values; 0.0 when there are none),
        /count (non-None values), /failures; reward/total/mean and /std over all samples; reward/failure_rate
        (failed values / (N * components)); reward/no_reward."""
        out: dict[str, float] = {}
        for key, values in self.components.items():
            present = [v for v in values if v is not None]
            mean, std = _mean_std(present)
            out[f"reward/{key}/mean"] = mean
            out[f"reward/{key}/std"] = std
            out[f"reward/{key}/count"] = float(len(present))
            out[f"reward/{key}/failures"] = float(self.failures.get(key, 0))
        mean, std = _mean_std(self.total.tolist())
        out["reward/total/mean"] = mean
        out["reward/total/std"] = std
        calls = self.total.numel() * len(self.components)
        out["reward/failure_rate"] = sum(self.failures.values()) / calls if calls else 0.0
        out["reward/no_reward"] = float(self.no_reward)
        return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _as_score(value: Any) -> float | None:
    """A finite float, or None for NaN/inf and anything that is not a number (strings included)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return None
    try:
        score = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return score if math.isfinite(score) else None


def call_reward(
    fn: RewardFn, completions: list[str], kwargs: dict[str, Any]
) -> tuple[list[float | None], int, str | None]:
    """Call one reward safely: (values, failed count, first error message or None). Never raises on the reward's
    behalf (KeyboardInterrupt and other BaseExceptions still propagate)."""
    n = len(completions)
    try:
        raw = list(fn(completions, **kwargs))
    except Exception as exc:  # a broken reward must not crash the loop: counted, reported in `errors`
        return [None] * n, n, f"{type(exc).__name__}: {exc}"
    if len(raw) != n:
        return [None] * n, n, f"returned {len(raw)} values for {n} completions"
    values: list[float | None] = []
    failed, error = 0, None
    for i, value in enumerate(raw):
        score = None if value is None else _as_score(value)
        if value is not None and score is None:
            failed += 1
            error = error or f"sample {i}: invalid value {value!r} (expected a finite number or None)"
        values.append(score)
    return values, failed, error


def compute_rewards(specs: Sequence[RewardSpec], completions: list[str], columns: dict[str, list]) -> RewardOutput:
    """Score a batch: each spec's function is called once with `completions`, `**columns` and `**spec.kwargs`.

    total[i] = sum_k weight_k * value_k[i] over components k whose value is not None; 0.0 (and counted in
    `no_reward`) when there is none. Configuration errors raise before any reward runs: an unknown name
    (ValueError listing REWARDS), two specs with the same key, or a spec kwarg that shadows a dataset column."""
    resolved = [(spec, resolve_reward(spec.name)) for spec in specs]
    keys = [spec.key for spec in specs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"reward components {duplicates} appear twice; give each a distinct RewardSpec.label")
    for spec in specs:
        clash = sorted(set(spec.kwargs) & set(columns))
        if clash:
            raise ValueError(f"reward {spec.key!r}: kwargs {clash} shadow dataset columns of the same name")

    n = len(completions)
    totals = [0.0] * n
    has_reward = [False] * n
    components: dict[str, list[float | None]] = {}
    failures: dict[str, int] = {}
    errors: dict[str, str] = {}
    for spec, fn in resolved:
        values, failed, error = call_reward(fn, completions, {**columns, **spec.kwargs})
        components[spec.key], failures[spec.key] = values, failed
        if error is not None:
            errors[spec.key] = error
        for i, value in enumerate(values):
            if value is not None:
                totals[i] += spec.weight * value
                has_reward[i] = True
    return RewardOutput(
        total=torch.tensor(totals, dtype=torch.float32),
        components=components,
        failures=failures,
        no_reward=has_reward.count(False),
        errors=errors,
    )
