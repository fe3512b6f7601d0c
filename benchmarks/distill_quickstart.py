"""On-policy distillation into the quickstart's student against RL with the verifiable reward alone: held-out
accuracy against RL steps and CPU seconds.

    python benchmarks/distill_quickstart.py --teacher runs/quickstart --seeds 0 1 --steps 600 --out runs/distill

Each arm is `vlmrl train` with the quickstart recipe and the same seed, so both start from the same SFT model:
- `rl`: the quickstart's RL (accuracy and length rewards);
- `distill`: the same, plus `distill.teacher=TEACHER` (`--coef`, default 1): every answer token's advantage also gets
  -coef x (log p_student - log p_teacher) (docs/algorithms.md, "On-policy distillation from a teacher");
- `distill_alone`: the teacher alone (every reward at weight 0, so without dynamic sampling and the solved/unsolved
  filters, which need rewards that differ);
- `sft_teacher` (after `rl`): SFT on the teacher's own answers, continued from the same SFT start for the RL arm's
  compute (its RL seconds over its mean SFT step time, in steps): the teacher answers --label-prompts scenes of the
  training split greedily (`vlmrl eval --samples-out`), and its answer blocks become the labels (sequence-level
  distillation; answers without an answer block are dropped and counted).

TEACHER is a run directory or checkpoint of the same embedded model (the same vocabulary): a stronger one, such as
the quickstart trained for its whole 1,500 steps. `--jobs 2` runs two arms at once at 1 thread each. Prints a
markdown table and writes the raw numbers to --results.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quickstart_seeds import code, machine, metrics, timed_run

ROOT = Path(__file__).resolve().parents[1]


def run_arm(arm: str, seed: int, args, out_root: Path) -> dict:
    out = out_root / f"{arm}-seed{seed}"
    extra = [f"distill.teacher={args.teacher}", f"distill.coef={args.coef}"] if arm.startswith("distill") else []
    if arm == "distill_alone":
        extra += ["rewards=[{name: accuracy, weight: 0.0}, {name: length, weight: 0.0}]",
                  "algorithm.dynamic_sampling=false", "curriculum.filter_solved=false",
                  "curriculum.filter_unsolved=false"]
    cmd = [sys.executable, "-m", "vlmrl", "train", f"trainer.seed={seed}", "trainer.threads=1",
           f"trainer.steps={args.steps}", f"trainer.eval_every={args.eval_every}", f"trainer.output_dir={out}",
           *extra, *args.overrides]
    wall, usage = timed_run(cmd, f"{arm}, seed {seed}", out.with_suffix(".stdout"))
    rows = metrics(out)
    evals = [r for r in rows if r["phase"] == "eval"]
    train = [r for r in rows if r["phase"] == "train"]
    cpu = usage.ru_utime + usage.ru_stime
    print(f"{arm}, seed {seed}: {100 * evals[0]['greedy/accuracy']:.1f} -> {100 * evals[-1]['greedy/accuracy']:.1f} "
          f"in {wall:.0f} s", flush=True)
    return {"arm": arm, "seed": seed, "run_dir": str(out), "wall_seconds": wall, "cpu_seconds": cpu,
            "rl_seconds": sum(r["time/collect_score"] + r["time/update"] for r in train),
            "curve": [(r["step"], r["greedy/accuracy"], r["greedy/accuracy_ci_low"], r["greedy/accuracy_ci_high"])
                      for r in evals],
            "reverse_kl": [(r["step"], r["distill/reverse_kl"]) for r in train if "distill/reverse_kl" in r][::50]}


CONTROL = """
import sys
from vlmrl.config import load_config
from vlmrl.trainer.control import run_baselines, summary_of_run
run, steps, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = load_config(run + "/config.yaml", [f"control.steps={steps}", "trainer.threads=1", "eval.ood=null",
                                         "data.sft={path: " + labels + "}"])
