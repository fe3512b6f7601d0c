"""Synthetic shape scenes: count, name the colour, name the shape, locate.

Small images (multiples of 28 px, so a 14-px patch tower with 2x2 merging sees whole tokens) with a few strongly
coloured circles, squares and triangles on a white background, never overlapping, at least 12 px across. Each sample
carries its scene graph (``objects``: ``{"shape", "color", "bbox"}``) so answers can be recomputed and rewards can use
it. Boxes are ``[x1, y1, x2, y2]`` in pixels with exclusive ends (width = x2 - x1), like numpy slices.

Train vs held-out: a scene belongs to the test/ood side iff ``is_held_out`` of its key (size + scene graph) is true,
so the train and test sets of any seed never share a scene. ``ood`` draws held-out scenes with more objects (and, for
counting, counts above the train range).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from PIL import Image, ImageDraw

from .sample import (
    DataError,
    Sample,
    check_split,
    format_box,
    is_held_out,
    option_tag,
    resolve_options,
    task_rng,
)

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 230),
    "yellow": (235, 200, 0),
    "purple": (140, 50, 190),
    "orange": (245, 130, 0),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
PLURAL: dict[str, str] = {"circle": "circles", "square": "squares", "triangle": "triangles"}
DEFAULT_COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow")
DEFAULT_SIZE: tuple[int, int] = (56, 84)
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
MIN_OBJECT_PX = 12
GAP_PX = 2
COUNT_TARGETS: tuple[str, ...] = ("color", "shape", "both")

COUNT_TEMPLATES: dict[str, str] = {
    "color": "How many {color} shapes are there?",
    "shape": "How many {shapes} are there?",
    "both": "How many {color} {shapes} are there?",
}
COLOR_TEMPLATE = "What color is the {shape}?"
SHAPE_TEMPLATE = "What shape is the {color} object?"
BOX_TEMPLATE = "Give the bounding box of the {color} {shape}."

SCENE_OPTIONS: dict[str, Any] = {"size": DEFAULT_SIZE, "colors": DEFAULT_COLORS, "shapes": SHAPES}
COUNT_OPTIONS: dict[str, Any] = {**SCENE_OPTIONS, "target": "color"}

# (min, max) per scene for train/test ("train") and for ood: objects when counting, the count, objects otherwise.
_COUNT_OBJECTS = {"train": (1, 6), "ood": (7, 9)}
_COUNT_ANSWER = {"train": (0, 4), "ood": (5, 7)}
_SCENE_OBJECTS = {"train": (1, 4), "ood": (6, 9)}

Attributes = tuple[str, str]  # (color, shape)
SceneDraw = tuple[list[Attributes], str, str | None, dict[str, Any]]  # objects, problem, solution, extra columns


def problem_texts(colors: Sequence[str] = tuple(COLORS), shapes: Sequence[str] = SHAPES) -> list[str]:
    """Every question the shape tasks can ask with these colours and shapes (for the tokenizer corpus)."""
    texts = [COUNT_TEMPLATES["color"].format(color=c) for c in colors]
    texts += [COUNT_TEMPLATES["shape"].format(shapes=PLURAL[s]) for s in shapes]
    texts += [COUNT_TEMPLATES["both"].format(color=c, shapes=PLURAL[s]) for c in colors for s in shapes]
    texts += [COLOR_TEMPLATE.format(shape=s) for s in shapes]
    texts += [SHAPE_TEMPLATE.format(color=c) for c in colors]
    texts += [BOX_TEMPLATE.format(color=c, shape=s) for c in colors for s in shapes]
    return texts


def canvas_sizes(task: str, size: Any) -> list[int]:
    """The square canvas sides allowed by the ``size`` option: an int, or ``(min, max)`` -> multiples of 28 in range."""
    if isinstance(size, int) and not isinstance(size, bool):
        low = high = size
    elif isinstance(size, tuple) and len(size) == 2 and all(isinstance(v, int) for v in size):
        low, high = size
    else:
        raise DataError(f"task {task!r}: option 'size' must be an int or [min, max], got {size!r}")
    sides = [s for s in range(56, high + 1, 28) if s >= low]
    if low < 56 or not sides or low % 28 or high % 28:
        raise DataError(
            f"task {task!r}: option 'size' {size!r} must be multiples of 28 px, at least 56 "
            "(the vision tower sees 28-px merged patches), e.g. 56, 84 or [56, 84]"
        )
    return sides


def _check_names(task: str, option: str, values: Any, known: Sequence[str]) -> tuple[str, ...]:
    if not isinstance(values, tuple) or len(values) < 2 or len(set(values)) != len(values):
        raise DataError(f"task {task!r}: option {option!r} must list at least 2 distinct names, got {values!r}")
    for value in values:
        if value not in known:
            raise DataError(f"task {task!r}: option {option!r}: unknown name {value!r}; choose from {list(known)}")
    return values


def place_objects(rng: random.Random, side: int, attributes: Sequence[Attributes]) -> list[dict[str, Any]]:
    """Random non-overlapping boxes (``GAP_PX`` apart) for the given objects, by rejection sampling.

    Object sides range from MIN_OBJECT_PX to a maximum that shrinks as the scene gets crowded, so even 9 objects fit
    on a 56-px canvas; a dead end restarts the whole scene.
    """
    largest = max(MIN_OBJECT_PX, min(side // 4, int(math.sqrt(0.3 * side * side / max(1, len(attributes))))))
    for _ in range(200):
        boxes: list[list[int]] = []
        for _ in attributes:
            for _ in range(100):
                s = rng.randint(MIN_OBJECT_PX, largest)
                x1, y1 = rng.randint(0, side - s), rng.randint(0, side - s)
                box = [x1, y1, x1 + s, y1 + s]
                if all(_apart(box, other) for other in boxes):
                    boxes.append(box)
                    break
            else:
                break
        else:
            return [
                {"shape": shape, "color": color, "bbox": box}
                for (color, shape), box in zip(attributes, boxes, strict=True)
            ]
    raise DataError(f"could not place {len(attributes)} objects on a {side}x{side} canvas; use a larger 'size'")


def _apart(a: Sequence[int], b: Sequence[int]) -> bool:
    return a[0] >= b[2] + GAP_PX or b[0] >= a[2] + GAP_PX or a[1] >= b[3] + GAP_PX or b[1] >= a[3] + GAP_PX


def render_scene(side: int, objects: Sequence[dict[str, Any]]) -> Image.Image:
    """Draw the scene graph, without anti-aliasing, so every object pixel has exactly its palette colour."""
    image = Image.new("RGB", (side, side), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        x1, y1, x2, y2 = obj["bbox"]
        fill = COLORS[obj["color"]]
        if obj["shape"] == "circle":
            draw.ellipse([x1, y1, x2 - 1, y2 - 1], fill=fill)
        elif obj["shape"] == "square":
            draw.rectangle([x1, y1, x2 - 1, y2 - 1], fill=fill)
        else:
            draw.polygon([(x1, y2 - 1), (x2 - 1, y2 - 1), ((x1 + x2 - 1) / 2, y1)], fill=fill)
    return image


def scene_key(side: int, objects: Sequence[dict[str, Any]]) -> str:
    """The content key of a scene (canvas side + scene graph) that decides its train/held-out side."""
    return json.dumps([side, [[o["shape"], o["color"], o["bbox"]] for o in objects]], separators=(",", ":"))


def _generate(
    task: str,
    n: int,
    split: str,
    seed: int,
    options: dict[str, Any],
    defaults: dict[str, Any],
    draw_scene: Callable[[random.Random, str, dict[str, Any]], SceneDraw],
    answer_type: str,
) -> list[Sample]:
    """The loop shared by the shape tasks: draw a scene until it lands on this split's side, render, wrap."""
    check_split(task, split)
    opts = resolve_options(task, options, defaults)
    sides = canvas_sizes(task, opts["size"])
    opts["colors"] = _check_names(task, "colors", opts["colors"], tuple(COLORS))
    opts["shapes"] = _check_names(task, "shapes", opts["shapes"], SHAPES)
    tag = option_tag(options, defaults)
    held_out = split != "train"
    samples = []
    for index in range(n):
        rng = task_rng(task, split, seed, tag, index)
        for _ in range(1000):
            side = rng.choice(sides)
            attributes, problem, solution, extra = draw_scene(rng, split, opts)
            rng.shuffle(attributes)
            objects = place_objects(rng, side, attributes)
            if is_held_out(scene_key(side, objects)) == held_out:
                break
        else:  # pragma: no cover - the held-out side holds 20% of scenes, so 1000 misses never happen
            raise DataError(f"task {task!r}: found no {split} scene in 1000 draws")
        if solution is None:  # shapes_box: the answer is the target's box, known only once the scene is placed
            (target,) = [o for o in objects if all(o[k] == v for k, v in extra["target"].items())]
            solution = format_box(target["bbox"])
        samples.append(
            {
                "id": f"{task}{tag}/{split}/{index}",
                "images": [render_scene(side, objects)],
                "problem": problem,
                "solution": solution,
                "answer_type": answer_type,
                "task": task,
                "width": side,
                "height": side,
                "objects": objects,
                "difficulty": len(objects),  # objects in the scene: curriculum.order=easy_to_hard sorts by it
                **extra,
            }
        )
    return samples


