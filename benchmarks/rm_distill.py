"""Reward-model distillation: what a teacher RM's preferences are worth to a student with few labels.

    python benchmarks/rm_distill.py --seeds 0 1 --out runs/rm_distill

Per seed, through `vlmrl train` / `vlmrl rm train` as a user runs them:

1. the start: `vlmrl train` SFT-only on --sft labelled shapes_color scenes (as benchmarks/rm_overoptimisation.py);
2. the teacher: an outcome RM on --teacher-pairs labelled pairs (chosen = the label, rejected = another colour);
3. students from the same start, equal steps, scored on the same held-out pairs (their gold labels):
   `labels_few`: Bradley-Terry on --few labelled pairs; `distill`: the KL to the teacher's preference on --pairs
   pairs whose labels it never reads (distill.coef=1); `mixed`: both on --few labelled pairs (coef 0.5);
   `labels_all`: Bradley-Terry on the --pairs labelled pairs (what the labels would give).

Prints the held-out pairwise accuracy of each with its 95% interval and its agreement with the teacher; writes every
number to --results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from prm_digits import vlmrl  # noqa: E402
from smoke import TINY_MODEL  # noqa: E402

TASK = "shapes_color"


def test_pairs(n: int, seed: int) -> list[dict]:
    """Held-out pairs, the same for every RM: test-split scenes (never trained on), the label over another colour."""
    from vlmrl.data import make_task
    from vlmrl.trainer.dpo import synthetic_preferences

    return synthetic_preferences(make_task(TASK, n, "test", seed=seed), "<answer>{solution}</answer>", seed)


def held_out(run: Path, pairs: list[dict], teacher=None) -> dict:
    """Pairwise accuracy of the RM in `run` on `pairs` (with its interval); with `teacher` (its margins on the same
    pairs, scored once per seed), how often the RM ranks a pair as the teacher does."""
    from vlmrl.trainer.rm import evaluate_pairs
    from vlmrl.trainer.rm_teacher import load_teacher

    return evaluate_pairs(load_teacher(str(run)), pairs, 32, teacher)


def run_seed(seed: int, a, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    start = out / "start"
    tiny = TINY_MODEL if a.smoke else []
    vlmrl("train", *tiny, f"data.sft={{task: {TASK}, n: {a.sft}}}", f"data.eval={{task: {TASK}, n: 8}}",
          f"data.train={{task: {TASK}, n: 8}}", "trainer.steps=0", f"trainer.seed={seed}", f"trainer.threads={a.threads}",
          f"trainer.output_dir={start}", log=out / "start.log")
    common = [f"model.name_or_path={start}/checkpoint-0", f"trainer.steps={a.rm_steps}", f"trainer.seed={seed}",
              f"data.seed={seed}", f"trainer.threads={a.threads}", "data.heldout=0"]
    pairs = test_pairs(a.eval, seed)  # every RM is scored on these (the train split's pairs are all for training)
    teacher = out / "teacher"
    vlmrl("rm", "train", f"data.pairs={{task: {TASK}, n: {a.teacher_pairs}}}", *common,
          f"trainer.output_dir={teacher}", log=out / "teacher.log")
    arms = {"labels_few": [f"data.pairs={{task: {TASK}, n: {a.few}}}"],
            "distill": [f"data.pairs={{task: {TASK}, n: {a.pairs}}}", f"distill.teacher={teacher}",
                        "distill.coef=1.0"],
            "mixed": [f"data.pairs={{task: {TASK}, n: {a.few}}}", f"distill.teacher={teacher}", "distill.coef=0.5"],
            "labels_all": [f"data.pairs={{task: {TASK}, n: {a.pairs}}}"]}
    from vlmrl.trainer.rm_teacher import load_teacher, teacher_margins

    taught = teacher_margins(load_teacher(str(teacher)), pairs, 32)
    result = {"seed": seed, "teacher": held_out(teacher, pairs), "arms": {}}
    for arm in a.arms:
        run = out / arm
        vlmrl("rm", "train", *arms[arm], *common, f"trainer.output_dir={run}", log=out / f"{arm}.log")
        result["arms"][arm] = held_out(run, pairs, taught)
    return result


def table(results: list[dict]) -> str:
    lines = ["| seed | RM | pairs it trains on | held-out pairwise accuracy [95%] | agrees with the teacher |",
             "|---|---|---|---|---|"]
    for r in results:
        t = r["teacher"]
        lines.append(f"| {r['seed']} | teacher | labels | {100 * t['pairwise_accuracy']:.1f} [{100 * t['ci_low']:.1f}, "
                     f"{100 * t['ci_high']:.1f}] over {t['pairs']:.0f} | - |")
        for arm, h in r["arms"].items():
            agree = f"{100 * h['teacher_agreement']:.1f}%" if "teacher_agreement" in h else "-"
            lines.append(f"| {r['seed']} | {arm} | {ARM_PAIRS[arm]} | {100 * h['pairwise_accuracy']:.1f} "
                         f"[{100 * h['ci_low']:.1f}, {100 * h['ci_high']:.1f}] over {h['pairs']:.0f} | {agree} |")
    return "\n".join(lines)


ARM_PAIRS = {"labels_few": "few, labelled", "distill": "many, the teacher's preference", "mixed":
             "few: labels + teacher", "labels_all": "many, labelled"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default="runs/rm_distill")
    p.add_argument("--results", default="benchmarks/results/rm_distill.json")
    p.add_argument("--sft", type=int, default=100, help="labelled scenes for the start's SFT")
    p.add_argument("--teacher-pairs", type=int, default=2000)
    p.add_argument("--pairs", type=int, default=1000, help="pairs the distilled student (and labels_all) see")
    p.add_argument("--few", type=int, default=100, help="labelled pairs of the few-label students")
    p.add_argument("--rm-steps", type=int, default=300)
    p.add_argument("--eval", type=int, default=400, help="held-out pairs (test-split scenes), the same for every RM")
    p.add_argument("--arms", nargs="+", default=list(ARM_PAIRS), choices=list(ARM_PAIRS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="seconds: a very small model and a few of everything")
    a = p.parse_args()
    if a.smoke:
        a.sft, a.teacher_pairs, a.pairs, a.few, a.rm_steps, a.eval = 8, 20, 20, 10, 2, 8
    results = []
    for seed in a.seeds:
        results.append(run_seed(seed, a, Path(a.out) / f"seed{seed}"))
        Path(a.results).parent.mkdir(parents=True, exist_ok=True)
        Path(a.results).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
