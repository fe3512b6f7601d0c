"""A soak run: the agentic zoom recipe with one training and one rollout rank and asynchronous rollouts, for many
minutes, with every torch process group's default timeout cut short so that training-side phases (the SFT
warm-start, evaluations) last longer than it, beside the same recipe synchronous in one process.

    python benchmarks/soak_rollout_ranks.py [--steps 500] [--group-timeout 20] [--out runs/soak]
    python benchmarks/soak_rollout_ranks.py --smoke     # a minute: a very small model, a few steps

What a week-long job on a cluster needs and seconds-long tests cannot show: the rollout rank waits through every
training-side phase (its wait is the rollout-rank deadline, not the group's timeout), the run ends with its final
checkpoint, and the asynchronous split learns what the synchronous run learns (held-out accuracy within the 95%
interval). The rollout rank's longest silence is measured from outside, as the longest gap between two training
steps in metrics.jsonl (the first gap: from launch, through SFT and the start evaluation). Both arms start at once
on the same machine, at 1 thread per process. Prints a markdown table; writes benchmarks/results/soak_rollout_ranks.json (--results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from smoke import SMOKE as SMOKE_RUN  # noqa: E402

RECIPE = "recipes/agentic_zoom.yaml"
# rollout ranks run neither dynamic sampling nor a curriculum (vlmrl.trainer.rollout_ranks): both arms go without
COMMON = ["algorithm.dynamic_sampling=false", "trainer.threads=1"]
SHORT_GROUPS = """import datetime, runpy, sys
import torch.distributed as dist
_new_group, _init = dist.new_group, dist.init_process_group
def new_group(*args, **kwargs):  # every group without a timeout of its own gets the short one, not torch's default
    kwargs.setdefault("timeout", datetime.timedelta(seconds={timeout}))
    return _new_group(*args, **kwargs)
def init_process_group(*args, **kwargs):
    kwargs.setdefault("timeout", datetime.timedelta(seconds={timeout}))
    return _init(*args, **kwargs)
dist.new_group, dist.init_process_group = new_group, init_process_group
sys.argv = ["vlmrl", *sys.argv[1:]]
runpy.run_module("vlmrl", run_name="__main__")
"""


def launch(arm: str, out: Path, overrides: list[str], group_timeout: float) -> subprocess.Popen:
    args = ["-m", "vlmrl", "train", RECIPE, f"trainer.output_dir={out}", *COMMON, *overrides]
    if arm == "ranks":
        launcher = out.parent / "short_groups.py"
        launcher.write_text(SHORT_GROUPS.replace("{timeout}", f"{group_timeout:g}"))
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(launcher), *args[2:],
                "trainer.distributed=ddp", "rollout.rollout_ranks=1", "rollout.asynchronous=true",
                "rollout.max_staleness=1"]
    log = (out.parent / f"{out.name}.log").open("w")
    return subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def train_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum('"phase": "train"' in line for line in path.read_text().splitlines())


def summary(out: Path, seconds: float, gaps: list[float], code: int) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["phase"] == "eval"]
    final = evals[-1]
    checkpoints = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*") if p.name.split("-")[1].isdigit())
    return {"exit": code, "seconds": seconds, "steps": sum(r["phase"] == "train" for r in rows),
            "start": evals[0]["greedy/accuracy"], "accuracy": final["greedy/accuracy"],
            "low": final.get("greedy/accuracy_ci_low"), "high": final.get("greedy/accuracy_ci_high"),
            "checkpoints": checkpoints, "longest_gap": max(gaps, default=0.0), "first_gap": gaps[0] if gaps else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--group-timeout", type=float, default=20.0, help="seconds; torch's default is 30 minutes")
    ap.add_argument("--out", default="runs/soak")
    ap.add_argument("--results", default=str(ROOT / "benchmarks/results/soak_rollout_ranks.json"))
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    overrides = [f"trainer.steps={a.steps}", f"trainer.eval_every={a.eval_every}", "trainer.save_every=100"]
    if a.smoke:
        overrides = [*SMOKE_RUN, "trainer.steps=3", "trainer.eval_every=0", "agent.turn_tokens=24"]
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    arms = {"ranks": out / "ranks", "sync": out / "sync"}
    started = time.monotonic()
    procs = {arm: launch(arm, path, overrides, a.group_timeout) for arm, path in arms.items()}
    seen = {arm: (0, started) for arm in arms}
    gaps: dict[str, list[float]] = {arm: [] for arm in arms}
    ended: dict[str, float] = {}
    while len(ended) < len(arms):
        time.sleep(1.0)
        now = time.monotonic()
        for arm, path in arms.items():
            if arm in ended:
                continue
            steps = train_steps(path)
            if steps > seen[arm][0]:
                gaps[arm].append(now - seen[arm][1])
                seen[arm] = (steps, now)
            if procs[arm].poll() is not None:
                ended[arm] = now - started
    results = {arm: summary(path, ended[arm], gaps[arm], procs[arm].returncode) for arm, path in arms.items()}
    names = {"ranks": "asynchronous, 1 training + 1 rollout rank (torchrun x2), group timeout "
                      f"{a.group_timeout:g} s", "sync": "synchronous, one process"}
    lines = ["| run | exit | steps | wall | longest gap between steps (first) | after SFT | after RL [95%] | "
             "checkpoints |", "|---|---|---|---|---|---|---|---|"]
    for arm, r in results.items():
        ci = f" [{100 * r['low']:.1f}, {100 * r['high']:.1f}]" if r.get("low") is not None else ""
        lines.append(f"| {names[arm]} | {r['exit']} | {r['steps']} | {r['seconds'] / 60:.1f} min | "
                     f"{r['longest_gap']:.0f} s ({r['first_gap']:.0f} s) | {100 * r['start']:.1f}% | "
                     f"{100 * r['accuracy']:.1f}%{ci} | {', '.join(map(str, r['checkpoints']))} |")
    print("\n".join(lines))
    Path(a.results).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    raise SystemExit(0 if all(r["exit"] == 0 for r in results.values()) else 1)


if __name__ == "__main__":
    main()
