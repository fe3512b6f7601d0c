"""The quickstart over seeds and thread counts: held-out accuracy after SFT, after RL and after the matched-compute
SFT control, per run and mean ± std.

    python benchmarks/quickstart_seeds.py --seeds 0 1 2 --threads 1 2 --control [KEY=VALUE ...]

Each (seed, threads) pair runs `vlmrl train` (the quickstart recipe plus the overrides) in its own process, exactly
as a user would run it, with `trainer.threads` set. `--jobs 2` runs two at once (use it only for 1-thread runs on a
2-core machine: each then has its core; a 2-thread run's wall time is only meaningful alone).

`--control` then trains the matched-compute SFT control of every run (continued SFT on the labelled set from the run's
own SFT start, `vlmrl.trainer.control.run_baselines`) for a fixed number of SFT steps: the run's RL training seconds
divided by its own mean SFT step time, so the control gets the compute RL had whatever else shares the machine while
the controls train (they may run in parallel, `--jobs`).

Prints a markdown table for BENCHMARKS.md and writes the raw numbers to benchmarks/results/<--results>, each run with
the table its `vlmrl train` printed, the machine and the code. `--readme` also writes the first run (the first seed at
the first thread count) to benchmarks/results/quickstart_readme.json: the table README.md quotes, which
tests/test_readme_table.py holds the README to.

    python benchmarks/quickstart_seeds.py --seeds 0 --threads 2 --readme     # the README's run, again
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_RUN = ROOT / "benchmarks/results/quickstart_readme.json"
CONTROL = """
import sys
from vlmrl.config import load_config
from vlmrl.trainer.control import run_baselines, summary_of_run
run, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = load_config(run + "/config.yaml", [f"control.steps={steps}", f"trainer.threads={threads}", "eval.ood=null"])
run_baselines(cfg, summary_of_run(run), "sft")
"""


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def machine() -> str:
    """'2-core Intel(R) Xeon(R) ...': the cores and the CPU's model name, as README.md names the machine."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    return f"{os.cpu_count()}-core {names[0] if names else platform.processor() or platform.machine()}"


