"""Verifiable rewards: accuracy (numbers, text, math, multiple choice), format, counting, length penalty.

Box rewards (iou, giou, detection) are in `boxes.py`; classification in `classification.py`; keywords and the
process-reward hook in `reasoning.py`.

Each reward follows TRL's contract `(completions, **columns) -> list[float | None]`, accepts and ignores unknown
columns, and returns None for samples it does not apply to. Each docstring says what it pays and which exploit
it closes: the policy is an optimiser, and it finds whatever a lenient parser pays for. No completion and no
solution makes a reward raise (tests/test_fuzz.py); a reward raises ValueError only for an option outside its listed
values or a column whose length is not the number of completions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from vlmrl.rewards.boxes import iou_reward
from vlmrl.rewards.columns import is_missing, per_sample
from vlmrl.rewards.parsing import (
    EXTRACT_MODES,
    completion_text,
    extract_answer,
    match_answer_block,
    normalize_text,
    numbers_equal,
    parse_number,
)
from vlmrl.rewards.registry import RewardFailure, register_reward

ANSWER_TYPES = ("number", "text", "box", "math", "choice")


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
    """number if the solution is one number (`3/4` and `\\frac{3}{4}` too); math or text as the data contract infers
    it for files (`vlmrl.data.infer_answer_type`: LaTeX, `^`, a percentage, an interval, digits with operators)."""
    from vlmrl.data.sample import infer_answer_type  # here: reward workers need not import the data package

    first = str(solution[0] if isinstance(solution, (list, tuple)) and solution else solution)
    if parse_number(first, exact=True) is not None:
        return "number"
    return "math" if infer_answer_type(first) == "math" else "text"


def _options(value: Any) -> list[str] | None:
    """Multiple-choice options of a sample: a list (letters A, B, C... by position) or a {letter: text} mapping."""
    if isinstance(value, dict):
        return [str(value[k]) for k in sorted(value)] if value else None
    if isinstance(value, (list, tuple)) and value:
        return [str(v) for v in value]
    return None


def choice_index(answer: str, options: list[str]) -> int | None:
    """The option an answer picks, by letter ("B", "(B)", "B.", "B) blue") or by option text ("blue"), or None.

    Exactly one option may be named: "B, C", "B or C" and a letter whose text contradicts its option ("B. red"
    when B is blue) pick nothing; an option text that several options share picks nothing."""
    letters = [chr(ord("A") + i) for i in range(len(options))]
    marked = re.fullmatch(r"\(?([A-Za-z])\)?(?:\s*[.:)]\s*(.*))?", answer.strip(), flags=re.S)
    if marked and marked.group(1).upper() in letters:
        index, rest = letters.index(marked.group(1).upper()), marked.group(2)
        return index if not rest or normalize_text(rest) == normalize_text(options[index]) else None
    norm = normalize_text(answer)
    hits = [i for i, option in enumerate(options) if norm and normalize_text(option) == norm]
    return hits[0] if len(hits) == 1 else None


@register_reward("accuracy", inline=True, grades=ANSWER_TYPES)
def accuracy_reward(
    completions: list[str],
    solution: list[Any],
    *,
    answer_type: list[str] | str | None = None,
    extract: str = "tag",
    strict: bool = True,
    tolerance: float = 1e-6,
    symbolic: bool = True,
    math_timeout: float = 5.0,
    math_budget: float = 30.0,
    options: list[Any] | None = None,
    choices: list[Any] | None = None,
    completion_truncated: list[bool] | None = None,
    iou_threshold: float = 0.5,
    coords: str = "absolute",
    width: list[Any] | None = None,
    height: list[Any] | None = None,
    **_: Any,
) -> list[float | None]:
    """1.0 if the extracted answer equals `solution`, else 0.0; for answer_type "box", 1.0 if the answer's one box
    has IoU >= `iou_threshold` with the solution box (`iou`, with the same `strict`; `coords`, `width`/`height`
    as there), so a right box pays as a right number does.

    Extraction (`extract`): "tag" = the LAST `<answer>...</answer>` outside `<think>` blocks (a draft answer in the
    reasoning does not count), "boxed" = the last `\\boxed{}`, "last_line", "auto" = tag, then boxed, then last line.
    Comparison by answer_type (inferred from the solution when the column is absent: number if it parses as one,
    math if it is an expression such as "x+1" or "\\frac{1}{2}", else text):
    - number: numeric equality within `tolerance` (relative or absolute); parses ints, floats, fractions "3/4",
      "1,000", non-ASCII digits ('٣', '３') and a number with unit text around it. The answer must hold exactly
      one number, so "3 or 4" pays nothing.
    - text: exact match after `normalize_text` ("The Red." == "red").
    - math: text match, then numeric equality, then (symbolic=True) math-verify's equivalence (LaTeX, intervals,
      sets, `\\pm`, percentages, units; see `mathcheck`) in a worker process, `math_timeout` seconds per
      expression and `math_budget` per batch; a check that runs out of time gives None plus a counted failure,
      never a silent 0 for the batch.
    - choice, or any sample with an `options`/`choices` column: multiple choice; the answer names one option by
      letter or by text (`choice_index`), and pays when it is the solution's option (the solution is a letter or
      an option's text).
    A `solution` that is a list pays when any element matches. An empty answer pays 0. A solution that does not
    parse as its answer_type, or is missing (None, NaN), gives None (fix the data). Raises ValueError only for an
    option or `answer_type` value outside those listed, or a column whose length is not the number of completions.
    strict (default True): the completion must be exactly an optional think block then one answer block, with only
    whitespace around, and not truncated; otherwise 0. This closes a hack seen on this project: with a lenient
    parser the policy stopped emitting its end token and wrote `<answer>5</answer></answer></answer>`.
    """
    n = len(completions)
    kinds = per_sample(answer_type, n, None)
    truncated = per_sample(completion_truncated, n, False)
    option_lists = per_sample(options if options is not None else choices, n, None)
    scores: list[Any] = []
    symbolic_jobs: list[tuple[int, list[tuple[str, str]]]] = []
    box_rows: list[int] = []
    for i, (completion, sol, kind, trunc, opts) in enumerate(
        zip(completions, solution, kinds, truncated, option_lists, strict=True)
    ):
        opts = _options(opts)
        kind = "choice" if opts and kind in (None, "text", "choice") else kind or _infer_answer_type(sol)
        if kind not in ANSWER_TYPES:
            raise ValueError(f"answer_type={kind!r}: expected one of {ANSWER_TYPES}")
        if kind == "box":
            box_rows.append(i)
            scores.append(None)
            continue
        targets = [t for t in (sol if isinstance(sol, (list, tuple)) else [sol]) if not is_missing(t)]
        answer = _select_answer(completion_text(completion), bool(trunc), extract, strict)
        if kind == "choice":
            gold = {choice_index(str(t), opts) for t in targets} - {None} if opts else set()
            pick = choice_index(answer, opts) if answer and opts else None
            scores.append(float(pick in gold) if gold else None)
        elif kind == "number":
            values = [v for v in (parse_number(str(t)) for t in targets) if v is not None]
            pred = parse_number(answer) if answer else None
            ok = pred is not None and any(numbers_equal(pred, v, tolerance) for v in values)
            scores.append(None if not values else float(ok))
        else:
            values = [v for v in (normalize_text(str(t)) for t in targets) if v]
            pred = normalize_text(answer) if answer else None
            ok = bool(pred) and pred in values
            if kind == "math" and not ok and pred:
                pred_number = parse_number(answer, exact=True)
                numbers = [parse_number(str(t), exact=True) for t in targets]
                ok = pred_number is not None and any(v is not None and numbers_equal(pred_number, v, tolerance)
                                                     for v in numbers)
                if not ok and symbolic:
                    symbolic_jobs.append((i, [(answer, str(t)) for t in targets]))
            scores.append(None if not values else float(ok))
    if box_rows:  # IoU >= iou_threshold, scored by `iou`
        rows = lambda column: [column[i] for i in box_rows] if column is not None else None  # noqa: E731
        boxes = iou_reward([completions[i] for i in box_rows], rows(list(solution)), coords=coords,
                           threshold=iou_threshold, strict=strict, answer_type=["box"] * len(box_rows),
                           width=rows(per_sample(width, n, None)), height=rows(per_sample(height, n, None)),
                           completion_truncated=rows(truncated))
        for i, value in zip(box_rows, boxes, strict=True):
            scores[i] = value
    if symbolic_jobs:
        from vlmrl.rewards.mathcheck import symbolic_equal_many

        pairs = [pair for _, job in symbolic_jobs for pair in job]
        results = iter(symbolic_equal_many(pairs, math_timeout, math_budget, tolerance))
        for i, job in symbolic_jobs:
            verdicts = [next(results) for _ in job]
            if any(v is True for v in verdicts):
                scores[i] = 1.0
            elif any(isinstance(v, RewardFailure) for v in verdicts):
                scores[i] = next(v for v in verdicts if isinstance(v, RewardFailure))
    return scores


@register_reward("format", inline=True, grades=())
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
    truncated = per_sample(completion_truncated, len(completions), False)
    scores: list[float | None] = []
    for completion, trunc in zip(completions, truncated, strict=True):
        content = None if trunc else match_answer_block(completion_text(completion), think, tuple(tags), strict)
        scores.append(1.0 if content else 0.0)
    return scores


@register_reward("counting", inline=True, grades=("number",))
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
    truncated = per_sample(completion_truncated, len(completions), False)
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


@register_reward("length", inline=True, grades=())
def length_penalty(
    completions: list[str],
    *,
    max_length: int = 1024,
    cache_length: int = 256,
    min_length: int = 0,
    completion_lengths: list[int] | None = None,
    **_: Any,
) -> list[float | None]:
    """DAPO's soft overlong penalty on the completion length L (tokens from `completion_lengths` when the trainer
    passes it, else characters), with L_max = max_length and L_cache = cache_length:

        r(L) = 0                                  if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max   (linear from 0 down to -1)
             = -1                                 if L > L_max

    It discourages rambling to the generation limit gradually, instead of the cliff of a truncation penalty.
    min_length > 0 also penalises answers that are too short (a policy that learned to skip its reasoning):
    r(L) = (L - L_min) / L_min for L < L_min, linear from -1 at L = 0 up to 0 at L_min.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"need 0 < cache_length <= max_length, got cache_length={cache_length}, max_length={max_length}"
        )
    if not 0 <= min_length <= max_length - cache_length:
        raise ValueError(f"need 0 <= min_length <= max_length - cache_length, got min_length={min_length}")
    lengths = completion_lengths if completion_lengths is not None else [len(completion_text(c)) for c in completions]
    if len(lengths) != len(completions):
        raise ValueError(f"completion_lengths has {len(lengths)} values for {len(completions)} completions")
    soft_start = max_length - cache_length
    scores: list[float | None] = []
    for length in lengths:
        if length < min_length:
            scores.append((length - min_length) / min_length)
        elif length <= soft_start:
            scores.append(0.0)
        elif length <= max_length:
            scores.append((soft_start - length) / cache_length)
        else:
            scores.append(-1.0)
    return scores
