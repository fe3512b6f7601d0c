"""The sample contract shared by every data source, and small helpers that enforce it.

A *sample* is a plain ``dict`` so that reward functions can receive its columns as keyword arguments (the TRL
contract) and user columns pass through untouched. Every sample has at least:

- ``id``: str, unique within a dataset (``"shapes_count/train/17"``, ``"data/train.jsonl:17"``)
- ``images``: a sequence of RGB ``PIL.Image.Image`` (empty for text-only rows): a ``list`` for the built-in tasks, a
  ``LazyImages`` for user files, which decodes an image when it is indexed or iterated (``len()`` does not decode;
  see ``vlmrl.data.images``). Use it as a read-only sequence; ``list(sample["images"])`` gives a plain list
- ``problem``: the question shown to the model, without answer-format instructions (the trainer adds those)
- ``solution``: the ground truth as text: ``"3"``, ``"red"`` or a box ``"[x1, y1, x2, y2]"`` in absolute pixels
- ``answer_type``: ``"number"``, ``"text"``, ``"box"``, ``"math"`` (an expression such as ``\\frac{1}{2}``, ``x+1`` or
  ``(1, 2]``, checked for equivalence by math-verify) or ``"choice"`` (a multiple-choice letter)
- ``task``: the task name, or the file stem for user data
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vlmrl.errors import DataError  # noqa: F401  (re-exported: vlmrl.data.DataError)

from .images import LazyImages

Sample = dict[str, Any]
"""One dataset row; see the module docstring for the required keys."""

ANSWER_TYPES: tuple[str, ...] = ("number", "text", "box", "math", "choice")
REQUIRED_KEYS: tuple[str, ...] = ("id", "images", "problem", "solution", "answer_type", "task")
SPLITS: tuple[str, ...] = ("train", "test", "ood")

_MATH_HINT = re.compile(r"\\[A-Za-z{%]|\^|sqrt\(|\d\s*%")  # a LaTeX command or escape (`\{`, `\%`), a power, a percentage
_INTERVAL = re.compile(r"\s*[\[(][^,()\[\]]*,[^,()\[\]]*[\])]\s*")  # (1, 2], [0, 1)
_EXPRESSION = re.compile(r"[0-9A-Za-z\s+\-*/().]+")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


@dataclass
class LoadReport:
    """What happened while loading one file: nothing is skipped silently.

    ``problems`` holds one message per skipped row, the same text that ``on_error="raise"`` would have raised.
    """

    path: str
    loaded: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)


def parse_number(text: str) -> float | None:
    """The value of ``text`` if it is exactly one finite decimal number (surrounding spaces allowed), else None."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def parse_box(text: str) -> list[float] | None:
    """The four numbers of a box written ``[x1, y1, x2, y2]`` (brackets, parentheses or none; commas or spaces).

    Returns None unless the text is exactly four numbers, so ``"3"`` or ``"red"`` are not boxes.
    """
    text = text.strip()
    if len(text) >= 2 and (text[0], text[-1]) in {("[", "]"), ("(", ")")}:
        text = text[1:-1]
    parts = [p for p in re.split(r"[,\s]+", text) if p]
    if len(parts) != 4:
        return None
    values = [parse_number(p) for p in parts]
    if any(v is None for v in values):
        return None
    return [float(v) for v in values if v is not None]


def infer_answer_type(solution: str) -> str:
    """``"box"`` if the solution parses as four numbers, ``"number"`` if it parses as one, ``"math"`` if it is an
    expression (a LaTeX command, ``^``, a percentage, an interval, or digits with operators such as ``x+1`` or
    ``2*pi``), else ``"text"``. Text stays text: ``"ab"`` is not the product a*b, ``"3 apples"`` is not math."""
    if parse_box(solution) is not None:
        return "box"
    if parse_number(solution) is not None:
        return "number"
    digits = re.search(r"\d", solution)
    expression = _EXPRESSION.fullmatch(solution) and digits and re.search(r"[+\-*/]", solution)
    if _MATH_HINT.search(solution) or expression or (digits and _INTERVAL.fullmatch(solution)):
        return "math"
    return "text"


