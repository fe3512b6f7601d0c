"""Real handwriting: sum the digits in a row of scikit-learn's 8x8 handwritten digits (or, with ``style: printed``,
of digits printed in a font).

The 1,797 digits of ``sklearn.datasets.load_digits`` (bundled with scikit-learn, no download) are split once by a
fixed permutation into a train pool (80%) and a held-out pool (20%). Train samples use only the train pool; test and
ood samples only the held-out pool, so test handwriting is never seen in training. Each digit is upscaled 3x to
24 px (nearest neighbour), drawn dark on light, and placed in its own 28-px column of a 56-px-high canvas with a
little random jitter; the canvas is 28 px per digit wide (56 px at least). Printed digits are drawn in the font
Pillow bundles (Aileron, 24 px, bold) with the same jitter: one glyph per digit, so that the reading can be made
easy (the embedded model still reads them only partly after 1,500 SFT steps) and the sum of many digits, step by
step, is the task's hard part.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

import numpy as np
from PIL import Image

from .sample import DataError, Sample, check_split, option_tag, resolve_options, task_rng

PROBLEM = "What is the sum of the digits?"
DIGITS_OPTIONS: dict[str, Any] = {"num_digits": (2, 3), "style": "handwritten"}
STYLES = ("handwritten", "printed")
FONT_PX = 24
STROKE_PX = 1  # drawn bold: strokes as wide as handwriting's, which the embedded vision tower reads
TRAIN_FRACTION = 0.8
PARTITION_SEED = 20240917  # fixed forever: changing it would move digits between the train and held-out pools
CELL_PX = 28
DIGIT_PX = 24
CANVAS_HEIGHT = 56


@lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [1797, 8, 8] in 0..16, labels [1797]) from scikit-learn, loaded once per process."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images.astype(np.uint8), digits.target.astype(np.int64)


@lru_cache(maxsize=1)
def digit_pools() -> dict[str, np.ndarray]:
    """Indices into ``load_digits`` for the ``"train"`` pool and the ``"held_out"`` pool (disjoint, fixed)."""
    images, _ = _load_digits()
    order = np.random.default_rng(PARTITION_SEED).permutation(len(images))
    cut = int(round(TRAIN_FRACTION * len(images)))
    return {"train": np.sort(order[:cut]), "held_out": np.sort(order[cut:])}


def digit_image(index: int) -> Image.Image:
    """Digit ``index`` as a 24x24 grayscale image, dark ink on a white background."""
    images, _ = _load_digits()
    ink = images[index].astype(np.float32) / 16.0
    pixels = np.round(255.0 * (1.0 - ink)).astype(np.uint8)
    return Image.fromarray(pixels).resize((DIGIT_PX, DIGIT_PX), Image.Resampling.NEAREST)


def render_digits(indices: list[int], rng: random.Random) -> Image.Image:
    """The digits side by side, one 28-px column each, jittered within their column; RGB, sides multiples of 28."""
    width = max(2, len(indices)) * CELL_PX
    canvas = Image.new("L", (width, CANVAS_HEIGHT), 255)
    for column, index in enumerate(indices):
        dx = rng.randint(0, CELL_PX - DIGIT_PX)
        dy = rng.randint(0, CANVAS_HEIGHT - DIGIT_PX)
        canvas.paste(digit_image(index), (column * CELL_PX + dx, dy))
    return canvas.convert("RGB")


@lru_cache(maxsize=1)
def _font():
    from PIL import ImageFont

    return ImageFont.load_default(size=FONT_PX)


def render_printed(digits: list[int], rng: random.Random) -> Image.Image:
    """The digits printed side by side in Pillow's bundled font, one 28-px column each, jittered within it; RGB."""
    from PIL import ImageDraw

    width = max(2, len(digits)) * CELL_PX
    canvas = Image.new("L", (width, CANVAS_HEIGHT), 255)
    draw = ImageDraw.Draw(canvas)
    for column, digit in enumerate(digits):
        left, top, right, bottom = draw.textbbox((0, 0), str(digit), font=_font(), stroke_width=STROKE_PX)
        dx = rng.randint(0, CELL_PX - (right - left)) - left
        dy = rng.randint(0, CANVAS_HEIGHT - (bottom - top)) - top
        draw.text((column * CELL_PX + dx, dy), str(digit), font=_font(), fill=0, stroke_width=STROKE_PX,
                  stroke_fill=0)
    return canvas.convert("RGB")


def _digit_counts(num_digits: Any) -> tuple[int, int]:
    if isinstance(num_digits, int) and not isinstance(num_digits, bool):
        num_digits = (num_digits, num_digits)
    if not (
        isinstance(num_digits, tuple)
        and len(num_digits) == 2
        and all(isinstance(v, int) for v in num_digits)
        and 1 <= num_digits[0] <= num_digits[1] <= 8
    ):
        raise DataError(
            f"task 'digits_sum': option 'num_digits' must be an int or [min, max] within 1..8, got {num_digits!r}"
        )
    return num_digits[0], num_digits[1]


def digits_sum(n: int, split: str, seed: int = 0, **options: Any) -> list[Sample]:
    """ "What is the sum of the digits?" over 2-3 handwritten digits -> ``"13"`` (answer_type number).

    Options: ``num_digits`` (int or [min, max], default [2, 3]); ``style`` ("handwritten", default, or "printed":
    the digits in a font: one glyph per digit, no handwriting to learn). ood uses one digit more than the
    maximum (4 by default), handwritten ones from the held-out pool. Samples carry ``digits`` (labels), ``width``
    and ``height``, handwritten ones ``digit_indices`` (into load_digits).
    """
    task = "digits_sum"
    check_split(task, split)
    opts = resolve_options(task, options, DIGITS_OPTIONS)
    low, high = _digit_counts(opts["num_digits"])
    if opts["style"] not in STYLES:
        raise DataError(f"task 'digits_sum': option 'style' must be one of {list(STYLES)}, got {opts['style']!r}")
    printed = opts["style"] == "printed"
    if split == "ood":
        low = high = high + 1
    tag = option_tag(options, DIGITS_OPTIONS)
    _, labels = _load_digits()
    pool = digit_pools()["train" if split == "train" else "held_out"]
    samples = []
    for index in range(n):
        rng = task_rng(task, split, seed, tag, index)
        if printed:
            digits, indices = [rng.randrange(10) for _ in range(rng.randint(low, high))], None
            image = render_printed(digits, rng)
        else:
            indices = [int(pool[rng.randrange(len(pool))]) for _ in range(rng.randint(low, high))]
            digits = [int(labels[i]) for i in indices]
            image = render_digits(indices, rng)
        samples.append(
            {
                "id": f"{task}{tag}/{split}/{index}",
                "images": [image],
                "problem": PROBLEM,
                "solution": str(sum(digits)),
                "answer_type": "number",
                "task": task,
                "width": image.width,
                "height": image.height,
                "digits": digits,
                "difficulty": len(digits),  # digits to add: curriculum.order=easy_to_hard sorts by it
                **({} if printed else {"digit_indices": indices}),
            }
        )
    return samples
