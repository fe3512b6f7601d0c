"""One registry of evaluation benchmarks: what each loads, how it prompts, how it scores, how it breaks down.

A `Benchmark` names its dataset (a hub name and split, or a folder given with `--data`), the dataset columns it
reads, an `adapt` function turning one dataset row into vlmrl rows (the published prompt as `problem`, the ground
truth as `solution`, the columns its scorer needs), a `score` function with a reward's signature
`(completions, solution, **columns) -> list[float | None]` (1.0 right, 0.0 wrong, None when the sample cannot be
scored), the sample columns it reports per-category accuracy for, and the source of its protocol.

A user adds one in a file of their own and names it on the command line:

    # my_bench.py
    from vlmrl.eval.benchmarks import Benchmark, register_benchmark
    register_benchmark(Benchmark(name="mybench", hub="me/my_bench", split="test", columns=("image", "q", "a"),
                                 adapt=lambda row: {"image": row["image"], "problem": row["q"], "solution": row["a"]},
                                 score=my_score, source="my paper"))

    vlmrl eval MODEL --benchmark my_bench.py:mybench

docs/benchmarks.md lists the built-in ones with their protocols.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrl.errors import ConfigError

Scorer = Callable[..., list]


@dataclass(frozen=True)
class Benchmark:
    """A standard evaluation set with its published protocol (see the module docstring)."""

    name: str
    hub: str  # the dataset on the Hugging Face hub (or a folder); --data replaces it
    split: str | None
    adapt: Callable[[dict], Any]  # one dataset row -> a vlmrl row {image(s), problem, solution, ...} or a list of them
    score: Scorer  # (completions, solution, **columns) -> [1.0 | 0.0 | None]
    columns: tuple[str, ...] = ()  # dataset columns `adapt` reads (checked before any row is read)
    config: str | None = None  # the dataset's configuration name, if it has several
    answer_type: str = "text"  # what maj@n groups answers as (vlmrl.data.ANSWER_TYPES)
    categories: tuple[str, ...] = ()  # sample columns to break accuracy down by (a list value counts in each)
    max_new_tokens: int = 1024  # the protocol's generation budget
    source: str = ""  # the paper and the code whose prompt and extraction this follows
    notes: str = ""  # where vlmrl departs from the published protocol
    options: dict[str, Any] = field(default_factory=dict)  # keyword options passed to `score`
    prepare: Callable[[list, Any], None] | None = None  # (samples, policy): add model-dependent columns in place
    image_root: str | None = None  # "repo": image paths are files of the dataset's repository (vlmrl.data.hub)


BENCHMARKS: dict[str, Benchmark] = {}


def register_benchmark(benchmark: Benchmark) -> Benchmark:
    """Add (or replace) a benchmark under its name; returns it."""
    if not benchmark.name or not isinstance(benchmark.name, str):
        raise ConfigError(f"a benchmark needs a name, got {benchmark.name!r}")
    BENCHMARKS[benchmark.name] = benchmark
    return benchmark


def resolve_benchmark(ref: str) -> Benchmark:
    """A registered name, or "path/to/file.py:NAME" / "package.module:NAME": the file is imported (it may call
    `register_benchmark`), then NAME is a registered benchmark or a `Benchmark` the module defines."""
    if ref in BENCHMARKS:
        return BENCHMARKS[ref]
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(f"unknown benchmark {ref!r}; built-in benchmarks: {', '.join(sorted(BENCHMARKS))}; or give "
                          "'path/to/file.py:NAME' for one of your own (docs/benchmarks.md)")
    from vlmrl.references import load_file

    if target.endswith(".py") or "/" in target:
        if not Path(target).is_file():
            raise ConfigError(f"benchmark {ref!r}: file {target!r} not found (relative to {Path.cwd()})")
        module = load_file(Path(target))
    else:
        import importlib

        try:
            module = importlib.import_module(target)
        except ImportError as error:
            raise ConfigError(f"benchmark {ref!r}: cannot import {target!r} ({error})") from None
    found = BENCHMARKS.get(attr) or getattr(module, attr, None)
    if not isinstance(found, Benchmark):
        raise ConfigError(f"benchmark {ref!r}: {target!r} neither registers a benchmark named {attr!r} nor defines "
                          f"a Benchmark of that name")
    return found