def format_box(box: Sequence[float]) -> str:
    """Write a box the one way solutions spell it: ``"[x1, y1, x2, y2]"``; integral values without a decimal point."""
    if len(box) != 4:
        raise DataError(f"a box needs 4 numbers [x1, y1, x2, y2], got {list(box)!r}")
    return "[" + ", ".join(format_number(v) for v in box) + "]"


def format_number(value: float) -> str:
    """``3`` for integral values (also ``3.0``), otherwise Python's shortest float repr."""
    if isinstance(value, int):
        return str(value)  # exact, also beyond float's range
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def is_held_out(key: str, fraction: float = 0.2) -> bool:
    """Whether a content key belongs to the held-out (test/ood) side of the fixed train/held-out partition.

    The partition is a hash of the key, independent of seed, n and process, so a synthetic train set and a test set
    can never share an item: generators draw candidates and keep only those on their split's side.
    """
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def check_sample(sample: Sample) -> None:
    """Raise DataError naming the sample's id if it breaks the sample contract; used by tests and loaders."""
    where = f"sample {sample.get('id', '?')!r}"
    missing = [k for k in REQUIRED_KEYS if k not in sample]
    if missing:
        raise DataError(f"{where}: missing keys {missing}; every sample needs {list(REQUIRED_KEYS)}")
    for key in ("id", "problem", "solution", "task"):
        if not isinstance(sample[key], str):
            raise DataError(f"{where}: {key!r} must be a str, got {type(sample[key]).__name__}")
    if sample["answer_type"] not in ANSWER_TYPES:
        raise DataError(f"{where}: answer_type {sample['answer_type']!r} is not one of {list(ANSWER_TYPES)}")
    images = sample["images"]
    if not isinstance(images, (list, LazyImages)):
        raise DataError(f"{where}: 'images' must be a list of PIL images (or a LazyImages)")
    images = list(images)  # a LazyImages decodes here: DataError naming its file and line if one does not
    if not all(isinstance(im, Image.Image) for im in images):
        raise DataError(f"{where}: 'images' must be a list of PIL images")
    for image in images:
        if image.mode != "RGB":
            raise DataError(f"{where}: images must be RGB, got mode {image.mode!r}")


# --- helpers shared by the synthetic tasks -------------------------------------------------------------------------


def check_split(task: str, split: str) -> None:
    """Raise DataError unless ``split`` is one of SPLITS."""
    if split not in SPLITS:
        raise DataError(f"task {task!r}: unknown split {split!r}; use one of {list(SPLITS)}")


def _normalise(value: Any) -> Any:
    """Lists (from YAML/JSON) and tuples compare equal: turn every list into a tuple, recursively."""
    if isinstance(value, (list, tuple)):
        return tuple(_normalise(v) for v in value)
    return value


def resolve_options(task: str, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults overridden by ``given``; an unknown option name is a DataError listing the allowed ones."""
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise DataError(f"task {task!r}: unknown option {unknown[0]!r}; allowed options: {sorted(defaults)}")
    return {name: _normalise(given.get(name, default)) for name, default in defaults.items()}


def option_tag(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """``""`` when every option is at its default, else ``"[k=v,...]"`` for the others (sorted by name).

    Part of sample ids and of the RNG stream name, so two specs of one task with different options give different
    ids and different samples.
    """
    changed = {k: _normalise(v) for k, v in given.items() if _normalise(v) != _normalise(defaults.get(k))}
    if not changed:
        return ""
    parts = [
        f"{k}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}" for k, v in sorted(changed.items())
    ]
    return "[" + ",".join(parts) + "]"


def task_rng(task: str, split: str, seed: int, tag: str, index: int) -> random.Random:
    """A private RNG for sample ``index`` of a synthetic task, never the global one.

    Seeded by a string (hashed with SHA-512 by ``random``, independent of PYTHONHASHSEED), so sample i depends only on
    (task, options, split, seed, i): a dataset of n samples is a prefix of one of n + 1 samples.
    """
    return random.Random(f"vlmrl|{task}{tag}|{split}|{seed}|{index}")