run_baselines(cfg, summary_of_run(run), "sft")
"""


def teacher_labels(args, out_root: Path) -> Path:
    """The teacher's greedy answers to --label-prompts training scenes, as a labelled JSONL (its answer blocks)."""
    folder, labels = out_root / "teacher-labels", out_root / "teacher-labels.jsonl"
    if labels.exists():
        return labels
    vlmrl = [sys.executable, "-m", "vlmrl"]
    subprocess.run([*vlmrl, "data", "export", "shapes_count", "--n", str(args.label_prompts), "--split", "train",
                    "--seed", "7", "--out", str(folder)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows_file = folder / "shapes_count-train.jsonl"
    answers = folder / "teacher-answers.jsonl"
    subprocess.run([*vlmrl, "eval", args.teacher, "trainer.threads=1", "--data", str(rows_file), "--temperatures",
                    "0", "--samples-out", str(answers)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    said = [json.loads(line) for line in answers.read_text().splitlines()]
    kept, dropped = [], 0
    for row, record in zip(rows, said, strict=True):
        if row["id"] != record["id"]:
            raise RuntimeError(f"{answers}: answers out of order ({record['id']} for {row['id']})")
        block = re.fullmatch(r"\s*<answer>(.*?)</answer>\s*", record["answers"][0]["text"], re.S)
        if block is None:
            dropped += 1
            continue
        kept.append({**row, "image": str(folder / row["image"]), "solution": block.group(1)})
    if not kept:
        raise SystemExit(f"{answers}: the teacher wrote no answer block in its {len(rows)} answers; is {args.teacher} "
                         "a trained checkpoint of the quickstart's model?")
    labels.write_text("".join(json.dumps(r) + "\n" for r in kept))
    right = sum(r["answers"][0]["correct"] for r in said)
    print(f"teacher labels: {len(kept)} of {len(rows)} answers kept ({dropped} without an answer block), "
          f"{100 * right / len(rows):.1f}% of them right", flush=True)
    return labels


def sft_teacher_arm(rl: dict, labels: Path) -> dict:
    run = Path(rl["run_dir"])
    sft = [r["time/update"] for r in metrics(run) if r["phase"] == "sft" and "time/update" in r]
    steps = max(1, round(rl["rl_seconds"] / (sum(sft) / len(sft))))
    subprocess.run([sys.executable, "-c", CONTROL, str(run), str(steps), str(labels)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    arms = json.loads((run / "baselines.json").read_text())["in_distribution"]
    start, final = arms["start"], arms["control_sft"]
    print(f"sft_teacher, seed {rl['seed']}: {steps} SFT steps -> {100 * final['greedy/accuracy']:.1f}", flush=True)
    curve = [(0, start["greedy/accuracy"], start["greedy/accuracy_ci_low"], start["greedy/accuracy_ci_high"])]
    curve += [(None, None, None, None)] * (len(rl["curve"]) - 2)
    curve.append((steps, final["greedy/accuracy"], final["greedy/accuracy_ci_low"], final["greedy/accuracy_ci_high"]))
    return {"arm": "sft_teacher", "seed": rl["seed"], "run_dir": str(run / "control-sft"), "sft_steps": steps,
            "rl_seconds": rl["rl_seconds"], "wall_seconds": None, "curve": curve}


def table(results: list[dict]) -> str:
    steps = [s for s, *_ in results[0]["curve"]]
    head = "| arm | seed | " + " | ".join(f"step {s}" for s in steps) + " | RL seconds | wall |"
    lines = [head, "|" + "---|" * (len(steps) + 4)]
    for r in results:
        cells = ["" if a is None else f"{100 * a:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]" for _, a, lo, hi in r["curve"]]
        wall = "" if r["wall_seconds"] is None else f"{r['wall_seconds']:.0f} s"
        lines.append(f"| {r['arm']} | {r['seed']} | " + " | ".join(cells) + f" | {r['rl_seconds']:.0f} s | {wall} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", required=True, help="a run directory or checkpoint of the same embedded model")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--coef", type=float, default=1.0)
    p.add_argument("--arms", nargs="+", default=["rl", "distill", "distill_alone", "sft_teacher"],
                   choices=["rl", "distill", "distill_alone", "sft_teacher"])
    p.add_argument("--label-prompts", type=int, default=2000, help="training scenes the teacher labels (sft_teacher)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", default="runs/distill")
    p.add_argument("--results", default=str(ROOT / "benchmarks/results/distill_quickstart.json"))
    p.add_argument("overrides", nargs="*", help="KEY=VALUE for every run")
    args = p.parse_args()
    out = Path(args.out)
    runs = [arm for arm in args.arms if arm != "sft_teacher"]
    if "sft_teacher" in args.arms and "rl" not in runs:
        p.error("sft_teacher continues the rl arm's SFT start: keep rl in --arms")
    pairs = [(arm, seed) for seed in args.seeds for arm in runs]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda pair: run_arm(*pair, args, out), pairs))
        if "sft_teacher" in args.arms:
            labels = teacher_labels(args, out)
            rl = [r for r in results if r["arm"] == "rl"]
            results += list(pool.map(lambda r: sft_teacher_arm(r, labels), rl))
    print(table(results))
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps({"machine": machine(), "code": code(), "teacher": args.teacher,
                                              "coef": args.coef, "runs": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
