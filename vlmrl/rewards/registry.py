"""Reward registry, weighted composition, and safe calling: the "score" stage of the loop.

A reward function is a plain callable (TRL's contract):

    def my_reward(completions: list[str], solution: list[str], **columns) -> list[float | None]

Every dataset column arrives as a keyword argument holding a list aligned with `completions`, plus
`completion_truncated` (and `completion_lengths` when the trainer has them). Adding a reward is a function and a
decorator:

    @register_reward("my_reward")
    def my_reward(completions, solution, **_): ...

A value is one of three things, and the trainer treats them differently:

- a finite number: the score;
- `None`: "does not apply to this sample" (e.g. `accuracy` on a box answer): that component is left out of the
  sample's total, by design;
- a failure: the reward could not score the sample. It returns `RewardFailure("why")` for that sample, or raises,
  times out or returns the wrong length (every sample of the batch fails), or returns a NaN/inf/non-number. A
  failure is not a low score: the sample gets `RewardOutput.failed`, and training gives it advantage 0 and no loss
  (see `vlmrl.rewards.output`).

`compute_rewards` calls each reward once per batch and never lets one crash the loop; each lost value is counted in
`RewardOutput.failures`. Only `FatalRewardError` (e.g. a judge whose API key is refused) stops training, with its
message.

Where a reward runs: user rewards (anything not marked `register_reward(..., inline=True)`) run in a worker process
(`vlmrl.rewards.safe`) under `RewardSpec.timeout`, so a hang costs one batch of that component, never the run. The
built-ins are written to run in bounded time (linear parsers; the symbolic math check goes to its own worker pool
with a per-expression limit; the judge bounds its own HTTP calls) and run in the trainer's process, which saves
the pickling of the batch. `RewardSpec.isolate` overrides either choice.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlmrl.errors import ConfigError, FatalRewardError
from vlmrl.references import USER_MODULE_PREFIX, resolve_reference
from vlmrl.rewards.output import RewardOutput
from vlmrl.rewards.safe import Job, WorkerPool, call_maybe_async, get_pool

# FatalRewardError (vlmrl.errors) and resolve_reference (vlmrl.references) are re-exported here: the reward worker
# (vlmrl.rewards.safe), below this module, raises and resolves them too.

RewardFn = Callable[..., Sequence[Any]]

REWARDS: dict[str, RewardFn] = {}
DEFAULT_TIMEOUT = 60.0  # seconds per isolated reward call (one batch), when RewardSpec.timeout is not set
OWN_METRICS = ("mean", "std", "count", "failures")  # reward/{key}/{name} that RewardOutput.metrics writes


class RewardFailure(float):
    """A per-sample failure a reward can return in place of a value: it counts as None plus one failure, with
    `reason` reported in `RewardOutput.errors`. It is a float NaN, so code that does not know it sees a NaN."""

    reason: str

    def __new__(cls, reason: str) -> RewardFailure:
        obj = super().__new__(cls, float("nan"))
        obj.reason = reason
        return obj

    def __reduce__(self) -> tuple:
        return (RewardFailure, (self.reason,))

    def __repr__(self) -> str:
        return f"RewardFailure({self.reason!r})"


class RewardBatch(list):
    """A reward's return value with extras: the per-sample values (the list itself), `metrics` (logged as
    reward/{component}/{name}, e.g. the judge's retries and cache hits; a name of OWN_METRICS is logged as
    reported_{name}) and `details` (one entry per sample, e.g. the judge's raw feedback, shown by
    `vlmrl inspect-reward`)."""

    def __init__(self, values: Sequence[Any], metrics: dict[str, float] | None = None,
                 details: list[Any] | None = None):
        super().__init__(values)
        self.metrics = dict(metrics or {})
        self.details = details


def register_reward(name: str, *, inline: bool = False, requires: dict[str, str] | None = None,
                    grades: Sequence[str] | None = None) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` under `name` in REWARDS. Re-registering the same function (a module reload) is
    allowed; a different function under a taken name is a ValueError.

    inline=True vouches that `fn` returns in bounded time (no unbounded loops, no blocking call without its own
    time limit), so it may run in the trainer's process without a worker (see the module docstring).
    requires={module: what to install} names the optional packages `fn` imports when called (e.g.
    {"sacrebleu": "pip install 'vlmrl[text]'"}): `check_specs` raises a ConfigError up front when one is missing.
    grades=(answer types) says which answers `fn` grades, i.e. pays a right one more than a wrong one ("number",
    "text", "math", "choice", "box"); () marks a shaping reward that grades none (format, length); None (a user
    reward) is unknown. `vlmrl.rewards.coverage` reads it to refuse a run whose data has answers no reward grades."""

    def decorator(fn: RewardFn) -> RewardFn:
        existing = REWARDS.get(name)
        if existing is not None and _qualname(existing) != _qualname(fn):
            raise ValueError(f"reward {name!r} is already registered by {_qualname(existing)}")
        REWARDS[name] = fn
        if inline:
            fn.__vlmrl_inline__ = True  # type: ignore[attr-defined]
        if requires:
            fn.__vlmrl_requires__ = dict(requires)  # type: ignore[attr-defined]
        if grades is not None:
            fn.__vlmrl_grades__ = tuple(grades)  # type: ignore[attr-defined]
        return fn

    return decorator


