"""The built-in task registry, the tokenizer corpus, and building a dataset from a small config spec.

A spec is what a YAML recipe holds under a split, for example::

    train: {task: shapes_count, n: 300, target: shape}
    test:  {path: data/test.jsonl, on_error: skip, n: 500}    # reads the first 500 good rows only
    eval:  {hub: jigsaw-r1/super_clevr, split: test, columns: {problem: question, solution: ground_truth}}
    # or a list of such specs, concatenated in order

Adding a task is a generator function ``(n, split, seed, **options) -> list[Sample]`` and one ``Task`` entry below.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import digits, shapes, zoom
from .files import ON_ERROR, load_file
from .images import CHECKS
from .sample import DataError, LoadReport, Sample, format_box


@dataclass(frozen=True)
class Task:
    """A built-in synthetic task: its generator, its options with their defaults, its answer type."""

    name: str
    generate: Callable[..., list[Sample]]
    options: Mapping[str, Any]
    answer_type: str
    description: str

    def __call__(self, n: int, split: str, seed: int = 0, **options: Any) -> list[Sample]:
        return make_task(self.name, n, split, seed, **options)


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("shapes_count", shapes.shapes_count, shapes.COUNT_OPTIONS, "number", "How many red shapes are there?"),
        Task("shapes_color", shapes.shapes_color, shapes.SCENE_OPTIONS, "text", "What color is the circle?"),
        Task("shapes_shape", shapes.shapes_shape, shapes.SCENE_OPTIONS, "text", "What shape is the blue object?"),
        Task("shapes_box", shapes.shapes_box, shapes.SCENE_OPTIONS, "box", "Give the bounding box of the red circle."),
        Task("digits_sum", digits.digits_sum, digits.DIGITS_OPTIONS, "number", "What is the sum of the digits?"),
        Task("zoom_shape", zoom.zoom_shape, zoom.ZOOM_OPTIONS, "text", "What shape is in the blue cell? (zoom in)"),
    )
}

TASK_SPEC_KEYS: tuple[str, ...] = ("task", "n", "seed")
FILE_SPEC_KEYS: tuple[str, ...] = ("path", "on_error", "image_root", "n", "check_images")


def make_task(name: str, n: int, split: str, seed: int = 0, **options: Any) -> list[Sample]:
    """``n`` samples of built-in task ``name`` for ``split`` ("train", "test" or "ood").

    Deterministic in (name, n, split, seed, options); sample i does not depend on n. Train and test/ood never share
    an item (a scene, or a handwritten digit image), whatever the seeds.
    """
    if name not in TASKS:
        raise DataError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)} (or give a data file with 'path')")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise DataError(f"task {name!r}: n must be a non-negative int, got {n!r}")
    return TASKS[name].generate(n, split, seed, **options)


def vocabulary_texts(seed: int = 0) -> list[str]:
    """Problem and solution strings covering every built-in task, to train the tiny model's tokenizer.

    Every question any task can ask (all colours and shapes, including the optional purple/orange), every colour and
    shape answer, the integers 0-255 (counts, digit sums, box coordinates) and 500 random boxes on canvases of up to
    224 px. About 800 strings.
    """
    texts = shapes.problem_texts() + [digits.PROBLEM]
    texts += list(shapes.COLORS) + list(shapes.SHAPES)
    texts += [str(i) for i in range(256)]
    rng = random.Random(f"vlmrl|vocabulary|{seed}")
    for _ in range(500):
        side = rng.choice(range(56, 225, 28))
        x1, y1 = rng.randrange(side - 12), rng.randrange(side - 12)
        size = rng.randint(12, min(side - x1, side - y1))
        texts.append(format_box([x1, y1, x1 + size, y1 + size]))
    return texts


def build_dataset(spec: Any, split: str, seed: int, on_error: str = "raise") -> tuple[list[Sample], LoadReport | None]:
    """Samples for one split from a spec: ``{"task": ..., "n": ..., **options}``, ``{"path": ..., ...}`` or a list.

    Task specs may set their own ``seed`` (else ``seed`` is used). File specs ignore ``split`` (give each split its
    own file); their ``n`` keeps the first n good rows (reading stops there); their ``on_error`` defaults to
    ``on_error`` (the recipe's ``data.on_error``); their ``check_images`` ("exists", "header" or "decode", see
    ``load_file``) says how much of each image loading checks (images decode when used). Returns the samples and the merged report of the files read
    (None when the spec reads no file). Sample ids must be unique across the list.
    """
    specs = spec if isinstance(spec, list) else [spec]
    if not specs:
        raise DataError("data spec: empty list; give at least one {task: ...} or {path: ...}")
    samples: list[Sample] = []
    reports: list[LoadReport] = []
    origin: dict[str, str] = {}
    for index, one in enumerate(specs):
        where = "data spec" if not isinstance(spec, list) else f"data spec [{index}]"
        part, report = _build_one(one, split, seed, where, on_error)
        for sample in part:
            if sample["id"] in origin:
                raise DataError(
                    f"{where}: sample id {sample['id']!r} is also produced by {origin[sample['id']]}; "
                    "two specs give the same samples: raise 'n' of one spec instead of repeating it"
                )
            origin[sample["id"]] = where
        samples.extend(part)
        if report is not None:
            reports.append(report)
    return samples, _merge(reports)


def _build_one(spec: Any, split: str, seed: int, where: str, default_on_error: str = "raise") -> tuple[list[Sample], LoadReport | None]:
    if not isinstance(spec, Mapping):
        raise DataError(f"{where}: expected a mapping with 'task', 'path' or 'hub', got {spec!r}")
    if sum(key in spec for key in ("task", "path", "hub")) != 1:
        raise DataError(f"{where}: give exactly one of 'task' (built-in: {sorted(TASKS)}), 'path' (a data file) "
                        "or 'hub' (a hub dataset or a folder saved by datasets)")
    if "hub" in spec:
        from .hub import load_hub

        return load_hub(spec, where, default_on_error)
    if "task" in spec:
        name = spec["task"]
        if name not in TASKS:
            raise DataError(f"{where}: unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
        allowed = list(TASK_SPEC_KEYS) + sorted(TASKS[name].options)
        _check_keys(spec, allowed, f"{where} (task {name!r})")
        if "n" not in spec:
            raise DataError(f"{where}: task {name!r} needs 'n', the number of samples")
        options = {k: v for k, v in spec.items() if k not in TASK_SPEC_KEYS}
        return make_task(name, spec["n"], split, spec.get("seed", seed), **options), None
    _check_keys(spec, list(FILE_SPEC_KEYS), f"{where} (path {spec['path']!r})")
    if not isinstance(spec["path"], (str, Path)):
        raise DataError(f"{where}: 'path' must be a file path string, got {spec['path']!r}")
    on_error = spec.get("on_error", default_on_error)
    if on_error not in ON_ERROR:
        raise DataError(f"{where}: on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
    if spec.get("check_images", "header") not in CHECKS:
        raise DataError(f"{where}: check_images must be one of {list(CHECKS)}, got {spec['check_images']!r}")
    limit = spec.get("n")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"{where}: n must be a non-negative int, got {limit!r}")
    return load_file(spec["path"], on_error=on_error, image_root=spec.get("image_root"), n=limit,
                     check_images=spec.get("check_images", "header"))


def _check_keys(spec: Mapping[str, Any], allowed: list[str], where: str) -> None:
    for key in spec:
        if key not in allowed:
            raise DataError(f"{where}: unknown key {key!r}; allowed keys: {allowed}")


def _merge(reports: list[LoadReport]) -> LoadReport | None:
    if not reports:
        return None
    if len(reports) == 1:
        return reports[0]
    return LoadReport(
        path=", ".join(r.path for r in reports),
        loaded=sum(r.loaded for r in reports),
        skipped=sum(r.skipped for r in reports),
        problems=[p for r in reports for p in r.problems],
    )
