"""Box rewards: IoU / GIoU for one box, and detection (several boxes matched at an IoU threshold, F1 or AP).

Boxes are parsed from every common output form (`parse_boxes`): JSON with `bbox_2d`/`Position`, `[x1, y1, x2, y2]`,
`(x1,y1),(x2,y2)`, Qwen2-VL's `<|box_start|>(x1,y1),(x2,y2)<|box_end|>` on its 0..1000 grid. Invalid boxes
(inverted, empty, NaN, outside the image) never pay: a huge box would otherwise always overlap the target. As for
every verifiable reward, only an option outside its listed values (or a column of the wrong length) raises ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from vlmrl.rewards.columns import per_sample
from vlmrl.rewards.parsing import (
    Box,
    box_is_valid,
    boxes_from_json,
    completion_text,
    extract_tag,
    match_answer_block,
    parse_boxes,
    strip_think,
)
from vlmrl.rewards.registry import register_reward

MATCHING = ("greedy", "hungarian")
DETECTION_SCORES = ("f1", "ap")


def _comparable(a: Box, b: Box) -> tuple[Box, Box]:
    """Both boxes divided by their largest |coordinate| when areas would overflow to inf or underflow to 0: IoU and
    GIoU are ratios of areas, the same at any scale, and inf - inf would make them NaN."""
    scale = max(abs(v) for v in (*a, *b))
    if 1e-100 < scale < 1e100:
        return a, b
    if scale == 0.0 or not math.isfinite(scale):
        return a, b
    return (tuple(v / scale for v in a), tuple(v / scale for v in b))  # type: ignore[return-value]


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two valid boxes (x1, y1, x2, y2), areas as (x2 - x1) * (y2 - y1)."""
    a, b = _comparable(a, b)
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def box_giou(a: Box, b: Box) -> float:
    """Generalised IoU in [-1, 1]: IoU - (C - U) / C, C the area of the smallest box enclosing both, U the union."""
    a, b = _comparable(a, b)
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    enclosing = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    if union <= 0 or enclosing <= 0:
        return -1.0
    return inter / union - (enclosing - union) / enclosing


def _solution_box(solution: Any, coords: str, width: float | None, height: float | None) -> Box | None:
    boxes = parse_boxes(solution, width, height, coords) if isinstance(solution, str) else boxes_from_json(solution)
    if len(boxes) != 1 or not box_is_valid(boxes[0], width, height, coords):
        return None
    return boxes[0]


def _box_answer(completion: Any, truncated: bool, strict: bool) -> str | None:
    """The text boxes are read from: strict = the answer block of an exactly-formatted, untruncated completion;
    else the answer tag's content, or the whole completion outside think blocks when there is no tag."""
    text = completion_text(completion)
    if strict:
        return None if truncated else match_answer_block(text, think=None)
    answer = extract_tag(text)
    return strip_think(text) if answer is None else answer


def _box_scores(
    metric: Callable[[Box, Box], float], completions: list[str], solution: list[Any], columns: dict[str, Any]
) -> list[float | None]:
    coords = columns["coords"]
    threshold, strict = columns["threshold"], columns["strict"]
    n = len(completions)
    kinds = per_sample(columns.get("answer_type"), n, "box")
    widths = per_sample(columns.get("width"), n, None)
    heights = per_sample(columns.get("height"), n, None)
    truncated = per_sample(columns.get("completion_truncated"), n, False)
    scores: list[float | None] = []
    for completion, sol, kind, w, h, trunc in zip(
        completions, solution, kinds, widths, heights, truncated, strict=True
    ):
        w = float(w) if w else None
        h = float(h) if h else None
        target = _solution_box(sol, coords, w, h) if kind == "box" else None
        if target is None:
            scores.append(None)
            continue
        answer = _box_answer(completion, bool(trunc), strict)
        boxes = parse_boxes(answer, w, h, coords) if answer else []
        if len(boxes) != 1 or not box_is_valid(boxes[0], w, h, coords):
            scores.append(0.0)
            continue
        score = metric(boxes[0], target)
        scores.append(score if threshold is None else float(score >= threshold))
    return scores


