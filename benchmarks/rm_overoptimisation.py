"""A policy trained against a learned outcome reward alone: held-out accuracy (the gold) first rises, then falls while
the reward model's score (the proxy) keeps rising, and a guard ends the run where that starts.

    python benchmarks/rm_overoptimisation.py --seeds 0 --steps 300 --out runs/rm_overopt

Per seed, all through the commands a user runs:

1. the start: `vlmrl train` SFT-only (trainer.steps=0) on --sft labelled shapes_color scenes ("What color is the
   circle?"), the quickstart recipe otherwise;
2. the outcome RM: `vlmrl rm train data.pairs={task: shapes_color, n: --pairs}` from that start (chosen = the label,
   rejected = another colour; held-out pairwise accuracy with its interval);
3. arms, each `vlmrl train` from the start with `rewards=[{name: reward_model, path: RM}, {name: accuracy, weight:
   0.0}]` (the RM alone; accuracy is computed, weighs nothing and is the gold), evaluated every --eval-every steps:
   `unguarded` for --steps steps; `guarded` the same with trainer.stop_on_overoptimisation=true; optionally
   `kl_budget` with trainer.kl_budget=--kl-budget.

Prints each arm's held-out accuracy and RM score at every evaluation, where the over-optimisation watch spoke and
where a guard ended the run, and writes the raw numbers to --results. `vlmrl report RUN` of the unguarded arm plots
both curves (proxy_gold.png).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from prm_digits import vlmrl  # noqa: E402  (one way to run a vlmrl command, logged and timed)
from smoke import TINY_MODEL  # noqa: E402

TASK = "shapes_color"


def evals(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{"step": r["step"], "gold": r["greedy/accuracy"], "gold_low": r["greedy/accuracy_ci_low"],
             "gold_high": r["greedy/accuracy_ci_high"], "proxy": r.get("greedy/reward/reward_model")}
            for r in rows if r["phase"] == "eval"]


def run_seed(seed: int, a, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    data = [f"data.train={{task: {TASK}, n: 2000}}", f"data.sft={{task: {TASK}, n: {a.sft}}}",
            f"data.eval={{task: {TASK}, n: {a.eval}}}", f"trainer.seed={seed}", f"trainer.threads={a.threads}",
            *a.overrides]
    start = out / "start"
    vlmrl("train", *data, "trainer.steps=0", f"trainer.output_dir={start}", log=out / "start.log")
    rm = out / "rm"
    vlmrl("rm", "train", f"data.pairs={{task: {TASK}, n: {a.pairs}}}", f"model.name_or_path={start}/checkpoint-0",
          f"trainer.steps={a.rm_steps}", f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.threads={a.threads}",
          f"trainer.output_dir={rm}", log=out / "rm.log")
    info = json.loads(next(rm.glob("checkpoint-*/reward_model.json")).read_text())
    arms = {"unguarded": [], "guarded": ["trainer.stop_on_overoptimisation=true"],
            "kl_budget": [f"trainer.kl_budget={a.kl_budget}"]}
    result = {"seed": seed, "rm_heldout": info["trained"]["heldout"], "arms": {}}
    for arm in a.arms:
        run = out / arm
        vlmrl("train", *data, f"model.name_or_path={start}/checkpoint-0", "sft.steps=0", f"trainer.steps={a.steps}",
              f"trainer.eval_every={a.eval_every}", "trainer.log_rollouts_every=0",
              f"rewards=[{{name: reward_model, path: {rm}}}, {{name: accuracy, weight: 0.0}}]",
              *arms[arm], f"trainer.output_dir={run}", log=out / f"{arm}.log")
        log = (out / f"{arm}.log").read_text()
        result["arms"][arm] = {"evals": evals(run), "warned": "learning to please the reward" in log,
                               "guard_stop": next((line.split("stopped by a guard: ", 1)[1][:160]
                                                   for line in log.splitlines() if "stopped by a guard: " in line),
                                                  None),
                               "steps_run": max((json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text()
                                                 .splitlines() if json.loads(x)["phase"] == "train"), default=0)}
    return result


def table(result: dict) -> str:
    h = result["rm_heldout"]
    lines = [f"seed {result['seed']}: RM held-out pairwise accuracy {100 * h['pairwise_accuracy']:.1f}% "
             f"[{100 * h['ci_low']:.1f}, {100 * h['ci_high']:.1f}] over {h['pairs']:.0f} pairs", ""]
    for arm, r in result["arms"].items():
        lines += [f"{arm}: {r['steps_run']} RL steps" + (f"; stopped by a guard: {r['guard_stop']}"
                                                        if r["guard_stop"] else "")
                  + ("; the over-optimisation watch spoke" if r["warned"] else ""),
                  "", "| step | held-out accuracy (gold) [95%] | held-out RM score (proxy) |", "|---|---|---|"]
        for e in r["evals"]:
            proxy = "n/a" if e["proxy"] is None else f"{e['proxy']:.3f}"
            lines.append(f"| {e['step']} | {100 * e['gold']:.1f} [{100 * e['gold_low']:.1f}, "
                         f"{100 * e['gold_high']:.1f}] | {proxy} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default="runs/rm_overopt")
    p.add_argument("--results", default="benchmarks/results/rm_overoptimisation.json")
    p.add_argument("--sft", type=int, default=100, help="labelled scenes for the start's SFT")
    p.add_argument("--eval", type=int, default=300, help="held-out scenes")
    p.add_argument("--pairs", type=int, default=2000, help="RM preference pairs from the task's labels")
    p.add_argument("--rm-steps", type=int, default=400)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--kl-budget", type=float, default=0.05)
    p.add_argument("--arms", nargs="+", default=["unguarded", "guarded"],
                   choices=["unguarded", "guarded", "kl_budget"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="seconds: a very small model and a few of everything")
    p.add_argument("overrides", nargs="*", help="more `vlmrl train` overrides")
    a = p.parse_args()
    if a.smoke:
        a.seeds, a.overrides = a.seeds[:1], [*TINY_MODEL, "sft.steps=2", "rollout.prompts_per_step=2",
                                             "rollout.group_size=2", *a.overrides]
        a.sft, a.eval, a.pairs, a.rm_steps, a.steps, a.eval_every = 8, 8, 16, 2, 4, 2
        a.arms = ["unguarded", "kl_budget"]
        a.kl_budget = 1e-9
    results = []
    for seed in a.seeds:
        print(f"seed {seed}", flush=True)
        results.append(run_seed(seed, a, Path(a.out) / f"seed{seed}"))
        print(table(results[-1]), flush=True)
    if a.results:
        Path(a.results).write_text(json.dumps({"args": vars(a), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