def _range(table: dict[str, tuple[int, int]], split: str) -> tuple[int, int]:
    return table["ood" if split == "ood" else "train"]


def _count_scene(rng: random.Random, split: str, opts: dict[str, Any]) -> SceneDraw:
    colors, shapes, target = opts["colors"], opts["shapes"], opts["target"]
    count = rng.randint(*_range(_COUNT_ANSWER, split))
    low, high = _range(_COUNT_OBJECTS, split)
    total = rng.randint(max(low, count), high)
    color, shape = rng.choice(colors), rng.choice(shapes)
    pairs = [(c, s) for c in colors for s in shapes]
    if target == "color":
        hits = [p for p in pairs if p[0] == color]
        query = {"color": color}
    elif target == "shape":
        hits = [p for p in pairs if p[1] == shape]
        query = {"shape": shape}
    else:
        hits = [(color, shape)]
        query = {"color": color, "shape": shape}
    misses = [p for p in pairs if p not in hits]
    attributes = [rng.choice(hits) for _ in range(count)] + [rng.choice(misses) for _ in range(total - count)]
    problem = COUNT_TEMPLATES[target].format(color=color, shapes=PLURAL[shape])
    return attributes, problem, str(count), {"target": query}


def _color_scene(rng: random.Random, split: str, opts: dict[str, Any]) -> SceneDraw:
    colors, shapes = opts["colors"], opts["shapes"]
    color, shape = rng.choice(colors), rng.choice(shapes)
    others = [(c, s) for c in colors for s in shapes if s != shape]
    n_others = rng.randint(*_range(_SCENE_OBJECTS, split)) - 1
    attributes = [(color, shape)] + [rng.choice(others) for _ in range(n_others)]
    return attributes, COLOR_TEMPLATE.format(shape=shape), color, {"target": {"shape": shape}}


