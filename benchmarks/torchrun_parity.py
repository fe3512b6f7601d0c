"""The same recipe in one process and under `torchrun --nproc_per_node 2` (gloo, 1 thread per process): held-out
accuracy after RL with its 95% interval, and the wall time of each.

    python benchmarks/torchrun_parity.py recipes/agentic_zoom.yaml recipes/ppo.yaml [--modes ddp fsdp2] [KEY=VALUE ...]
    python benchmarks/torchrun_parity.py --smoke     # seconds: a very small model, 2 steps, the two recipes above
    python benchmarks/torchrun_parity.py recipes/agentic_zoom.yaml --modes ranks \
        --set algorithm.dynamic_sampling=false rollout.asynchronous=true rollout.max_staleness=1

`--modes ranks` runs the second arm as one training process and one rollout process (`rollout.rollout_ranks=1`,
DDP; the recipe must be asynchronous, without dynamic sampling or a curriculum): the one-process arm is then the
same asynchronous recipe with its producer on a thread.

What a user moving from one GPU to eight expects: the same recipe and the same numbers, no new flags. Both arms draw
the same prompts and, through each prompt's own seed, sample the same answers whether one process or two generate
them; their updates agree to float rounding (tests/test_distributed.py), so their accuracies should agree within the
interval. On a 2-core CPU the two processes share the cores the one process has to itself at 1 thread, so the wall
time says how much the communication and the per-process overheads cost, not what more GPUs would buy.

Prints a markdown table for BENCHMARKS.md and writes the raw numbers to benchmarks/results/<--results>.
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

# the smallest mode (tests/test_benchmarks.py): benchmarks/smoke.py's model and data, 2 short steps
SMOKE = [*SMOKE_RUN, "rollout.max_new_tokens=6", "eval.max_new_tokens=6", "trainer.steps=2", "trainer.eval_every=0",
         "agent.turn_tokens=24"]


def train(recipe: str, nproc: int, mode: str, out: Path, overrides: list[str]) -> dict:
    args = ["-m", "vlmrl", "train", recipe, f"trainer.output_dir={out}", "trainer.threads=1",
            f"trainer.distributed={mode}", *overrides]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    with (out.parent / f"{out.name}.log").open("w") as log:
        done = subprocess.run([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{recipe} ({mode}, {nproc} processes) failed: see {out.parent / out.name}.log")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["phase"] == "eval"]
    final = evals[-1]
    return {"seconds": seconds, "start": evals[0]["greedy/accuracy"], "accuracy": final["greedy/accuracy"],
            "low": final.get("greedy/accuracy_ci_low"), "high": final.get("greedy/accuracy_ci_high"),
            "rl_seconds": sum(r.get("time/collect_score", 0) + r.get("time/update", 0) for r in rows
                              if r["phase"] == "train")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="*", default=["recipes/agentic_zoom.yaml", "recipes/ppo.yaml"])
    ap.add_argument("--modes", nargs="+", default=["ddp"], choices=["ddp", "fsdp2", "ranks"])
    ap.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="runs/torchrun_parity")
    ap.add_argument("--results", default="torchrun_parity.json")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    recipes = [r for r in a.recipes if "=" not in r]
    overrides = [*a.overrides, *[r for r in a.recipes if "=" in r], *(SMOKE if a.smoke else [])]
    out, results = Path(a.out), {}
    out.mkdir(parents=True, exist_ok=True)
    for recipe in recipes:
        name = Path(recipe).stem
        results[name] = {"one process": train(recipe, 1, "none", out / f"{name}-one", overrides)}
        for mode in a.modes:
            if mode == "ranks":  # one process trains, one generates
                results[name]["torchrun x2 (1 training + 1 rollout rank)"] = train(
                    recipe, 2, "ddp", out / f"{name}-ranks", [*overrides, "rollout.rollout_ranks=1"])
                continue
            results[name][f"torchrun x2 ({mode})"] = train(recipe, 2, mode, out / f"{name}-{mode}", overrides)
        for arm, r in results[name].items():
            print(f"{name} {arm}: {r['accuracy']:.3f} ({r['seconds']:.0f} s)", flush=True)
    print(table(results))
    (ROOT / "benchmarks/results").mkdir(exist_ok=True)
    (ROOT / "benchmarks/results" / a.results).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))


def table(results: dict) -> str:
    lines = ["| recipe | run | after SFT | after RL [95%] | wall s | wall vs one process |", "|---|---|---|---|---|---|"]
    for name, arms in results.items():
        base = arms["one process"]["seconds"]
        for arm, r in arms.items():
            ci = f" [{100 * r['low']:.1f}, {100 * r['high']:.1f}]" if r.get("low") is not None else ""
            lines.append(f"| {name} | {arm} | {100 * r['start']:.1f}% | {100 * r['accuracy']:.1f}%{ci} | "
                         f"{r['seconds']:.0f} | x{r['seconds'] / base:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