def answer_type_of(sample: dict) -> str | None:
    """A sample's answer type as rewards see it (its `answer_type`; multiple choice when it has options)."""
    kind = sample.get("answer_type")
    return "choice" if (sample.get("options") or sample.get("choices")) and kind in (None, "text", "choice") else kind


def graded_types(fn: RewardFn) -> tuple[str, ...] | None:
    """The answer types `fn` grades (`register_reward(grades=...)`): () for a shaping reward, None when unknown."""
    return getattr(fn, "__vlmrl_grades__", None)


def missing_requirement(fn: RewardFn, what: str) -> ConfigError | None:
    """A ConfigError naming the first package of `fn`'s `requires` that is not installed (`what` names the reward
    in the message), or None when all are there."""
    for module, install in getattr(fn, "__vlmrl_requires__", {}).items():
        if importlib.util.find_spec(module) is None:
            return ConfigError(f"{what} needs the {module} package, which is not installed: {install}")
    return None


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def resolve_reward(name: str) -> RewardFn:
    """The reward function for `name`: a registered name, "path/to/file.py:function" (a file path, relative to the
    working directory), or "package.module:function". Unknown names raise ValueError listing REWARDS."""
    return resolve_reference(name, "reward", REWARDS)


@dataclass
class RewardSpec:
    """One component of the reward: `weight * REWARDS[name](completions, **columns, **kwargs)`.

    `label` names the component in `components` and metrics (default: `name`); set it to use one reward twice,
    e.g. strict accuracy with weight 1 and non-strict accuracy with weight 0 as a diagnostic."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    label: str | None = None
    timeout: float | None = None  # seconds per call in a worker (default DEFAULT_TIMEOUT)
    isolate: bool | None = None  # True: worker process; False: trainer's process; None: built-ins inline, others not

    @property
    def key(self) -> str:
        return self.label or self.name

    @classmethod
    def from_config(cls, cfg: Any) -> RewardSpec:
        """A spec from a recipe's reward entry (`vlmrl.config.RewardConfig` or any object with its fields)."""
        return cls(cfg.name, cfg.weight, dict(cfg.kwargs), cfg.label, getattr(cfg, "timeout", None),
                   getattr(cfg, "isolate", None))


