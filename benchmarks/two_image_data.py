"""A user's own file with two images per row that mixes word answers and box answers, written the way a user
writes one: PNG files and JSONL rows `{"images": [a, b], "problem", "solution", "answer_type", "task", "width",
"height"}`, each question about one of the two images.

    python benchmarks/two_image_data.py --out runs/two_image_data

- `two_color` (word): "What color is the circle in the second image?" -> "red"
- `two_box` (box): "Give the bounding box of the red circle in the first image." -> "[x1, y1, x2, y2]" in that
  image's pixels (`width`/`height` are its size)

The scenes come from the built-in shape tasks (shapes_color, shapes_box); the other image of a row is a scene of
the same kind drawn for another row, so a model must read which image the question names. Writes OUT/train.jsonl
(RL prompts, --train per task), OUT/sft.jsonl (labelled warm-start rows, --sft per task, another data seed) and
OUT/test.jsonl (held-out, --test per task, the test split), images under OUT/images/. Then (BENCHMARKS.md, "A user
file with two images per row, word and box answers"):

    vlmrl train data.train='{path: OUT/train.jsonl}' data.sft='{path: OUT/sft.jsonl}' \\
        data.eval='{path: OUT/test.jsonl}' ...
"""

from __future__ import annotations

import random
from pathlib import Path

from mixed_answers_data import build_file

from vlmrl.data.shapes import shapes_box, shapes_color

TASKS = {"two_color": shapes_color, "two_box": shapes_box}
ORDINAL = ("first", "second")


def rows(task: str, n: int, split: str, seed: int, out: Path, part: str) -> list[dict]:
    """n rows of `task`: each a built-in scene and the scene of another row, in a random order, the question naming
    the scene's place; images written under OUT/images/PART-TASK/."""
    samples = TASKS[task](2 * n, split, seed=seed)
    folder = out / "images" / f"{part}-{task}"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{task}/{split}/{seed}")
    out_rows = []
    for i in range(n):
        target, other = samples[i], samples[n + i]
        place = rng.randrange(2)
        pair = [other["images"][0], other["images"][0]]
        pair[place] = target["images"][0]
        names = []
        for j, image in enumerate(pair):
            name = f"{i}-{j}.png"
            image.save(folder / name)
            names.append(f"images/{folder.name}/{name}")
        question = target["problem"].rstrip(".?")
        mark = "?" if target["problem"].endswith("?") else "."
        out_rows.append({"images": names, "problem": f"{question} in the {ORDINAL[place]} image{mark}",
                         "solution": target["solution"], "answer_type": target["answer_type"], "task": task,
                         "width": target["width"], "height": target["height"]})
    return out_rows


def main() -> None:
    build_file(__doc__, tuple(TASKS), rows, "runs/two_image_data", 300)


if __name__ == "__main__":
    main()