def code() -> str:
    """The commit the runs ran, with '+changes' when the working tree differed from it."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--", "vlmrl") else "")


def printed_table(stdout: str) -> str:
    """The held-out table out of what `vlmrl train` printed: from its `held-out` header to its `(accuracy on ...)`
    line."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("held-out"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("(accuracy on"))
    return "\n".join(lines[start:end + 1])


def timed_run(cmd: list[str], what: str, stdout: Path):
    """Run `cmd` (a `vlmrl train`) in its own process from the repository root, its console output to `stdout`:
    (wall seconds, its rusage)."""
    stdout.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(stdout, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise RuntimeError(f"{what}: vlmrl train failed ({status}); rerun {' '.join(cmd)}")
    return wall, usage


def run_one(seed: int, threads: int, overrides: list[str], out_root: Path) -> dict:
    """One `vlmrl train` in its own process: its wall time, its own CPU time and peak memory (from wait4)."""
    out = out_root / f"seed{seed}-threads{threads}"
    cmd = [sys.executable, "-m", "vlmrl", "train", f"trainer.seed={seed}", f"trainer.threads={threads}",
           f"trainer.output_dir={out}", *overrides]
    console = out_root / f"seed{seed}-threads{threads}.stdout"
    wall, usage = timed_run(cmd, f"seed {seed}, {threads} thread(s)", console)
    rows = metrics(out)
    evals = [r for r in rows if r["phase"] == "eval"]
    sft = [r["time/update"] for r in rows if r["phase"] == "sft" and "time/update" in r]
    rl = sum(r["time/collect_score"] + r["time/update"] for r in rows if r["phase"] == "train")
    print(f"seed {seed}, {threads} thread(s): {100 * evals[0]['greedy/accuracy']:.1f} -> "
          f"{100 * evals[-1]['greedy/accuracy']:.1f} in {wall:.0f} s", flush=True)
    return {"seed": seed, "threads": threads, "command": f"vlmrl train trainer.seed={seed} trainer.threads={threads}"
            + "".join(f" {o}" for o in overrides), "machine": machine(), "code": code(),
            "date": datetime.date.today().isoformat(), "run_dir": str(out), "wall_seconds": wall,
            "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024,
            "rl_seconds": rl, "sft_step_seconds": statistics.mean(sft) if sft else None,
            "start": evals[0], "final": evals[-1], "curve": [(r["step"], r["greedy/accuracy"]) for r in evals],
            "printed": printed_table(console.read_text())}


def add_control(result: dict) -> dict:
    """The run's SFT control at matched compute: RL's training seconds / the run's mean SFT step time, in steps."""
    steps = max(1, round(result["rl_seconds"] / result["sft_step_seconds"]))
    run = result["run_dir"]
    subprocess.run([sys.executable, "-c", CONTROL, run, str(steps), str(result["threads"])], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    arms = json.loads((Path(run) / "baselines.json").read_text())["in_distribution"]
    print(f"seed {result['seed']}, {result['threads']} thread(s): control {steps} SFT steps -> "
          f"{100 * arms['control_sft']['greedy/accuracy']:.1f}", flush=True)
    return {**result, "control_steps": steps, "control": arms["control_sft"]}


def ci(row: dict, key: str = "greedy/accuracy") -> str:
    """'65.7 [62.0, 69.4]': the accuracy with its 95% interval, in %."""
    low, high = row.get(f"{key}_ci_low"), row.get(f"{key}_ci_high")
    interval = f" [{100 * low:.1f}, {100 * high:.1f}]" if low is not None and high is not None else ""
    return f"{100 * row[key]:.1f}{interval}"


def mean_std(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.mean(xs):.1f} ± {100 * sd:.1f}"


def table(results: list[dict]) -> str:
    control = all("control" in r for r in results)
    head = ["seed", "threads", "greedy after SFT", "greedy after RL", "gain"]
    head += ["SFT control (steps)", "RL - control"] if control else []
    head += ["sampled after SFT", "sampled after RL", "wall time", "CPU time", "peak RSS"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        s, f = r["start"], r["final"]
        cells = [str(r["seed"]), str(r["threads"]), ci(s), ci(f),
                 f"{100 * (f['greedy/accuracy'] - s['greedy/accuracy']):+.1f}"]
        if control:
            cells += [f"{ci(r['control'])} ({r['control_steps']})",
                      f"{100 * (f['greedy/accuracy'] - r['control']['greedy/accuracy']):+.1f}"]
        cells += [f"{100 * s['sampled/accuracy']:.1f}", f"{100 * f['sampled/accuracy']:.1f}",
                  f"{r['wall_seconds']:.0f} s", f"{r['cpu_seconds']:.0f} s", f"{r['peak_rss_mb']:.0f} MB"]
        lines.append("| " + " | ".join(cells) + " |")
    acc = lambda arm, mode="greedy": [r[arm][f"{mode}/accuracy"] for r in results]  # noqa: E731
    walls = [r["wall_seconds"] for r in results]
    cells = ["mean ± std", "", mean_std(acc("start")), mean_std(acc("final")),
             mean_std([b - a for a, b in zip(acc("start"), acc("final"), strict=True)])]
    if control:
        cells += [mean_std(acc("control")),
                  mean_std([b - a for a, b in zip(acc("control"), acc("final"), strict=True)])]
    cells += [mean_std(acc("start", "sampled")), mean_std(acc("final", "sampled")),
              f"{statistics.mean(walls):.0f} s (max {max(walls):.0f} s)",
              f"{statistics.mean(r['cpu_seconds'] for r in results):.0f} s",
              f"{max(r['peak_rss_mb'] for r in results):.0f} MB (max)"]
    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, nargs="+", default=[2], help="trainer.threads of each run")
    p.add_argument("--control", action="store_true", help="also train each run's matched-compute SFT control")
    p.add_argument("--out", default="/tmp/vlmrl-bench/quickstart")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each then gets a share of the cores)")
    p.add_argument("--results", default=None, help="file name under benchmarks/results/ (default "
                   "quickstart_seeds.json; with --readme only that file is written unless this is given)")
    p.add_argument("--tables-only", action="store_true", help="print the table of the saved results")
    p.add_argument("--readme", nargs="?", const=str(README_RUN), metavar="FILE",
                   help="also write the first run, with the table its vlmrl train printed, as the run README.md "
                        "quotes (default benchmarks/results/quickstart_readme.json; update README.md to match)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    # --readme alone re-measures the README's run: it must not replace the seeds table's raw numbers
    saved = None if args.readme and args.results is None else \
        ROOT / "benchmarks/results" / (args.results or "quickstart_seeds.json")
    if args.tables_only:
        print(table(json.loads((saved or ROOT / "benchmarks/results/quickstart_seeds.json").read_text())))
        return
    pairs = [(s, t) for t in args.threads for s in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:  # --jobs 1: one after another, the way a user runs it
        results = list(pool.map(lambda st: run_one(*st, args.overrides, Path(args.out)), pairs))
        if args.control:
            results = list(pool.map(add_control, results))
    print(table(results))
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(results, indent=1))
    if args.readme:
        first = {k: v for k, v in results[0].items() if k not in ("run_dir", "curve")}
        Path(args.readme).write_text(json.dumps(first, indent=1) + "\n")
        print(f"\nthe README's run: {args.readme}; README.md quotes its table:\n{first['printed']}")


if __name__ == "__main__":
    main()
