"""A user's own file that mixes answer types: numbers (shapes_count), words (shapes_color) and boxes (shapes_box),
built the way a user would build it, with `vlmrl data export` per task and the JSONL files concatenated.

    python benchmarks/mixed_answers_data.py --out runs/mixed_data

writes OUT/train.jsonl (RL prompts, --train per task), OUT/sft.jsonl (labelled warm-start rows, --sft per task,
another data seed) and OUT/test.jsonl (held-out, --test per task, the test split), with every image under OUT/.
Then (BENCHMARKS.md, "A user file mixing numbers, words and boxes"):

    vlmrl train data.train='{path: OUT/train.jsonl}' data.sft='{path: OUT/sft.jsonl}' \\
        data.eval='{path: OUT/test.jsonl}' ...
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from vlmrl.cli import main as vlmrl

TASKS = ("shapes_count", "shapes_color", "shapes_box")


def export(task: str, n: int, split: str, seed: int, out: Path, part: str) -> list[dict]:
    """`vlmrl data export` of one task into OUT/PART-TASK/; its rows with image paths relative to OUT."""
    folder = out / f"{part}-{task}"
    with tempfile.TemporaryFile("w") as quiet:  # the CLI's "wrote N rows" line is not this script's output
        import contextlib

        with contextlib.redirect_stdout(quiet):
            vlmrl(["data", "export", task, "--n", str(n), "--split", split, "--seed", str(seed),
                   "--out", str(folder)])
    rows = [json.loads(line) for line in (folder / f"{task}-{split}.jsonl").read_text().splitlines()]
    for row in rows:
        row["image"] = f"{folder.name}/{row['image']}"
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/mixed_data")
    p.add_argument("--train", type=int, default=1000, help="RL prompts per task")
    p.add_argument("--sft", type=int, default=100, help="labelled warm-start rows per task")
    p.add_argument("--test", type=int, default=200, help="held-out rows per task")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = {"train": ("train", args.train, 0), "sft": ("train", args.sft, 1), "test": ("test", args.test, 0)}
    for part, (split, n, seed) in parts.items():
        rows = [r for task in TASKS for r in export(task, n, split, seed, out, part)]
        with open(out / f"{part}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{out / f'{part}.jsonl'}: {len(rows)} rows ({', '.join(TASKS)}; split {split}, data seed {seed})")


if __name__ == "__main__":
    main()
