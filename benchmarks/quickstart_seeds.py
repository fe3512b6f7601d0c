"""The quickstart over several seeds: held-out accuracy after SFT and after RL, per seed and mean ± std.

    python benchmarks/quickstart_seeds.py --seeds 0 1 2 [KEY=VALUE ...]

Each seed runs `vlmrl train` (the quickstart recipe plus the overrides) in its own process, one after another,
with all cores, exactly as a user would run it. Prints a markdown table for BENCHMARKS.md and writes the raw numbers
to benchmarks/results/quickstart_seeds.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, overrides: list[str], out_root: Path) -> dict:
    """One `vlmrl train` in its own process: its wall time, its own CPU time and peak memory (from wait4)."""
    out = out_root / f"seed{seed}"
    cmd = [sys.executable, "-m", "vlmrl", "train", "recipes/quickstart.yaml", f"trainer.seed={seed}",
           f"trainer.output_dir={out}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"seed {seed}: vlmrl train failed ({status}); rerun {' '.join(cmd)}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["phase"] == "eval"]
    return {"seed": seed, "wall_seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_mb": usage.ru_maxrss / 1024, "start": evals[0], "final": evals[-1],
            "curve": [(r["step"], r["greedy/accuracy"]) for r in evals]}


def ci(row: dict, key: str = "greedy/accuracy") -> str:
    """'65.7 [62.0, 69.4]': the accuracy with its 95% interval, in %."""
    low, high = row.get(f"{key}_ci_low"), row.get(f"{key}_ci_high")
    interval = f" [{100 * low:.1f}, {100 * high:.1f}]" if low is not None and high is not None else ""
    return f"{100 * row[key]:.1f}{interval}"


def mean_std(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="/tmp/vlmrl-bench/quickstart")
    p.add_argument("--jobs", type=int, default=1, help="seeds run at once (each then gets a share of the cores)")
    p.add_argument("--results", default="quickstart_seeds.json", help="file name under benchmarks/results/")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    with ThreadPoolExecutor(args.jobs) as pool:  # --jobs 1: one after another, the way a user runs it
        results = list(pool.map(lambda s: run_seed(s, args.overrides, Path(args.out)), args.seeds))
    print("| seed | greedy acc. after SFT | greedy acc. after RL | gain | sampled after SFT | sampled after RL "
          "| wall time | CPU time | peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s, f = r["start"], r["final"]
        print(f"| {r['seed']} | {ci(s)} | {ci(f)} | "
              f"{100 * (f['greedy/accuracy'] - s['greedy/accuracy']):+.1f} | {100 * s['sampled/accuracy']:.1f} | "
              f"{100 * f['sampled/accuracy']:.1f} | {r['wall_seconds']:.0f} s | {r['cpu_seconds']:.0f} s | "
              f"{r['peak_rss_mb']:.0f} MB |")
    col = {k: [r[w][f"{m}/accuracy"] for r in results] for k, (w, m) in
           {"gs": ("start", "greedy"), "gf": ("final", "greedy"), "ss": ("start", "sampled"),
            "sf": ("final", "sampled")}.items()}
    gain = [b - a for a, b in zip(col["gs"], col["gf"], strict=True)]
    walls = [r["wall_seconds"] for r in results]
    print(f"| mean ± std | {mean_std(col['gs'])} | {mean_std(col['gf'])} | {mean_std(gain)} | {mean_std(col['ss'])} | "
          f"{mean_std(col['sf'])} | {statistics.mean(walls):.0f} s (max {max(walls):.0f} s) | "
          f"{statistics.mean(r['cpu_seconds'] for r in results):.0f} s | "
          f"{max(r['peak_rss_mb'] for r in results):.0f} MB (max) |")
    out = ROOT / "benchmarks/results"
    out.mkdir(parents=True, exist_ok=True)
    (out / args.results).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
