"""Curriculum and SFT replay against plain RL from the same SFT start, and forgetting of a second task, over seeds.

    python benchmarks/training_strategies.py --seeds 0 1 2 --steps 200 --jobs 2
    python benchmarks/training_strategies.py --seeds 0 1 2 --steps 200 --tables-only
    python benchmarks/training_strategies.py --smoke --out DIR     # seconds: 1 seed, 2 steps, a very small model

Per seed, one SFT warm-start on two tasks: 300 counting and 300 colour labels (`trainer.steps=0`). It is evaluated on
both held-out sets: 600 counting and 300 colour scenes. From its checkpoint-0 every arm runs the quickstart's RL
(recipes/quickstart.yaml) on counting prompts only, so the colour task is a skill that RL's reward never sees:

- plain: the quickstart's RL, as measured: 3 resampling rounds and no filter (`AS_MEASURED`);
- curriculum: + `curriculum.order=learnability`, `filter_solved`, `filter_unsolved` (`filter_after=2`, `filter_recheck=0`);
- replay: + `replay.weight=W` on the SFT labels of both tasks (`replay.data` unset = data.sft).

Each run uses one torch thread; `--jobs` runs that many at once. Finished runs are not repeated. Prints a markdown
table for BENCHMARKS.md: counting accuracy (the RL task), colour accuracy (forgetting), the share of trained groups
that carried a signal, and wall time. Raw numbers go to benchmarks/results/training_strategies.json (--results).
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
EXTRA: list[str] = []  # overrides every run gets (--smoke: SMOKE, with two small tasks)
# the quickstart's RL as these arms were measured (before it skipped solved prompts and took 6 resampling rounds)
AS_MEASURED = ["curriculum.filter_solved=false", "curriculum.filter_unsolved=false", "algorithm.max_resample_rounds=3"]
TASKS = [*AS_MEASURED, "data.sft=[{task: shapes_count, n: 300}, {task: shapes_color, n: 300}]",
         "data.eval=[{task: shapes_count, n: 600}, {task: shapes_color, n: 300}]"]
ARMS = {
    "plain": [],
    "curriculum": ["curriculum.order=learnability", "curriculum.filter_solved=true", "curriculum.filter_unsolved=true",
                   "curriculum.filter_after=2", "curriculum.filter_recheck=0"],  # as measured (before rechecks)
    "replay": ["replay.weight={replay_weight}"],
}
COUNT, COLOR = "greedy/task/shapes_count/accuracy", "greedy/task/shapes_color/accuracy"


def vlmrl_train(args: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vlmrl", "train", "recipes/quickstart.yaml", *TASKS, *EXTRA, *args,
                           "trainer.threads=1"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"vlmrl train {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def rows(run_dir: Path, phase: str) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["phase"] == phase]


def sft_start(seed: int, out: Path) -> tuple[Path, dict]:
    run = out / f"sft-seed{seed}"
    if not (run / "checkpoint-0").exists():
        shutil.rmtree(run, ignore_errors=True)
        vlmrl_train([f"trainer.seed={seed}", "trainer.steps=0", f"trainer.output_dir={run}"])
    return run / "checkpoint-0", rows(run, "eval")[0]


def run_arm(arm: str, seed: int, start: Path, steps: int, out: Path, replay_weight: float,
            tables_only: bool = False) -> dict:
    run = out / f"{arm}-seed{seed}"
    done = run / "benchmark_result.json"
    if done.exists() and json.loads(done.read_text()).get("steps") == steps:
        return json.loads(done.read_text())
    if tables_only:
        raise SystemExit(f"{done} is missing: run the benchmark for {arm}, seed {seed} first")
    shutil.rmtree(run, ignore_errors=True)
    extra = [a.format(replay_weight=replay_weight) for a in ARMS[arm]]
    wall = vlmrl_train([f"model.name_or_path={start}", "sft.steps=0", f"trainer.seed={seed}",
                        f"trainer.steps={steps}", "trainer.eval_every=0", f"trainer.output_dir={run}", *extra])
    final, train = rows(run, "eval")[-1], rows(run, "train")
    signal = [1 - r["trained_pass_rate/0"] - r["trained_pass_rate/100"] for r in train]
    result = {"arm": arm, "seed": seed, "steps": steps, "wall_seconds": wall, "count": final[COUNT],
              "color": final[COLOR], "count_ci": [final[f"{COUNT}_ci_low"], final[f"{COUNT}_ci_high"]],
              "trained_with_signal": statistics.mean(signal), "train_accuracy_last50": statistics.mean(
                  r["accuracy"] for r in train[-50:])}
    done.write_text(json.dumps(result))
    print(f"{arm} seed {seed}: count {100 * result['count']:.1f}, colour {100 * result['color']:.1f} in {wall:.0f} s",
          flush=True)
    return result


def fmt(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--arms", nargs="+", default=list(ARMS))
    p.add_argument("--replay-weight", type=float, default=0.1)
    p.add_argument("--out", default="/tmp/vlmrl-bench/training-strategies")
    p.add_argument("--tables-only", action="store_true", help="print the table from the finished runs in --out")
    p.add_argument("--results", default=str(ROOT / "benchmarks/results/training_strategies.json"))
    p.add_argument("--smoke", action="store_true", help="the smallest mode (tests/test_benchmarks.py): seed 0, 2 "
                                                        "steps, every arm, a very small model and data")
    args = p.parse_args()
    if args.smoke:
        args.seeds, args.steps = [0], 2
        EXTRA.extend([o for o in SMOKE if not o.startswith(("data.sft", "data.eval"))])
        EXTRA.extend(["data.sft=[{task: shapes_count, n: 8}, {task: shapes_color, n: 8}]",
                      "data.eval=[{task: shapes_count, n: 8}, {task: shapes_color, n: 8}]"])
    out = Path(args.out)
    with ThreadPoolExecutor(1 if args.tables_only else args.jobs) as pool:
        starts = dict(zip(args.seeds, pool.map(lambda s: sft_start(s, out), args.seeds), strict=True))
        jobs = [(a, s) for s in args.seeds for a in args.arms]
        results = list(pool.map(lambda j: run_arm(j[0], j[1], starts[j[1]][0], args.steps, out, args.replay_weight,
                                                  args.tables_only), jobs))
    count0 = [starts[s][1][COUNT] for s in args.seeds]
    color0 = [starts[s][1][COLOR] for s in args.seeds]
    print(f"| arm | counting (RL task) | counting per seed | gain over the start | colour (not trained by RL) | "
          f"colour change | trained groups with a signal | wall time per run |\n|---|---|---|---|---|---|---|---|\n"
          f"| SFT start (both tasks) | {fmt(count0)} | {', '.join(f'{100 * c:.1f}' for c in count0)} | | "
          f"{fmt(color0)} | | | |")
    for arm in args.arms:
        rs = sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"])
        per_seed = ", ".join(f"{100 * r['count']:.1f}" for r in rs)
        print(f"| {arm} | {fmt([r['count'] for r in rs])} | {per_seed} | "
              f"{fmt([r['count'] - c for r, c in zip(rs, count0, strict=True)])} | {fmt([r['color'] for r in rs])} | "
              f"{fmt([r['color'] - c for r, c in zip(rs, color0, strict=True)])} | "
              f"{fmt([r['trained_with_signal'] for r in rs])} | "
              f"{statistics.mean(r['wall_seconds'] for r in rs):.0f} s |")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(
        {"starts": {s: v[1] for s, v in starts.items()}, "runs": results, "steps": args.steps,
         "replay_weight": args.replay_weight}, indent=1))


if __name__ == "__main__":
    main()