@register_reward("iou", inline=True, grades=("box",))
def iou_reward(
    completions: list[str],
    solution: list[Any],
    *,
    coords: str = "absolute",
    threshold: float | None = None,
    strict: bool = False,
    **columns: Any,
) -> list[float | None]:
    """IoU in [0, 1] between the predicted box and the solution box, for answer_type "box" (else None; all samples
    are boxes when the column is absent).

    The prediction is parsed (`parse_boxes`) from the answer tag's content, falling back to the whole completion
    outside think blocks: `[x1, y1, x2, y2]`, `(x1,y1),(x2,y2)`, JSON with `bbox_2d`/`Position`, or Qwen2-VL's
    `<|box_start|>(x1,y1),(x2,y2)<|box_end|>` on its 0..1000 grid (converted with the `width`/`height` columns).
    `coords`: "absolute" (pixels) or "normalized" (0..1 fractions), for prediction and solution alike.
    Pays 0 unless exactly ONE box is given, so listing many boxes cannot cover the target; pays 0 for an invalid
    box: inverted or empty (x2 <= x1 or y2 <= y1), NaN/inf, or outside the image by more than 1 px (a huge box
    would otherwise always overlap). `threshold`: pay 1.0 when IoU >= threshold, else 0.0. `strict`: require the
    answer-block format and no truncation, as in `accuracy`. A solution that is not one valid box gives None.
    """
    return _box_scores(box_iou, completions, solution, dict(columns, coords=coords, threshold=threshold, strict=strict))


@register_reward("giou", inline=True, grades=("box",))
def giou_reward(
    completions: list[str],
    solution: list[Any],
    *,
    coords: str = "absolute",
    threshold: float | None = None,
    strict: bool = False,
    **columns: Any,
) -> list[float | None]:
    """Generalised IoU mapped to [0, 1] as (GIoU + 1) / 2; otherwise exactly like `iou` (same parsing, options and
    zero for missing, several or invalid boxes). Unlike IoU it still ranks disjoint boxes by how far apart they
    are, which gives a gradient before the first overlap; an invalid box still pays 0, not the 0.5 of a
    touching box. `threshold` applies to the mapped value."""

    def mapped(a: Box, b: Box) -> float:
        return (box_giou(a, b) + 1.0) / 2.0

    return _box_scores(mapped, completions, solution, dict(columns, coords=coords, threshold=threshold, strict=strict))


def match_boxes(pred: list[Box], gold: list[Box], threshold: float = 0.5,
                method: str = "greedy") -> list[tuple[int, int, float]]:
    """One-to-one matches (pred index, gold index, IoU) with IoU >= threshold.

    greedy: candidate pairs by decreasing IoU (ties: earlier prediction first), each box used at most once.
    hungarian: the assignment maximising the summed IoU over pairs at or above the threshold (scipy's
    `linear_sum_assignment`); it can match more pairs than greedy when boxes overlap several targets."""
    if method not in MATCHING:
        raise ValueError(f"matching={method!r}: expected one of {MATCHING}")
    ious = [[box_iou(p, g) for g in gold] for p in pred]
    if method == "hungarian" and pred and gold:
        import numpy as np
        from scipy.optimize import linear_sum_assignment

        weights = np.array(ious)
        weights[weights < threshold] = 0.0
        rows, cols = linear_sum_assignment(weights, maximize=True)
        return [(int(r), int(c), float(ious[r][c])) for r, c in zip(rows, cols, strict=True) if ious[r][c] >= threshold]
    pairs = sorted(((ious[i][j], i, j) for i in range(len(pred)) for j in range(len(gold)) if ious[i][j] >= threshold),
                   key=lambda t: (-t[0], t[1], t[2]))
    used_p, used_g, matches = set(), set(), []
    for iou, i, j in pairs:
        if i not in used_p and j not in used_g:
            used_p.add(i)
            used_g.add(j)
            matches.append((i, j, iou))
    return matches


