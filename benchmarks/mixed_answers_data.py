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


def build_file(doc: str, tasks, rows_of, out_default: str, sft_default: int) -> None:
    """The command line of a user-file builder: OUT/train.jsonl, sft.jsonl and test.jsonl, each the rows
    `rows_of(task, n, split, seed, out, part)` gives for every task (RL prompts data seed 0, labelled rows seed 1,
    held-out rows the test split)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=out_default)
    p.add_argument("--train", type=int, default=1000, help="RL prompts per task")
    p.add_argument("--sft", type=int, default=sft_default, help="labelled warm-start rows per task")
    p.add_argument("--test", type=int, default=200, help="held-out rows per task")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = {"train": ("train", args.train, 0), "sft": ("train", args.sft, 1), "test": ("test", args.test, 0)}
    for part, (split, n, seed) in parts.items():
        rows = [r for task in tasks for r in rows_of(task, n, split, seed, out, part)]
        with open(out / f"{part}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"{out / f'{part}.jsonl'}: {len(rows)} rows ({', '.join(tasks)}; split {split}, data seed {seed})")


def main() -> None:
    build_file(__doc__, TASKS, export, "runs/mixed_data", 100)


if __name__ == "__main__":
    main()
