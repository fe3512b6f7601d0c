"""Verifiable rewards: accuracy, format, IoU/GIoU, counting, overlong length penalty.

Each reward follows TRL's contract `(completions, **columns) -> list[float | None]`, accepts and ignores unknown
columns, and returns None for samples it does not apply to. Each docstring says what it pays and which exploit
it closes: the policy is an optimiser, and it finds whatever a lenient parser pays for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vlmrl.rewards.parsing import (
    EXTRACT_MODES,
    Box,
    box_is_valid,
    boxes_from_json,
    completion_text,
    extract_answer,
    extract_tag,
    match_answer_block,
    normalize_text,
    numbers_equal,
    parse_boxes,
    parse_number,
    strip_think,
)
from vlmrl.rewards.registry import register_reward

ANSWER_TYPES = ("number", "text", "box")


def _per_sample(value: Any, n: int, default: Any) -> list[Any]:
    """A column as n values: missing -> `default` repeated; a scalar (e.g. set once in RewardSpec.kwargs) -> repeated."""
    if value is None:
        return [default] * n
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # a tensor or numpy array
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"column has {len(value)} values for {n} completions")
    return list(value)


def _select_answer(completion: str, truncated: bool, extract: str, strict: bool) -> str | None:
    """The answer text a reward grades, or None.

    strict: the completion must be exactly `[<think>...</think>] <answer>...</answer>` with only whitespace around,
    and not truncated; the answer is then the block's content (extract="boxed"/"last_line" look inside it).
    Non-strict: `extract_answer(completion, extract)`, truncated or not."""
    if extract not in EXTRACT_MODES:
        raise ValueError(f"extract={extract!r}: expected one of {EXTRACT_MODES}")
    if not strict:
        return extract_answer(completion, extract)
    if truncated:
        return None
    content = match_answer_block(completion, think=None)
    if content is None or extract in ("tag", "auto"):
        return content
    return extract_answer(content, extract)


def _infer_answer_type(solution: Any) -> str:
    first = solution[0] if isinstance(solution, (list, tuple)) and solution else solution
    return "number" if parse_number(str(first), exact=True) is not None else "text"


@register_reward("accuracy")
def accuracy_reward(
    completions: list[str],
    solution: list[Any],
    *,
    answer_type: list[str] | str | None = None,
    extract: str = "tag",
    strict: bool = True,
    tolerance: float = 1e-6,
    completion_truncated: list[bool] | None = None,
    **_: Any,
) -> list[float | None]:
    """1.0 if the extracted answer equals `solution`, else 0.0; None for answer_type "box" (see `iou`).

    Extraction (`extract`): "tag" = the LAST `<answer>...</answer>` outside `<think>` blocks (a draft answer in the
    reasoning does not count), "boxed" = the last `\\boxed{}`, "last_line", "auto" = tag, then boxed, then last line.
    Comparison by answer_type (inferred from the solution when the column is absent: number if it parses as one):
    - number: numeric equality within `tolerance` (relative or absolute); parses ints, floats, fractions "3/4",
      "1,000", non-ASCII digits ('٣', '３') and a number with unit text around it. The answer must hold exactly
      one number, so "3 or 4" pays nothing.
    - text: exact match after `normalize_text` ("The Red." == "red").
    A `solution` that is a list pays when any element matches. An empty answer pays 0. A solution that does not
    parse as its answer_type gives None (fix the data).
    strict (default True): the completion must be exactly an optional think block then one answer block, with only
    whitespace around, and not truncated; otherwise 0. This closes a hack seen on this project: with a lenient
    parser the policy stopped emitting its end token and wrote `<answer>5</answer></answer></answer>`.
    """
    n = len(completions)
    kinds = _per_sample(answer_type, n, None)
    truncated = _per_sample(completion_truncated, n, False)
    scores: list[float | None] = []
    for completion, sol, kind, trunc in zip(completions, solution, kinds, truncated, strict=True):
        kind = kind or _infer_answer_type(sol)
        if kind not in ANSWER_TYPES:
            raise ValueError(f"answer_type={kind!r}: expected one of {ANSWER_TYPES}")
        if kind == "box":
            scores.append(None)
            continue
        targets = sol if isinstance(sol, (list, tuple)) else [sol]
        answer = _select_answer(completion_text(completion), bool(trunc), extract, strict)
        if kind == "number":
            values = [v for v in (parse_number(str(t)) for t in targets) if v is not None]
            pred = parse_number(answer) if answer else None
            ok = pred is not None and any(numbers_equal(pred, v, tolerance) for v in values)
        else:
            values = [v for v in (normalize_text(str(t)) for t in targets) if v]
            pred = normalize_text(answer) if answer else None
            ok = bool(pred) and pred in values
        scores.append(None if not values else float(ok))
    return scores


@register_reward("format")
def format_reward(
    completions: list[str],
    *,
    think: bool = True,
    tags: Sequence[str] = ("think", "answer"),
    strict: bool = True,
    completion_truncated: list[bool] | None = None,
    **_: Any,
) -> list[float | None]:
    """1.0 if the completion has the answer format, else 0.0.

    Format: think=True: `<think>...</think>` then `<answer>...</answer>`; think=False: just `<answer>...</answer>`.
    `tags` = (think_tag, answer_tag). Exactly one answer block outside the reasoning, with a non-empty answer.
    strict (default True): the whole completion is the format, with only whitespace around; non-strict: the
    format appears somewhere. A truncated completion scores 0: without that, a policy that never stops (and
    repeats closing tags) keeps its format reward.
    """
    if isinstance(tags, str) or len(tags) != 2:
        raise ValueError(f"tags={tags!r}: expected (think_tag, answer_tag)")
    truncated = _per_sample(completion_truncated, len(completions), False)
    scores: list[float | None] = []
    for completion, trunc in zip(completions, truncated, strict=True):
        content = None if trunc else match_answer_block(completion_text(completion), think, tuple(tags), strict)
        scores.append(1.0 if content else 0.0)
    return scores


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two valid boxes (x1, y1, x2, y2), areas as (x2 - x1) * (y2 - y1)."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def box_giou(a: Box, b: Box) -> float:
    """Generalised IoU in [-1, 1]: IoU - (C - U) / C, C the area of the smallest box enclosing both, U the union."""
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


def _box_scores(
    metric: Callable[[Box, Box], float], completions: list[str], solution: list[Any], columns: dict[str, Any]
) -> list[float | None]:
    coords = columns["coords"]
    threshold, strict = columns["threshold"], columns["strict"]
    n = len(completions)
    kinds = _per_sample(columns.get("answer_type"), n, "box")
    widths = _per_sample(columns.get("width"), n, None)
    heights = _per_sample(columns.get("height"), n, None)
    truncated = _per_sample(columns.get("completion_truncated"), n, False)
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
        text = completion_text(completion)
        if strict:
            answer = None if trunc else match_answer_block(text, think=None)
        else:
            answer = extract_tag(text)
            answer = strip_think(text) if answer is None else answer
        boxes = parse_boxes(answer, w, h, coords) if answer else []
        if len(boxes) != 1 or not box_is_valid(boxes[0], w, h, coords):
            scores.append(0.0)
            continue
        score = metric(boxes[0], target)
        scores.append(score if threshold is None else float(score >= threshold))
    return scores


@register_reward("iou")
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


@register_reward("giou")
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


@register_reward("counting")
def counting_reward(
    completions: list[str],
    solution: list[Any],
    *,
    extract: str = "tag",
    strict: bool = True,
    completion_truncated: list[bool] | None = None,
    **_: Any,
) -> list[float | None]:
    """1.0 if the answer is the integer `solution`, else 0.0; None when the solution is not an integer.

    The answer is selected as in `accuracy` (`extract`, `strict`: by default the completion must be exactly an
    optional think block and one answer block, not truncated) and must hold exactly one number with an integer
    value: "3", "3.0" and "3 shapes" count as 3; "3.5", "3 or 4" and an empty answer pay 0.
    """
    truncated = _per_sample(completion_truncated, len(completions), False)
    scores: list[float | None] = []
    for completion, sol, trunc in zip(completions, solution, truncated, strict=True):
        target = parse_number(str(sol), exact=True)
        if target is None or not target.is_integer():
            scores.append(None)
            continue
        answer = _select_answer(completion_text(completion), bool(trunc), extract, strict)
        pred = parse_number(answer) if answer else None
        scores.append(float(pred is not None and pred.is_integer() and int(pred) == int(target)))
    return scores


@register_reward("length")
def length_penalty(
    completions: list[str],
    *,
    max_length: int = 1024,
    cache_length: int = 256,
    completion_lengths: list[int] | None = None,
    **_: Any,
) -> list[float | None]:
    """DAPO's soft overlong penalty on the completion length L (tokens from `completion_lengths` when the trainer
    passes it, else characters), with L_max = max_length and L_cache = cache_length:

        r(L) = 0                                  if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max   (linear from 0 down to -1)
             = -1                                 if L > L_max

    It discourages rambling to the generation limit gradually, instead of the cliff of a truncation penalty.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"need 0 < cache_length <= max_length, got cache_length={cache_length}, max_length={max_length}"
        )
    lengths = completion_lengths if completion_lengths is not None else [len(completion_text(c)) for c in completions]
    if len(lengths) != len(completions):
        raise ValueError(f"completion_lengths has {len(lengths)} values for {len(completions)} completions")
    soft_start = max_length - cache_length
    scores: list[float | None] = []
    for length in lengths:
        if length <= soft_start:
            scores.append(0.0)
        elif length <= max_length:
            scores.append((soft_start - length) / cache_length)
        else:
            scores.append(-1.0)
    return scores