def _as_score(value: Any) -> float | None:
    """A finite float, or None for NaN/inf and anything that is not a number (strings included)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        return None
    try:
        score = float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return score if math.isfinite(score) else None


@dataclass
class _Scored:
    values: list[float | None]
    failed: int
    error: str | None
    metrics: dict[str, float] = field(default_factory=dict)
    details: list[Any] | None = None
    failed_rows: list[bool] | None = None  # per sample: this value was lost to a failure (None: all, if failed == n)

    def row_failed(self, i: int) -> bool:
        return self.failed_rows[i] if self.failed_rows is not None else self.failed > 0


def _score_values(raw: Any, n: int) -> _Scored:
    """Check a reward's return value: n finite numbers or None; RewardFailure and invalid values are failures."""
    try:
        values_in = list(raw)
    except TypeError:
        return _Scored([None] * n, n, f"returned {type(raw).__name__}, expected a list of {n} values")
    if len(values_in) != n:
        return _Scored([None] * n, n, f"returned {len(values_in)} values for {n} completions")
    values: list[float | None] = []
    rows: list[bool] = []
    error = None
    for i, value in enumerate(values_in):
        if isinstance(value, RewardFailure):
            error = error or f"sample {i}: {value.reason}"
            values.append(None)
            rows.append(True)
            continue
        score = None if value is None else _as_score(value)
        if value is not None and score is None:
            error = error or f"sample {i}: invalid value {value!r} (expected a finite number or None)"
        values.append(score)
        rows.append(value is not None and score is None)
    metrics = getattr(raw, "metrics", None) if isinstance(raw, RewardBatch) else None
    details = getattr(raw, "details", None) if isinstance(raw, RewardBatch) else None
    # a reward's own counter never overwrites what the trainer measures of it (reward/{key}/failures: lost values)
    metrics = {f"reported_{k}" if k in OWN_METRICS else k: v for k, v in (metrics or {}).items()}
    return _Scored(values, sum(rows), error, metrics, list(details) if details is not None else None, rows)


def _call_inline(fn: RewardFn, completions: list[str], kwargs: dict[str, Any]) -> _Scored:
    n = len(completions)
    try:
        raw = call_maybe_async(fn, completions, **kwargs)
    except FatalRewardError:
        raise
    except Exception as exc:  # a broken reward must not crash the loop: counted, reported in `errors`
        return _Scored([None] * n, n, f"{type(exc).__name__}: {exc}")
    return _score_values(raw, n)


def call_reward(
    fn: RewardFn, completions: list[str], kwargs: dict[str, Any]
) -> tuple[list[float | None], int, str | None]:
    """Call one reward safely in this process: (values, failed count, first error message or None). Never raises on
    the reward's behalf, except FatalRewardError (KeyboardInterrupt and other BaseExceptions still propagate).
    An `async def` reward is awaited."""
    scored = _call_inline(fn, completions, kwargs)
    return scored.values, scored.failed, scored.error


