"""Loading a benchmark's samples and evaluating a policy on them with the benchmark's own prompt and scorer.

`load_benchmark` reads the benchmark's dataset (its hub copy through the cache, or a folder given as `data`) through
`vlmrl.data.hub`, so a missing dataset is refused before any model loads and a bad row names its place.
`run_benchmark` calls `vlmrl.eval.generative.evaluate` with the benchmark's scorer as the one reward and as the
definition of solved: accuracy, its 95% interval, pass@k and maj@n come out exactly as for any evaluation, plus
`categories`: accuracy per value of each of the benchmark's category columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vlmrl.data.hub import load_hub
from vlmrl.data.sample import LoadReport, Sample
from vlmrl.errors import ConfigError
from vlmrl.eval.benchmarks.registry import Benchmark, resolve_benchmark
from vlmrl.eval.generative import Solved, evaluate, summarize
from vlmrl.rewards.registry import RewardSpec, reward_ref

CATEGORY_KEYS = ("accuracy", "accuracy_ci_low", "accuracy_ci_high", "n")


def parse_benchmark(ref: str) -> tuple[Benchmark, str | None]:
    """"NAME" or "NAME@SPLIT" (e.g. refcoco@testA) -> (the benchmark, the split asked for or None)."""
    name, _, split = ref.partition("@") if "@" in ref and not ref.endswith(".py") else (ref, "", "")
    return resolve_benchmark(name), split or None


def load_benchmark(benchmark: Benchmark, data: str | None = None, split: str | None = None, n: int | None = None,
                   on_error: str = "raise") -> tuple[list[Sample], LoadReport]:
    """The benchmark's samples: from `data` (a folder saved by datasets, one split or a DatasetDict) if given, else
    its hub dataset; `split` overrides the benchmark's; `n` keeps the first n samples (reading stops there)."""
    spec: dict[str, Any] = {"hub": data or benchmark.hub, "split": split or benchmark.split, "on_error": on_error}
    if benchmark.config and not data:
        spec["config"] = benchmark.config
    if benchmark.image_root:
        spec["image_root"] = benchmark.image_root
    if n:
        spec["n"] = n
    samples, report = load_hub(spec, f"benchmark {benchmark.name}", transform=benchmark.adapt,
                               needed=list(benchmark.columns))
    for sample in samples:
        sample["task"] = benchmark.name
    return samples, report


def scorer_spec(benchmark: Benchmark, judge: dict | None = None) -> RewardSpec:
    """The benchmark's scorer as a reward component keyed by the benchmark's name, run in this process; with `judge`
    (base_url, model and any `judged.judged_score` option) its published judge-based scoring instead."""
    if judge is not None:
        from vlmrl.eval.benchmarks.judged import JUDGED, judged_score

        if benchmark.name not in JUDGED:
            raise ConfigError(f"benchmark {benchmark.name}: its protocol defines no judge-based extraction (those "
                              f"that do: {', '.join(sorted(JUDGED))}); drop --extract judge")
        return RewardSpec(reward_ref(judged_score), kwargs={**judge, "benchmark": benchmark.name},
                          label=benchmark.name, isolate=False)
    ref = reward_ref(benchmark.score)
    if ref is None:
        raise ValueError(f"benchmark {benchmark.name}: its score function must be a module-level function")
    return RewardSpec(ref, kwargs=dict(benchmark.options), label=benchmark.name, isolate=False)


def categories(records: Sequence[dict], samples: Sequence[Sample], columns: Sequence[str],
               ks: Sequence[int] = ()) -> dict[str, dict[str, dict]]:
    """{column: {value: accuracy, its interval and n}} over the records (in sample order); a list value counts the
    sample under each of its items (MathVista's skills); samples without the column are left out."""
    out: dict[str, dict[str, dict]] = {}
    for column in columns:
        groups: dict[str, list[dict]] = {}
        for record, sample in zip(records, samples, strict=True):
            value = sample.get(column)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if item is not None and item != "":
                    groups.setdefault(str(item), []).append(record)
        if groups:
            out[column] = {value: {k: v for k, v in summarize(rows, ks).items() if k in CATEGORY_KEYS}
                           for value, rows in sorted(groups.items())}
    return out


def run_benchmark(policy: Any, benchmark: Benchmark, samples: list[Sample], *, temperature: float = 0.0, n: int = 1,
                  ks: Sequence[int] = (), max_new_tokens: int | None = None, batch_size: int = 64, seed: int = 0,
                  max_prompt_length: int | None = None, agent: Any = None,
                  progress: Callable[..., None] | None = None, judge: dict | None = None) -> dict:
    """`evaluate` with the benchmark's prompt (each sample's `problem` as is) and scorer (with `judge`: its
    published judge-based scoring, `scorer_spec`); adds `categories`."""
    spec = scorer_spec(benchmark, judge)
    if benchmark.prepare is not None:
        benchmark.prepare(samples, policy)
    result = evaluate(policy, samples, temperature=temperature, n=n, ks=ks, batch_size=batch_size, seed=seed,
                      max_new_tokens=max_new_tokens or benchmark.max_new_tokens, template="{problem}",
                      max_prompt_length=max_prompt_length, rewards=[spec], solved=Solved(spec, 1.0), agent=agent,
                      progress=progress)
    result["categories"] = categories(result["records"], samples, benchmark.categories, ks)
    return result
