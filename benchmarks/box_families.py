"""Which embedded architecture learns where things are: SFT alone on one-object box scenes, the embedded Qwen2-VL
against the embedded Qwen3-VL of the same size (the quickstart's: 2 decoder layers, 1 vision block, 96 wide).

    python benchmarks/box_families.py                          # 3,000 labelled rows, 3,000 SFT steps: ~7 min
    python benchmarks/box_families.py --rows 200 --steps 20    # a smoke run

The rows are built-in shapes_box scenes with exactly one object ("Give the bounding box of the red circle." ->
"[42, 6, 56, 20]"), written as a user's JSONL file; held out: 200 scenes of the test split. Each family trains with
`vlmrl train model.tiny.family=F ... trainer.steps=0` (SFT only) and is scored greedy at IoU >= 0.5, with its 95%
interval. Qwen2-VL's vision tokens carry no absolute position (2-D rotary acts only on attention weights);
Qwen3-VL's vision tower adds a learned position embedding. Why `model.tiny.family: auto` picks Qwen3-VL for data
with box answers (BENCHMARKS.md, "Box answers: which embedded model localises").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_rows(out: Path, split: str, n: int, seed: int, name: str) -> Path:
    from vlmrl.data.shapes import shapes_box

    (out / "images").mkdir(parents=True, exist_ok=True)
    rows, drawn = [], 0
    while len(rows) < n:
        for s in shapes_box(6 * n, split, seed=seed + drawn):
            if len(s["objects"]) == 1 and len(rows) < n:
                path = f"images/{name}-{len(rows)}.png"
                s["images"][0].save(out / path)
                rows.append({"images": [path], "problem": s["problem"], "solution": s["solution"],
                             "answer_type": "box", "task": "one_box", "width": s["width"], "height": s["height"]})
        drawn += 1
    file = out / f"{name}.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return file


def run(family: str, sft: Path, test: Path, args, out: Path) -> dict:
    run_dir = out / f"run_{family}"
    cmd = [sys.executable, "-m", "vlmrl", "train", f"model.tiny.family={family}", "model.tiny.num_layers=2",
           "model.tiny.vision_depth=1", f"data.sft={{path: {sft}}}", f"data.eval={{path: {test}}}",
           f"data.train={{path: {test}}}", f"sft.steps={args.steps}", "sft.batch_size=16", "sft.lr=1e-3",
           "sft.lr_schedule=cosine", "trainer.steps=0", f"trainer.threads={args.threads}",
           f"trainer.seed={args.seed}", "eval.max_new_tokens=20", "rollout.max_new_tokens=23",
           f"trainer.output_dir={run_dir}", "trainer.tensorboard=false"]
    t0 = time.perf_counter()
    with open(out / f"{family}.log", "w") as f:
        done = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{family}: vlmrl train failed ({done.returncode}); see {out / f'{family}.log'}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if "greedy/accuracy" in r][-1]
    return {"family": family, "greedy": ev["greedy/accuracy"], "low": ev["greedy/accuracy_ci_low"],
            "high": ev["greedy/accuracy_ci_high"], "sampled": ev["sampled/accuracy"],
            "wall_s": round(time.perf_counter() - t0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/box_families")
    p.add_argument("--results", default=None, help="also write the table's numbers here (JSON)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    sft = write_rows(out, "train", args.rows, 1, "sft")
    test = write_rows(out, "test", args.test, 0, "test")
    results = [run(f, sft, test, args, out) for f in ("qwen2_vl", "qwen3_vl")]
    print(f"\none-object boxes, {args.rows} labelled rows, {args.steps} SFT steps, {args.test} held out, seed {args.seed}")
    print("| embedded model | greedy, IoU >= 0.5 [95%] | sampled | wall time |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['family']} | {100 * r['greedy']:.1f} [{100 * r['low']:.1f}, {100 * r['high']:.1f}] | "
              f"{100 * r['sampled']:.1f} | {r['wall_s']} s |")
    if args.results:
        Path(args.results).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
