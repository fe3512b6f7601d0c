"""Reading run directories for reports: metrics.jsonl, rollouts.jsonl, baselines.json, a sweep's seeds.json.

A path is a run directory (it holds `metrics.jsonl`) or a sweep root (its `seed*/` children are runs). Pure file
reading and small aggregations over seeds; no plotting.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class Run:
    """One training run as the report sees it."""

    path: Path
    rows: list[dict]
    rollouts: list[dict] = field(default_factory=list)
    baselines: dict | None = None
    control_rows: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    def series(self, phase: str, key: str) -> dict[int, float]:
        """step -> value of `key` in `phase` rows (a resumed run's repeated steps: the last one wins)."""
        return {r["step"]: r[key] for r in self.rows if r["phase"] == phase and _number(r.get(key))}

    def evals(self) -> list[dict]:
        """The eval rows in step order, one per step."""
        by_step = {r["step"]: r for r in self.rows if r["phase"] == "eval"}
        return [by_step[s] for s in sorted(by_step)]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i}: not JSON ({e.msg}); was the run interrupted mid-write?") from None
    return out


def load_run(path: str | Path) -> Run:
    path = Path(path)
    rows = _jsonl(path / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"{path}: no metrics.jsonl (or it is empty); give a run directory or a sweep root")
    baselines = path / "baselines.json"
    config = path / "config.yaml"
    return Run(path, rows, _jsonl(path / "rollouts.jsonl"),
               json.loads(baselines.read_text()) if baselines.exists() else None,
               _jsonl(path / "control-sft" / "metrics.jsonl"),
               yaml.safe_load(config.read_text()) if config.exists() else {})


def discover(paths: list[str | Path]) -> list[Path]:
    """Run directories under `paths`: each path itself if it holds metrics.jsonl, else its children that do."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such run directory")
        if (p / "metrics.jsonl").exists():
            found.append(p)
            continue
        children = sorted(c for c in p.iterdir() if (c / "metrics.jsonl").exists())
        if not children:
            raise FileNotFoundError(f"{p}: neither a run directory (metrics.jsonl) nor a sweep root (seed*/ runs)")
        found += children
    return list(dict.fromkeys(found))


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample std (n - 1) of the defined values; std None below two values, both None for none."""
    xs = [v for v in values if _number(v)]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def band(series: list[dict[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Over seeds: steps present in every series, with the mean, min and max at each."""
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    vals = [[s[t] for s in series] for t in steps]
    return steps, [statistics.fmean(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def smooth(steps: list[int], values: list[float], window: int) -> tuple[list[int], list[float]]:
    """Trailing moving average over `window` points (window 1 = unchanged)."""
    if window <= 1:
        return steps, values
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return steps, out