def detection_score(pred: list[Box], gold: list[Box], threshold: float = 0.5, matching: str = "greedy",
                    score: str = "f1", soft: bool = False) -> float:
    """Score of predicted boxes `pred` (in the model's order) against the true boxes `gold`.

    f1: 2 * TP / (P + G), TP the matches (`match_boxes`), P predicted and G true boxes: every extra box lowers
        the score, so 50 boxes for one object pay 2 / 51, not 1.
    ap: average precision over the ranked predictions (the model's order; each prediction matched in turn to its
        best unmatched target), AP = (1 / G) * sum over matched ranks k of precision@k, times min(1, G / P):
        plain AP ignores false positives ranked after the hits, so without the factor spamming would pay.
    soft: a match counts its IoU instead of 1 (a gradient towards tighter boxes).
    No true boxes: 1.0 for no prediction, else 0.0. An invalid predicted box is a prediction that matches nothing.
    """
    if score not in DETECTION_SCORES:
        raise ValueError(f"score={score!r}: expected one of {DETECTION_SCORES}")
    if not gold:
        return 1.0 if not pred else 0.0
    if not pred:
        return 0.0
    if score == "f1":
        matches = match_boxes(pred, gold, threshold, matching)
        tp = sum(iou for _, _, iou in matches) if soft else float(len(matches))
        return 2.0 * tp / (len(pred) + len(gold))
    free, hits, total = set(range(len(gold))), 0, 0.0
    for k, box in enumerate(pred, start=1):
        ious = {j: box_iou(box, gold[j]) for j in free}
        best = max(ious, key=lambda j: (ious[j], -j), default=None)
        if best is not None and ious[best] >= threshold:
            free.discard(best)
            hits += 1
            total += (ious[best] if soft else 1.0) * hits / k
    return total / len(gold) * min(1.0, len(gold) / len(pred))


def _gold_boxes(solution: Any, coords: str, width: float | None, height: float | None) -> list[Box] | None:
    """The true boxes; [] only for a solution that says "no objects" ("", "[]" or an empty list); None for one
    that holds no box (a text, a number, None: not a detection target) or an invalid box."""
    boxes = parse_boxes(solution, width, height, coords) if isinstance(solution, str) else boxes_from_json(solution)
    if not boxes:
        empty = solution.strip() in ("", "[]") if isinstance(solution, str) else (
            isinstance(solution, (list, tuple)) and not solution)
        return [] if empty else None
    return boxes if all(box_is_valid(b, width, height, coords) for b in boxes) else None


@register_reward("detection", inline=True, grades=("box",))
def detection_reward(
    completions: list[str],
    solution: list[Any],
    *,
    iou_threshold: float = 0.5,
    matching: str = "greedy",
    score: str = "f1",
    soft: bool = False,
    coords: str = "absolute",
    strict: bool = False,
    max_boxes: int = 100,
    **columns: Any,
) -> list[float | None]:
    """Several predicted boxes against several true boxes (the `solution`: a JSON list of boxes or of objects with
    `bbox_2d`), scored by `detection_score` (`score` "f1" or "ap", `matching` "greedy" or "hungarian" at
    `iou_threshold`, `soft` IoU-weighted). Extra boxes are penalised, so spamming boxes cannot pay; more than
    `max_boxes` predictions pay 0 (and bound the matching work). Parsing, `coords`, `strict` and the image size
    columns as in `iou`; an invalid predicted box counts as an unmatched prediction. A solution with an invalid
    box gives None (fix the data); for answer_type other than "box", None."""
    n = len(completions)
    kinds = per_sample(columns.get("answer_type"), n, "box")
    widths = per_sample(columns.get("width"), n, None)
    heights = per_sample(columns.get("height"), n, None)
    truncated = per_sample(columns.get("completion_truncated"), n, False)
    scores: list[float | None] = []
    for completion, sol, kind, w, h, trunc in zip(completions, solution, kinds, widths, heights, truncated,
                                                  strict=True):
        w = float(w) if w else None
        h = float(h) if h else None
        gold = _gold_boxes(sol, coords, w, h) if kind == "box" else None
        if gold is None:
            scores.append(None)
            continue
        answer = _box_answer(completion, bool(trunc), strict)
        pred = parse_boxes(answer, w, h, coords) if answer else []
        if len(pred) > max_boxes:
            scores.append(0.0)
            continue
        valid = [b if box_is_valid(b, w, h, coords) else (0.0, 0.0, 0.0, 0.0) for b in pred]  # invalid: no overlap
        scores.append(detection_score(valid, gold, iou_threshold, matching, score, soft))
    return scores