def _shape_scene(rng: random.Random, split: str, opts: dict[str, Any]) -> SceneDraw:
    colors, shapes = opts["colors"], opts["shapes"]
    color, shape = rng.choice(colors), rng.choice(shapes)
    others = [(c, s) for c in colors for s in shapes if c != color]
    n_others = rng.randint(*_range(_SCENE_OBJECTS, split)) - 1
    attributes = [(color, shape)] + [rng.choice(others) for _ in range(n_others)]
    return attributes, SHAPE_TEMPLATE.format(color=color), shape, {"target": {"color": color}}


def _box_scene(rng: random.Random, split: str, opts: dict[str, Any]) -> SceneDraw:
    colors, shapes = opts["colors"], opts["shapes"]
    color, shape = rng.choice(colors), rng.choice(shapes)
    others = [(c, s) for c in colors for s in shapes if (c, s) != (color, shape)]
    n_others = rng.randint(*_range(_SCENE_OBJECTS, split)) - 1
    attributes = [(color, shape)] + [rng.choice(others) for _ in range(n_others)]
    return attributes, BOX_TEMPLATE.format(color=color, shape=shape), None, {"target": {"color": color, "shape": shape}}


def shapes_count(n: int, split: str, seed: int = 0, **options: Any) -> list[Sample]:
    """ "How many red shapes are there?" -> ``"3"`` (answer_type number).

    Options: ``size`` (int or [min, max], multiples of 28; default [56, 84]), ``colors`` (default red, green, blue,
    yellow; purple and orange also available), ``shapes`` (circle, square, triangle), ``target``: what is counted,
    ``"color"`` (default), ``"shape"`` ("How many circles are there?") or ``"both"`` ("How many red circles ...").
    Train/test: 1-6 objects, answer 0-4 (uniform). ood: 7-9 objects, answer 5-7.
    """
    if options.get("target", "color") not in COUNT_TARGETS:
        raise DataError(
            f"task 'shapes_count': option 'target' must be one of {list(COUNT_TARGETS)}, got {options['target']!r}"
        )
    return _generate("shapes_count", n, split, seed, options, COUNT_OPTIONS, _count_scene, "number")


def shapes_color(n: int, split: str, seed: int = 0, **options: Any) -> list[Sample]:
    """ "What color is the circle?" about the only circle in the scene -> ``"red"`` (answer_type text).

    Options: ``size``, ``colors``, ``shapes`` as for shapes_count. Train/test: 1-4 objects; ood: 6-9.
    """
    return _generate("shapes_color", n, split, seed, options, SCENE_OPTIONS, _color_scene, "text")


def shapes_shape(n: int, split: str, seed: int = 0, **options: Any) -> list[Sample]:
    """ "What shape is the blue object?" about the only blue object -> ``"triangle"`` (answer_type text).

    Options: ``size``, ``colors``, ``shapes`` as for shapes_count. Train/test: 1-4 objects; ood: 6-9.
    """
    return _generate("shapes_shape", n, split, seed, options, SCENE_OPTIONS, _shape_scene, "text")


def shapes_box(n: int, split: str, seed: int = 0, **options: Any) -> list[Sample]:
    """ "Give the bounding box of the red circle." -> ``"[x1, y1, x2, y2]"`` in pixels (answer_type box).

    The named colour+shape pair is unique in the scene; samples carry ``width`` and ``height`` for normalising IoU.
    Options: ``size``, ``colors``, ``shapes`` as for shapes_count. Train/test: 1-4 objects; ood: 6-9.
    """
    return _generate("shapes_box", n, split, seed, options, SCENE_OPTIONS, _box_scene, "box")
