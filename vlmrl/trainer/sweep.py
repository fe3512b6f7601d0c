"""Several seeds of one recipe: `vlmrl train --seeds N [--control sft]`.

Seed i runs the recipe with `trainer.seed = base + i` in `RUN_ROOT/seed<seed>` (RUN_ROOT = `trainer.output_dir`,
numbered if it exists). `data.seed` is left alone, so every seed sees the same data. Every scalar eval metric of the
runs (after SFT, after RL, and each baseline arm on each split) is aggregated into `RUN_ROOT/seeds.json` as
mean, std (sample standard deviation, n - 1; undefined for one seed), min, max and the per-seed values.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from pathlib import Path

from vlmrl.config import Config
from vlmrl.errors import ConfigError
from vlmrl.trainer.control import train_with_baselines
from vlmrl.trainer.run import Progress, fresh_run_dir


def flatten_run(result: dict) -> dict[str, float | None]:
    """The eval metrics of one run's summary as flat keys: start/<metric>, final/<metric>, and
    <split>/<arm>/<metric> for its baselines (split "in_distribution" or an OOD split name)."""
    out: dict[str, float | None] = {}
    for where in ("start", "final"):
        out.update({f"{where}/{k}": v for k, v in result.get(where, {}).items()})
    baselines = result.get("baselines") or {}
    for arm, metrics in baselines.get("in_distribution", {}).items():
        out.update({f"in_distribution/{arm}/{k}": v for k, v in metrics.items()})
    for split, arms in baselines.get("ood", {}).items():
        for arm, metrics in arms.items():
            out.update({f"{split}/{arm}/{k}": v for k, v in metrics.items()})
    if "rl_seconds" in baselines:
        out["rl_seconds"] = baselines["rl_seconds"]
    if "control" in baselines:
        out["control/steps"] = baselines["control"]["steps"]
        out["control/seconds"] = baselines["control"]["seconds"]
    if "wall_seconds" in result:
        out["wall_seconds"] = result["wall_seconds"]
    return {k: v for k, v in out.items() if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))}


def aggregate(values: list[float | None]) -> dict:
    """mean, std (n - 1), min, max over the defined values; `count` of them. Undefined (None) values (e.g. a
    reflection ratio with an empty denominator) are left out; with none defined every statistic is None, and std is
    None below two values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    return {"mean": statistics.fmean(xs) if xs else None, "std": statistics.stdev(xs) if len(xs) > 1 else None,
            "min": min(xs) if xs else None, "max": max(xs) if xs else None, "count": len(xs), "values": values}


def aggregate_runs(results: list[dict]) -> dict[str, dict]:
    """Per metric key (union over runs, in first-seen order): `aggregate` of its per-run values."""
    flat = [flatten_run(r) for r in results]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    return {k: aggregate([f.get(k) for f in flat]) for k in keys}


def run_seeds(cfg: Config, seeds: int, control: str | None = None, progress: Progress | None = None,
              on_seed_done=None) -> dict:
    """Run the recipe once per seed (with baselines when `control` is given or OOD splits exist) and aggregate.

    Returns {"root", "seeds", "runs", "metrics"} and writes it to RUN_ROOT/seeds.json (rewritten after each seed,
    so an interrupted sweep keeps what finished). `on_seed_done(result)` is called after each seed."""
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: need at least one seed")
    root = fresh_run_dir(cfg.trainer.output_dir)
    base = cfg.trainer.seed
    results, out = [], {}
    for i in range(seeds):
        one = copy.deepcopy(cfg)
        one.trainer.seed = base + i
        one.trainer.output_dir = str(root / f"seed{base + i}")
        result = train_with_baselines(one, control, progress)
        results.append(result)
        out = {"root": str(root), "seeds": [base + j for j in range(len(results))],
               "runs": [r["run_dir"] for r in results], "control": control, "metrics": aggregate_runs(results)}
        (Path(root) / "seeds.json").write_text(json.dumps(out, indent=1))
        if on_seed_done is not None:
            on_seed_done(result)
    return out
