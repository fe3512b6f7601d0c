"""Off-policy correction on the quickstart task: answers sampled by a stale policy (asynchronous rollouts, every step's
answers `--staleness` versions behind), trained without a correction and with TIS, MIS and IcePop, against the
on-policy (synchronous) run: the sampler–trainer KL, held-out accuracy with its 95% interval, how close each comes
to the on-policy run, and the wall time of each arm beside the synchronous one.

    python benchmarks/off_policy.py --seeds 0 1 2 --staleness 4 [--steps 1500] [--lr 3e-4] [KEY=VALUE ...]
    python benchmarks/off_policy.py --seeds 0 --staleness 1 --arms sync mis --steps 300 --threads 2   # wall time
    python benchmarks/off_policy.py --smoke        # seconds: 1 seed, 2 arms, a few steps of a very small model

The task and recipe are the quickstart's (counting shapes, 4,000 RL prompts, 600 held-out scenes, DAPO's settings
and the curriculum; the asynchronous producer runs dynamic sampling's rounds itself). Per seed the SFT warm-start runs
once (`trainer.steps=0`); every arm starts RL from its checkpoint-0, in its own process, at 1 thread, one arm at a
time (`--jobs 2`: two at once, each on its core; their wall times are then only comparable with each other).

Prints a markdown table for BENCHMARKS.md and writes the raw numbers to benchmarks/results/<--results>.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import SMOKE as SMOKE_RUN  # noqa: E402

PLAIN = ["trainer.eval_every=0", "trainer.log_rollouts_every=0", "trainer.save_every=0", "trainer.save_every_minutes=0"]
# the smallest mode (tests/test_benchmarks.py): benchmarks/smoke.py's model and data, a few short steps, with every
# answer trained (an untrained model's answers are truncated, which overlong filtering would drop)
SMOKE = [*SMOKE_RUN, "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "trainer.steps=3",
         "model.image_cache_mb=64", "algorithm.overlong_filter=false"]


ARMS = ("sync", "none", "token_tis", "mis", "icepop")
LABELS = {"none": "none", "token_tis": "token TIS", "mis": "MIS", "icepop": "IcePop"}


def arms(staleness: int, names=ARMS) -> dict[str, list[str]]:
    """{label: overrides}: `sync` is the on-policy run; the others sample `staleness` versions behind, corrected so."""
    stale = ["rollout.asynchronous=true", f"rollout.max_staleness={staleness}"]
    return {("on-policy (sync)" if n == "sync" else f"stale {staleness}, {LABELS[n]}"):
            ([] if n == "sync" else [*stale, f"algorithm.rollout_correction={n}"]) for n in names}


def vlmrl(args: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run([sys.executable, "-m", "vlmrl", "train", *args], stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"vlmrl train failed (see {log})")
    return time.perf_counter() - t0


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def result(run_dir: Path, seconds: float) -> dict:
    out = {"seconds": seconds}
    log = rows(run_dir)
    final = [r for r in log if r["phase"] == "eval"][-1]
    out.update(accuracy=final["greedy/accuracy"], low=final.get("greedy/accuracy_ci_low"),
               high=final.get("greedy/accuracy_ci_high"))
    train = [r for r in log if r["phase"] == "train"]
    for key in ("mismatch/k3", "mismatch/ess", "mismatch/masked_fraction", "mismatch/clipped_fraction"):
        values = [r[key] for r in train if key in r]
        out[key] = statistics.fmean(values) if values else None
    out["rl_seconds"] = sum(r["time/collect_score"] + r["time/update"] for r in train)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--staleness", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="sync is the on-policy run")
    ap.add_argument("--threads", type=int, default=1, help="trainer.threads of every run")
    ap.add_argument("--out", default="runs/off_policy")
    ap.add_argument("--results", default="off_policy.json")
    ap.add_argument("--smoke", action="store_true", help="a few steps of a very small model, 1 seed, 2 arms")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [*PLAIN, f"trainer.threads={a.threads}", *a.overrides]
    if a.smoke:
        a.seeds, base = a.seeds[:1], [*PLAIN, f"trainer.threads={a.threads}", *SMOKE, *a.overrides]
    else:
        base += [f"trainer.steps={a.steps}"]
    plan = arms(a.staleness, ["sync", "none"] if a.smoke else a.arms)
    results: dict[str, dict[str, dict]] = {}
    for seed in a.seeds:  # the SFT start, once per seed
        start = out / f"seed{seed}-sft"
        if not (start / "checkpoint-0").exists():
            vlmrl([*base, f"trainer.seed={seed}", "trainer.steps=0", f"trainer.output_dir={start}"],
                  out / f"seed{seed}-sft.log")

    def one(job):
        seed, name, extra = job
        run_dir = out / f"seed{seed}-{name.replace(' ', '_').replace(',', '')}"
        start = out / f"seed{seed}-sft" / "checkpoint-0"
        seconds = vlmrl([*base, f"trainer.seed={seed}", f"model.name_or_path={start}", "sft.steps=0",
                         f"trainer.output_dir={run_dir}", *extra], run_dir.with_suffix(".log"))
        return seed, name, result(run_dir, seconds)

    jobs = [(seed, name, extra) for seed in a.seeds for name, extra in plan.items()]
    with ThreadPoolExecutor(a.jobs) as pool:
        for seed, name, res in pool.map(one, jobs):
            results.setdefault(name, {})[str(seed)] = res
            print(f"seed {seed} {name}: {res['accuracy']:.3f} ({res['seconds']:.0f} s)", flush=True)
    starts = {str(s): [r for r in rows(out / f"seed{s}-sft") if r["phase"] == "eval"][-1]["greedy/accuracy"]
              for s in a.seeds}
    print(table(results, starts, a.seeds))
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / "benchmarks/results" / a.results).write_text(json.dumps({"args": vars(a), "starts": starts,
                                                                     "results": results}, indent=1))


def fmt(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def table(results: dict, starts: dict, seeds: list[int]) -> str:
    """One row per (arm, seed), then the mean over seeds; the gap to the on-policy run's accuracy on the same seed."""
    on = next(iter(results))
    lines = ["| arm | seed | held-out acc. [95%] | vs on-policy | mismatch k3 | ESS | masked | clipped | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, per_seed in results.items():
        for s in seeds:
            r = per_seed[str(s)]
            gap = 100 * (r["accuracy"] - results[on][str(s)]["accuracy"])
            ci = f" [{100 * r['low']:.1f}, {100 * r['high']:.1f}]" if r.get("low") is not None else ""
            lines.append(f"| {name} | {s} | {100 * r['accuracy']:.1f}%{ci} | {gap:+.1f} | {fmt(r['mismatch/k3'])} | "
                         f"{fmt(r['mismatch/ess'], '.3f')} | {fmt(r['mismatch/masked_fraction'], '.3f')} | "
                         f"{fmt(r['mismatch/clipped_fraction'], '.3f')} | {r['seconds']:.0f} |")
        accs = [per_seed[str(s)]["accuracy"] for s in seeds]
        gaps = [per_seed[str(s)]["accuracy"] - results[on][str(s)]["accuracy"] for s in seeds]
        secs = [per_seed[str(s)]["seconds"] / results[on][str(s)]["seconds"] for s in seeds]
        lines.append(f"| **{name}** | mean | {100 * statistics.fmean(accs):.1f}% | {100 * statistics.fmean(gaps):+.1f} "
                     f"| | | | | x{statistics.fmean(secs):.2f} |")
    lines.append(f"(SFT start: {', '.join(f'seed {s} {100 * starts[str(s)]:.1f}%' for s in seeds)})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
