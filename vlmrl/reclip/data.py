"""ReCLIP data: image-caption items from a spec (built-in captioned scenes or a user file), and zero-shot sets.

A spec is what a recipe holds under `data.train` / `data.eval`:

    {task: reclip_scenes, n: 2000, side: 112, max_count: 3, single_fraction: 0.25}
    {path: data/captions.jsonl, caption_field: caption, on_error: skip, image_root: ..., n: ...}
    # or a list of such specs, concatenated

User rows are read by `vlmrl.data.load_file` (JSONL, JSON, parquet, `datasets` folders), with `caption_field` as the
one required field: `{"image": "a.png", "caption": "a dog on a sofa"}`, or Visual-RFT rows with
`caption_field: solution`. Each row needs exactly one image.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from PIL import Image

from vlmrl.data import DataError, LoadReport, load_file
from vlmrl.data.files import ON_ERROR
from vlmrl.data.shapes import DEFAULT_COLORS, PLURAL, SHAPES
from vlmrl.reclip.scenes import CaptionItem, make_scenes

TASK = "reclip_scenes"
TASK_OPTIONS = ("side", "colors", "shapes", "max_count", "single_fraction", "negatives")
FILE_KEYS = ("path", "on_error", "image_root", "n", "caption_field")


def build_items(spec: Any, split: str, seed: int, on_error: str = "raise") -> tuple[list[CaptionItem], LoadReport | None]:
    """Items for one split from a spec (see the module docstring); the reports of the files read, merged."""
    specs = spec if isinstance(spec, list) else [spec]
    if not specs:
        raise DataError("reclip data spec: empty list; give at least one {task: reclip_scenes, n: ...} or {path: ...}")
    items: list[CaptionItem] = []
    reports: list[LoadReport] = []
    for index, one in enumerate(specs):
        where = "reclip data spec" + (f" [{index}]" if isinstance(spec, list) else "")
        part, report = _build_one(one, split, seed, where, on_error)
        items += part
        if report is not None:
            reports.append(report)
    ids = [it.id for it in items]
    if len(set(ids)) != len(ids):
        raise DataError("reclip data spec: two specs give items with the same ids; raise 'n' of one spec instead")
    if not reports:
        return items, None
    merged = LoadReport(", ".join(r.path for r in reports), sum(r.loaded for r in reports),
                        sum(r.skipped for r in reports), [p for r in reports for p in r.problems])
    return items, merged


def _build_one(spec: Any, split: str, seed: int, where: str, default_on_error: str):
    if not isinstance(spec, Mapping) or ("task" in spec) == ("path" in spec):
        raise DataError(f"{where}: expected a mapping with exactly one of 'task' ({TASK}) or 'path' (a data file), "
                        f"got {spec!r}")
    if "task" in spec:
        if spec["task"] != TASK:
            raise DataError(f"{where}: unknown task {spec['task']!r}; the built-in captioned task is {TASK!r}")
        allowed = ("task", "n", "seed") + TASK_OPTIONS
        unknown = [k for k in spec if k not in allowed]
        if unknown:
            raise DataError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {list(allowed)}")
        n = spec.get("n")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise DataError(f"{where}: 'n' must be a non-negative int, got {n!r}")
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items() if k in TASK_OPTIONS}
        return make_scenes(n, split, spec.get("seed", seed), **options), None
    unknown = [k for k in spec if k not in FILE_KEYS]
    if unknown:
        raise DataError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {list(FILE_KEYS)}")
    on_error = spec.get("on_error", default_on_error)
    if on_error not in ON_ERROR:
        raise DataError(f"{where}: on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
    field = spec.get("caption_field", "caption")
    samples, report = load_file(spec["path"], on_error=on_error, image_root=spec.get("image_root"), required=(field,))
    items = []
    for sample in samples:
        problem = _caption_problem(sample, field)
        if problem:
            if on_error == "raise":
                raise DataError(f"{spec['path']}: sample {sample['id']!r}: {problem}")
            report.skipped += 1
            report.loaded -= 1
            report.problems.append(f"{spec['path']}: sample {sample['id']!r}: {problem}")
            continue
        extra = {k: v for k, v in sample.items() if k not in ("id", "images", field)}
        items.append(CaptionItem(sample["id"], sample["images"][0], str(sample[field]).strip(), extra=extra))
    limit = spec.get("n")
    if limit is not None:
        items = items[:limit]
    if not items:
        raise DataError(f"{spec['path']}: no usable image-caption rows")
    return items, report


def _caption_problem(sample: dict, field: str) -> str | None:
    if len(sample["images"]) != 1:
        return f"needs exactly one image, has {len(sample['images'])}"
    if not isinstance(sample[field], (str, int, float)) or not str(sample[field]).strip():
        return f"{field!r} must be a non-empty text"
    return None


# --- zero-shot classification ----------------------------------------------------------------------------------------


@dataclass
class ZeroShotSet:
    """Images with one label each; a class is predicted by the mean text embedding of `templates` over its phrase."""

    name: str
    images: list[Image.Image]
    labels: list[int]
    class_phrases: list[str]


def zero_shot_sets(n: int, seed: int, side: int = 112) -> list[ZeroShotSet]:
    """Colour, shape and count of fresh one-group scenes (new renderings; prompts over class names, never captions):
    "red shapes" / "circles" / "two objects"."""
    items = make_scenes(n, "train", seed + 7919, side=side, single_fraction=1.0, negatives=False)
    groups = [it.description.groups[0] for it in items]
    images = [it.image for it in items]
    colors, counts = list(DEFAULT_COLORS), [1, 2, 3]
    count_words = {1: "one object", 2: "two objects", 3: "three objects"}
    return [
        ZeroShotSet("colour", images, [colors.index(g.color) for g in groups], [f"{c} shapes" for c in colors]),
        ZeroShotSet("shape", images, [SHAPES.index(g.shape) for g in groups], [PLURAL[s] for s in SHAPES]),
        ZeroShotSet("count", images, [counts.index(g.count) for g in groups], [count_words[c] for c in counts]),
    ]
