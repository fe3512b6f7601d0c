"""Every algorithm on the quickstart task from the same SFT start: held-out accuracy before and after RL, over seeds.

    python benchmarks/algorithms.py --seeds 0 1 2 --steps 200 --jobs 2
    python benchmarks/algorithms.py --smoke --out DIR     # seconds: 1 seed, 2 steps, a very small model

Per seed, the quickstart's SFT warm-start runs once (`trainer.steps=0`) and its checkpoint-0 is the start of every
algorithm (`model.name_or_path=.../checkpoint-0 sft.steps=0`), so the rows differ only in the algorithm. Each run
uses one torch thread; `--jobs` runs that many at once. Prints a markdown table for BENCHMARKS.md and writes the raw
numbers to benchmarks/results/algorithms.json (--results).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import SMOKE  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXTRA: list[str] = []  # overrides every run gets (--smoke: SMOKE)
ALGORITHMS = ["grpo", "grpo_kl", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "reinforce_pp_single",
              "remax", "ppo", "dpo_online", "dpo_offline"]


def vlmrl_train(args: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vlmrl", "train", *args, *EXTRA, "trainer.threads=1"], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"vlmrl train {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "eval"]


def sft_start(seed: int, out: Path) -> tuple[Path, dict]:
    run = out / f"sft-seed{seed}"
    if not (run / "checkpoint-0").exists():
        vlmrl_train(["recipes/quickstart.yaml", f"trainer.seed={seed}", "trainer.steps=0", f"trainer.output_dir={run}"])
    return run / "checkpoint-0", evals(run)[0]


def run_algorithm(name: str, seed: int, start: Path, steps: int, out: Path, tables_only: bool = False) -> dict:
    run = out / f"{name}-seed{seed}"
    done = run / "benchmark_result.json"  # a finished run is not repeated when the benchmark is restarted
    if done.exists() and json.loads(done.read_text()).get("steps") == steps:
        return json.loads(done.read_text())
    if tables_only:
        raise SystemExit(f"{done} is missing: run the benchmark for {name}, seed {seed} first")
    shutil.rmtree(run, ignore_errors=True)  # an unfinished run's folder: vlmrl would write to RUN-2 beside it
    wall = vlmrl_train([f"recipes/{name}.yaml", f"model.name_or_path={start}", "sft.steps=0",
                        f"trainer.seed={seed}", f"trainer.steps={steps}", "trainer.eval_every=0",
                        f"trainer.output_dir={run}"])
    final = evals(run)[-1]
    result = {"algorithm": name, "seed": seed, "steps": steps, "wall_seconds": wall,
              "greedy": final["greedy/accuracy"], "sampled": final["sampled/accuracy"]}
    done.write_text(json.dumps(result))
    print(f"{name} seed {seed}: greedy {100 * result['greedy']:.1f} in {wall:.0f} s", flush=True)
    return result


def fmt(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    p.add_argument("--out", default="/tmp/vlmrl-bench/algorithms")
    p.add_argument("--tables-only", action="store_true", help="print the table from the finished runs in --out")
    p.add_argument("--results", default=str(ROOT / "benchmarks/results/algorithms.json"))
    p.add_argument("--smoke", action="store_true", help="the smallest mode (tests/test_benchmarks.py): seed 0, 2 "
                                                        "steps, grpo and dpo_offline, a very small model")
    args = p.parse_args()
    if args.smoke:
        args.seeds, args.steps = [0], 2
        args.algorithms = args.algorithms if args.algorithms != ALGORITHMS else ["grpo", "dpo_offline"]
        EXTRA.extend(SMOKE)
    out = Path(args.out)
    with ThreadPoolExecutor(1 if args.tables_only else args.jobs) as pool:
        starts = dict(zip(args.seeds, pool.map(lambda s: sft_start(s, out), args.seeds), strict=True))
        jobs = [(a, s) for s in args.seeds for a in args.algorithms]
        results = list(pool.map(lambda j: run_algorithm(j[0], j[1], starts[j[1]][0], args.steps, out,
                                                        args.tables_only), jobs))
    start_greedy = [starts[s][1]["greedy/accuracy"] for s in args.seeds]
    start_sampled = [starts[s][1]["sampled/accuracy"] for s in args.seeds]
    print(f"| algorithm (recipe) | greedy acc. after RL | sampled acc. after RL | gain over the SFT start (greedy) "
          f"| seeds above the start | greedy per seed | wall time per run |\n|---|---|---|---|---|---|---|\n"
          f"| SFT start | {fmt(start_greedy)} | {fmt(start_sampled)} | | | "
          f"{', '.join(f'{100 * g:.1f}' for g in start_greedy)} | |")
    for name in args.algorithms:
        rows = sorted((r for r in results if r["algorithm"] == name), key=lambda r: r["seed"])
        gains = [r["greedy"] - g for r, g in zip(rows, start_greedy, strict=True)]
        print(f"| {name} | {fmt([r['greedy'] for r in rows])} | {fmt([r['sampled'] for r in rows])} | "
              f"{fmt(gains)} | {sum(g > 0 for g in gains)}/{len(gains)} | "
              f"{', '.join(f'{100 * g:.1f}' for g in (r['greedy'] for r in rows))} | "
              f"{statistics.mean(r['wall_seconds'] for r in rows):.0f} s |")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(
        json.dumps({"starts": {s: v[1] for s, v in starts.items()}, "runs": results, "steps": args.steps}, indent=1))


if __name__ == "__main__":
    main()
