"""The quickstart's honest baselines over seeds: the SFT start, RL, and a matched-compute SFT control, in-distribution
and on two out-of-distribution splits, mean ± std over seeds.

    python benchmarks/quickstart_control_ood.py [--seeds 3] [--out DIR] [KEY=VALUE ...]

It runs exactly what a user would run (one process, seeds one after another):

    vlmrl train recipes/quickstart.yaml trainer.threads=1 eval.samples=4 \
        eval.ood='{ood_count: {task: shapes_count, n: 300}, ood_size: {task: shapes_count, n: 300, size: [112, 140], split: test}}' \
        --seeds 3 --control sft

- ood_count: the task's `ood` split: 7-9 objects and answers 5-7 (training shows 1-6 objects and answers 0-4)
- ood_size: in-range counts on 112-140 px canvases (training shows 56-84 px)

then `vlmrl report` over the sweep, and prints markdown tables for BENCHMARKS.md from RUN_ROOT/seeds.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OOD = ("{ood_count: {task: shapes_count, n: 300}, "
       "ood_size: {task: shapes_count, n: 300, size: [112, 140], split: test}}")
SPLITS = [("in_distribution", "in-distribution"), ("ood_count", "OOD: 7-9 objects, answers 5-7"),
          ("ood_size", "OOD: 112-140 px canvases")]
ARMS = [("start", "start (SFT, checkpoint-0)"), ("rl", "RL (GRPO)"), ("control_sft", "SFT control, same wall time")]


def cell(stats: dict | None, scale: float = 100.0, digits: int = 1) -> str:
    if not stats or stats["mean"] is None:
        return "n/a"
    std = f" ± {scale * stats['std']:.{digits}f}" if stats["std"] is not None else ""
    return f"{scale * stats['mean']:.{digits}f}{std}"


def tables(seeds: dict) -> str:
    m = seeds["metrics"]
    out = []
    for metric, title in (("greedy/accuracy", "greedy accuracy (%)"), ("sampled/accuracy", "sampled accuracy, T=1 (%)"),
                          ("sampled/pass@4", "pass@4, T=1 (%)"), ("sampled/maj@4", "maj@4, T=1 (%)")):
        out.append(f"\n{title}, mean ± std over seeds {seeds['seeds']}:\n")
        out.append("| | " + " | ".join(name for _, name in SPLITS) + " |")
        out.append("|---|" + "---|" * len(SPLITS))
        for arm, arm_name in ARMS:
            out.append(f"| {arm_name} | " + " | ".join(cell(m.get(f"{split}/{arm}/{metric}")) for split, _ in SPLITS)
                       + " |")
    out.append("")
    out.append(f"RL phase training time per seed: {cell(m.get('rl_seconds'), 1, 0)} s; control SFT steps in that "
               f"time: {cell(m.get('control/steps'), 1, 0)}; `train` wall time (SFT, RL and their evaluations): "
               f"{cell(m.get('wall_seconds'), 1, 0)} s")
    return "\n".join(out)


def seeds_of_runs(paths: list[str]) -> dict:
    """seeds.json's content for run directories from several sweeps (each with its baselines.json)."""
    from vlmrl.eval.runs import discover, load_run
    from vlmrl.trainer.sweep import aggregate_runs

    results, seeds = [], []
    for run in map(load_run, discover(paths)):
        b = run.baselines
        wall = run.series("summary", "wall_seconds")
        results.append({"start": b["in_distribution"]["start"], "final": b["in_distribution"]["rl"], "baselines": b,
                        **({"wall_seconds": next(iter(wall.values()))} if wall else {})})
        seeds.append(run.config["trainer"]["seed"])
    return {"seeds": seeds, "runs": [str(p) for p in paths], "metrics": aggregate_runs(results)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default="/tmp/vlmrl-bench/quickstart-control-ood")
    p.add_argument("--tables-only", action="store_true", help="print the tables of an existing --out sweep root")
    p.add_argument("--runs", nargs="+", help="with --tables-only: aggregate these run directories or sweep roots "
                                            "instead (e.g. seeds finished by separate sweeps)")
    p.add_argument("--results", default=str(ROOT / "benchmarks/results/quickstart_control_ood.json"))
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    root = Path(args.out)
    if not args.tables_only:
        if root.exists() and any(root.iterdir()):
            sys.exit(f"{root} exists and is not empty; give a new --out (runs are never overwritten)")
        cmd = [sys.executable, "-m", "vlmrl", "train", "recipes/quickstart.yaml", "trainer.threads=1", "eval.samples=4",
               f"eval.ood={OOD}", f"trainer.output_dir={root}", *args.overrides, "--seeds", str(args.seeds),
               "--control", "sft"]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True)
        print(f"sweep wall time: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "vlmrl", "report", str(root)], cwd=ROOT, check=True)
    seeds = json.loads((root / "seeds.json").read_text()) if not args.runs else seeds_of_runs(args.runs)
    print(tables(seeds))
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(seeds, indent=1))


if __name__ == "__main__":
    main()