def wants_images(fn: RewardFn) -> bool:
    """True when `fn` names an `images` parameter. Only such rewards receive the `images` column: images are
    large, most rewards never look at them, and a worker process would otherwise pay to unpickle them."""
    try:
        return "images" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def reward_ref(fn: RewardFn) -> str | None:
    """A name a worker process can resolve back to `fn` ("module:function" or "/abs/file.py:function"), or None
    for a function it cannot import (a closure, a lambda, a function of `__main__`)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or not qualname.isidentifier():
        return None
    if module.startswith(USER_MODULE_PREFIX):
        path = getattr(sys.modules.get(module), "__file__", None)
        return f"{path}:{qualname}" if path else None
    return f"{module}:{qualname}"


def _placement(spec: RewardSpec, fn: RewardFn) -> str | None:
    """The worker reference to run `spec` with, or None to run it in this process."""
    inline = spec.isolate is False or (spec.isolate is None and getattr(fn, "__vlmrl_inline__", False))
    if inline:
        return None
    ref = reward_ref(fn)
    if ref is None and spec.isolate:
        raise ConfigError(f"reward {spec.key!r}: isolate=true needs a function a worker can import (a module-level "
                         f"function in a file or package), not {_qualname(fn)}")
    return ref


def check_specs(specs: Sequence[RewardSpec], columns: Iterable[str] = ()) -> list[tuple[RewardSpec, RewardFn]]:
    """Each spec with its function; ConfigError for what would fail every call: an unknown name, two specs with
    the same key, a kwarg the function does not take, a kwarg that shadows a dataset column, a package the
    function `requires` that is not installed, isolate=true on a function a worker cannot import. `vlmrl train`
    calls this before any data or model is built (with the data's columns once loaded), so none of these surfaces
    at the first step."""
    resolved = [(spec, resolve_reward(spec.name)) for spec in specs]
    keys = [spec.key for spec in specs]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ConfigError(f"reward components {duplicates} appear twice; give each a distinct label "
                          f"(rewards[i].label)")
    columns = set(columns)
    for spec, fn in resolved:
        clash = sorted(set(spec.kwargs) & columns)
        if clash:
            raise ConfigError(f"reward {spec.key!r}: kwargs {clash} shadow dataset columns of the same name")
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin or C function: nothing to check against
            continue
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            names = {p.name for p in params}
            unknown = sorted(set(spec.kwargs) - names)
            if unknown:
                raise ConfigError(f"reward {spec.key!r}: kwargs {unknown} are not options of {_qualname(fn)}; its "
                                  f"options: {sorted(names - {'completions'})}")
        missing = missing_requirement(fn, f"reward {spec.key!r}")
        if missing is not None:
            raise missing
        _placement(spec, fn)
    return resolved


def compute_rewards(
    specs: Sequence[RewardSpec], completions: list[str], columns: dict[str, list], pool: WorkerPool | None = None
) -> RewardOutput:
    """Score a batch: each spec's function is called once with `completions`, `**columns` and `**spec.kwargs`
    (`images` only for rewards that name it, see `wants_images`), in a worker process or in this one (see the
    module docstring; `pool` defaults to the process-wide "rewards" pool).

    total[i] = sum_k weight_k * value_k[i] over components k whose value is not None; 0.0 (and counted in
    `no_reward`) when there is none; failed[i] when a component with a non-zero weight failed for sample i;
    graded[i] when a component with a positive weight that grades sample i's answer type (not a shaping one such
    as `length`; see `graded_types`) gave it a value.
    Configuration errors (`check_specs`) raise ConfigError before any reward runs.
    FatalRewardError propagates."""
    resolved = check_specs(specs, columns)
    n = len(completions)
    plans = []
    for spec, fn in resolved:
        cols = columns if wants_images(fn) else {k: v for k, v in columns.items() if k != "images"}
        plans.append((spec, fn, {**cols, **spec.kwargs}, _placement(spec, fn)))
    scored: dict[str, _Scored] = {}
    seconds: dict[str, float] = {}
    isolated = [(spec, kwargs, ref) for spec, _, kwargs, ref in plans if ref is not None]
    if isolated:
        jobs = [Job(ref, (completions,), kwargs, spec.timeout or DEFAULT_TIMEOUT) for spec, kwargs, ref in isolated]
        for (spec, _, _), outcome in zip(isolated, (pool or get_pool("rewards")).run(jobs), strict=True):
            if outcome.fatal:
                raise FatalRewardError(f"reward {spec.key!r}: {outcome.error}")
            ok = _score_values(outcome.value, n) if outcome.ok else _Scored([None] * n, n, outcome.error)
            scored[spec.key], seconds[spec.key] = ok, outcome.seconds
    for spec, fn, kwargs, ref in plans:
        if ref is None:
            start = time.perf_counter()
            scored[spec.key] = _call_inline(fn, completions, kwargs)
            seconds[spec.key] = time.perf_counter() - start

    totals = [0.0] * n
    has_reward = [False] * n
    graded = [False] * n  # a component with a positive weight that grades this answer type gave the sample a value
    kinds = [answer_type_of({k: columns[k][i] for k in ("answer_type", "options", "choices") if k in columns})
             for i in range(n)]
    failed = [False] * n  # a weighted component failed: the total is missing a term (a weight-0 one changes nothing)
    out = RewardOutput(total=None, components={}, failures={}, no_reward=0)  # type: ignore[arg-type]
    for spec, fn in resolved:
        result = scored[spec.key]
        types = graded_types(fn) if spec.weight > 0 else ()
        out.components[spec.key], out.failures[spec.key] = result.values, result.failed
        out.seconds[spec.key] = seconds[spec.key]
        if result.error is not None:
            out.errors[spec.key] = result.error
        if result.metrics:
            out.extra[spec.key] = result.metrics
        if result.details is not None:
            out.details[spec.key] = result.details
        for i, value in enumerate(result.values):
            if value is not None:
                totals[i] += spec.weight * value
                has_reward[i] = True
                graded[i] = graded[i] or (types is None or kinds[i] is None or kinds[i] in types)
            elif spec.weight != 0 and result.row_failed(i):
                failed[i] = True
    import torch

    out.total = torch.tensor(totals, dtype=torch.float32)
    out.failed = torch.tensor(failed, dtype=torch.bool)
    out.no_reward = has_reward.count(False)
    out.graded = graded
    return out
