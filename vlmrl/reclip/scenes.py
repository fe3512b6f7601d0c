"""Compositional image-caption data from the built-in shapes scenes: captions written from scene graphs.

A scene holds one or two *groups* of identical objects (1-3 copies of one colour+shape). With two groups, the groups sit
on opposite sides of the canvas and the caption states their spatial relation:

    "two red circles to the left of a blue square"      "three green triangles"

The caption is rendered from a ``Description`` (groups + relation), and a ``Description`` can be recomputed from any
scene graph (``describe``), which is what the programmatic judge compares. Hard negatives edit one thing of the
description and are rendered with the same word order, so only the edited words change:

- ``relation``: the relation reversed ("to the right of")
- ``binding``: the two groups' colours swapped (their shapes if the colours are equal)
- ``color`` / ``shape`` / ``count``: one group's colour, shape or count replaced

Held-out split: a scene is held out iff its canonical caption is (``is_held_out``), so test captions are combinations
of colours, shapes, counts and relations never seen in training. Rendering reuses ``vlmrl.data.shapes``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from PIL import Image

from vlmrl.data.sample import DataError, check_split, is_held_out, task_rng
from vlmrl.data.shapes import DEFAULT_COLORS, PLURAL, SHAPES, place_objects, render_scene

INVERSE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
PHRASES = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
NEGATIVE_KINDS = ("relation", "binding", "color", "shape", "count")
DEFAULT_SIDE = 112


@dataclass(frozen=True)
class Group:
    """``count`` identical objects of one colour and shape."""

    count: int
    color: str
    shape: str

    def phrase(self) -> str:
        """"a red circle", "two red circles"."""
        noun = self.shape if self.count == 1 else PLURAL[self.shape]
        return f"{COUNT_WORDS.get(self.count, str(self.count))} {self.color} {noun}"


@dataclass(frozen=True)
class Description:
    """What a caption says: groups, and for exactly two groups ``groups[0] <relation> groups[1]``."""

    groups: tuple[Group, ...]
    relation: str | None = None

    def canonical(self) -> Description:
        """The same meaning in one spelling: relation "left of"/"above" (by swapping the groups), lone groups sorted."""
        if self.relation in ("right of", "below"):
            return Description((self.groups[1], self.groups[0]), INVERSE[self.relation])
        if self.relation is None:
            return Description(tuple(sorted(self.groups, key=lambda g: (g.color, g.shape, g.count))), None)
        return self

    def key(self) -> str:
        return caption(self.canonical())


@dataclass
class Negative:
    kind: str
    caption: str
    description: Description


@dataclass
class CaptionItem:
    """One image-caption pair. ``description`` (for the programmatic judge) and ``negatives`` exist for built-in
    scenes; user files give only ``id``, ``image`` and ``caption``."""

    id: str
    image: Image.Image
    caption: str
    description: Description | None = None
    negatives: list[Negative] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def caption(desc: Description, flip: bool = False) -> str:
    """Render a description; ``flip`` states a relation from the other side ("B to the right of A")."""
    if desc.relation is None:
        return " and ".join(g.phrase() for g in desc.groups)
    a, b, rel = desc.groups[0], desc.groups[1], desc.relation
    if flip:
        a, b, rel = b, a, INVERSE[rel]
    return f"{a.phrase()} {PHRASES[rel]} {b.phrase()}"


def relation_of(boxes_a: Sequence[Sequence[int]], boxes_b: Sequence[Sequence[int]]) -> str | None:
    """The relation of box set A to box set B when exactly one holds, else None.

    A "left of" B iff every A box ends (x2) at or before every B box starts (x1); "above" likewise with y. A pair that
    is both left of and above (or neither) has no single relation.
    """
    found = []
    if max(b[2] for b in boxes_a) <= min(b[0] for b in boxes_b):
        found.append("left of")
    if max(b[2] for b in boxes_b) <= min(b[0] for b in boxes_a):
        found.append("right of")
    if max(b[3] for b in boxes_a) <= min(b[1] for b in boxes_b):
        found.append("above")
    if max(b[3] for b in boxes_b) <= min(b[1] for b in boxes_a):
        found.append("below")
    return found[0] if len(found) == 1 else None


def describe(objects: Sequence[dict[str, Any]]) -> Description:
    """The description of any shapes scene graph (``{"shape", "color", "bbox"}`` objects): objects grouped by
    colour+shape; with exactly two groups, their relation when one holds (see ``relation_of``)."""
    counts = Counter((o["color"], o["shape"]) for o in objects)
    groups = tuple(Group(n, color, shape) for (color, shape), n in sorted(counts.items()))
    if len(groups) != 2:
        return Description(groups, None)
    boxes = [[o["bbox"] for o in objects if (o["color"], o["shape"]) == (g.color, g.shape)] for g in groups]
    return Description(groups, relation_of(boxes[0], boxes[1])).canonical()


_NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
_NOUNS = {**{shape: (shape, 1) for shape in SHAPES}, **{PLURAL[shape]: (shape, 2) for shape in SHAPES}}
_RELATIONS = {phrase: rel for rel, phrase in PHRASES.items()} | {rel: rel for rel in PHRASES}


def _parse_group(words: list[str], colors: Sequence[str]) -> Group | None:
    if len(words) != 3 or words[1] not in colors or words[2] not in _NOUNS:
        return None
    count = _NUMBERS.get(words[0], int(words[0]) if words[0].isdigit() else None)
    shape, number = _NOUNS[words[2]]
    if count is None or count < 1 or (count == 1) != (number == 1):
        return None
    return Group(count, words[1], shape)


def parse_caption(text: str, colors: Sequence[str] = DEFAULT_COLORS) -> Description | None:
    """The description a caption of these scenes states (the inverse of ``caption``: "two red circles to the left of
    a blue square", "a green triangle and three red squares"), or None for text outside that grammar."""
    text = " ".join(text.strip().lower().rstrip(".").split())
    for phrase, rel in sorted(_RELATIONS.items(), key=lambda kv: -len(kv[0])):  # "to the left of" before "left of"
        left, found, right = text.partition(f" {phrase} ")
        if found:
            a, b = _parse_group(left.split(), colors), _parse_group(right.split(), colors)
            if a is None or b is None or (a.color, a.shape) == (b.color, b.shape):
                return None
            return Description((a, b), rel)
    groups = [_parse_group(part.split(), colors) for part in text.split(" and ")]
    if any(g is None for g in groups) or len({(g.color, g.shape) for g in groups}) != len(groups):
        return None
    return Description(tuple(groups), None)


def scene_of(desc: Description, rng: random.Random, side: int = DEFAULT_SIDE) -> list[dict[str, Any]]:
    """Objects that show what ``desc`` says, placed as ``make_scenes`` places them (``describe`` of them gives
    ``desc`` back); DataError if they do not fit the canvas."""
    return _place(rng, side, desc.canonical())


# --- generation ------------------------------------------------------------------------------------------------------


def _draw_description(rng: random.Random, colors: Sequence[str], shapes: Sequence[str], max_count: int,
                      single_fraction: float) -> Description:
    def group() -> Group:
        return Group(rng.randint(1, max_count), rng.choice(colors), rng.choice(shapes))

    if rng.random() < single_fraction:
        return Description((group(),), None)
    a = group()
    b = group()
    while (b.color, b.shape) == (a.color, a.shape):
        b = group()
    return Description((a, b), rng.choice(["left of", "above"]))


def _place(rng: random.Random, side: int, desc: Description) -> list[dict[str, Any]]:
    """Objects for a description: one group anywhere; two groups in opposite halves, in a shared band, redrawn until
    the relation computed from the boxes is exactly the described one."""
    if desc.relation is None:
        attrs = [(g.color, g.shape) for g in desc.groups for _ in range(g.count)]
        return place_objects(rng, side, attrs)
    half = side // 2
    for _ in range(100):
        band = rng.randint(0, side - half)
        objects, boxes = [], []
        for index, g in enumerate(desc.groups):
            local = place_objects(rng, half, [(g.color, g.shape)] * g.count)
            dx, dy = (index * half, band) if desc.relation == "left of" else (band, index * half)
            for o in local:
                x1, y1, x2, y2 = o["bbox"]
                o["bbox"] = [x1 + dx, y1 + dy, x2 + dx, y2 + dy]
            objects += local
            boxes.append([o["bbox"] for o in local])
        if relation_of(boxes[0], boxes[1]) == desc.relation:
            return objects
    raise DataError(f"could not place {caption(desc)!r} on a {side}-px canvas; use a larger side")


def negatives_of(desc: Description, rng: random.Random, colors: Sequence[str], shapes: Sequence[str],
                 max_count: int, flip: bool = False) -> list[Negative]:
    """One hard negative per applicable kind (NEGATIVE_KINDS), each meaning something else than ``desc``."""
    out: list[Negative] = []
    gi = rng.randrange(len(desc.groups))
    g = desc.groups[gi]

    def with_group(new: Group) -> Description:
        groups = list(desc.groups)
        groups[gi] = new
        return Description(tuple(groups), desc.relation)

    candidates: list[tuple[str, Description]] = []
    if desc.relation is not None:
        candidates.append(("relation", Description(desc.groups, INVERSE[desc.relation])))
        a, b = desc.groups
        if a.color != b.color:
            swapped = (replace(a, color=b.color), replace(b, color=a.color))
        else:
            swapped = (replace(a, shape=b.shape), replace(b, shape=a.shape))
        candidates.append(("binding", Description(swapped, desc.relation)))
    candidates.append(("color", with_group(replace(g, color=rng.choice([c for c in colors if c != g.color])))))
    candidates.append(("shape", with_group(replace(g, shape=rng.choice([s for s in shapes if s != g.shape])))))
    counts = [n for n in range(1, max_count + 1) if n != g.count]
    if counts:
        candidates.append(("count", with_group(replace(g, count=rng.choice(counts)))))
    for kind, neg in candidates:
        other = [x for i, x in enumerate(neg.groups) if i != gi]
        if len(neg.groups) == 2 and (other[0].color, other[0].shape) == (neg.groups[gi].color, neg.groups[gi].shape):
            continue  # the edit made both groups the same type: not a two-group scene any more
        if neg.key() != desc.key():
            out.append(Negative(kind, caption(neg, flip), neg))
    return out


def make_scenes(n: int, split: str, seed: int = 0, side: int = DEFAULT_SIDE, colors: Sequence[str] = DEFAULT_COLORS,
                shapes: Sequence[str] = SHAPES, max_count: int = 3, single_fraction: float = 0.25,
                negatives: bool = True) -> list[CaptionItem]:
    """``n`` captioned scenes of ``split`` ("train", or "test"/"ood": held-out captions), deterministic in the
    arguments; item i does not depend on n. Captions state counts (1..max_count), colours, shapes and, for two groups,
    their relation, phrased from either side at random."""
    check_split("reclip_scenes", split)
    if side < 56 or side % 28:
        raise DataError(f"reclip scenes: side must be a multiple of 28 px, at least 56, got {side}")
    if not 1 <= max_count <= 3:
        raise DataError(f"reclip scenes: max_count must be 1..3, got {max_count}")
    held_out = split != "train"
    items = []
    options = {"side": side, "colors": ",".join(colors), "shapes": ",".join(shapes), "max_count": max_count,
               "single_fraction": single_fraction}
    defaults = {"side": DEFAULT_SIDE, "colors": ",".join(DEFAULT_COLORS), "shapes": ",".join(SHAPES), "max_count": 3,
                "single_fraction": 0.25}
    changed = ",".join(f"{k}={v}" for k, v in options.items() if v != defaults[k])
    tag = f"[{changed}]" if changed else ""
    for index in range(n):
        rng = task_rng("reclip_scenes", split, seed, tag, index)
        for _ in range(1000):
            desc = _draw_description(rng, colors, shapes, max_count, single_fraction)
            if is_held_out("reclip|" + desc.key()) == held_out:
                break
        else:  # pragma: no cover - 20% of captions are held out
            raise DataError(f"reclip scenes: no {split} caption found in 1000 draws")
        objects = _place(rng, side, desc)
        flip = desc.relation is not None and rng.random() < 0.5
        items.append(CaptionItem(
            id=f"reclip_scenes{tag}/s{seed}/{split}/{index}",
            image=render_scene(side, objects),
            caption=caption(desc, flip),
            description=desc,
            negatives=negatives_of(desc, rng, colors, shapes, max_count, flip) if negatives else [],
            extra={"objects": objects},
        ))
    return items
