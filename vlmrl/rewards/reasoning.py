"""Rewards on the reasoning: keyword (visual concept) coverage, and a hook for per-step process rewards.

Visual-RFT's mixed grounding reward gives partial credit when the reasoning names the visual concepts the answer
depends on (the colours and shapes in the image). Naming every concept in the vocabulary would pay that for free,
so concepts that are *not* in the image (`forbidden`) cost as much as a required one earns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from vlmrl.rewards.parsing import completion_text, extract_tag, normalize_text
from vlmrl.rewards.registry import register_reward, resolve_reward
from vlmrl.rewards.verifiable import per_sample

WHERE = ("think", "answer", "all")
AGGREGATES = ("mean", "min", "last", "sum")


def reasoning_text(completion: str, where: str = "think", think_tag: str = "think") -> str:
    """The part of a completion a reasoning reward reads: the think blocks' content ("think"), the answer tag's
    content ("answer"), or everything ("all")."""
    if where not in WHERE:
        raise ValueError(f"where={where!r}: expected one of {WHERE}")
    if where == "all":
        return completion
    if where == "answer":
        return extract_tag(completion, think_tag=think_tag) or ""
    t = re.escape(think_tag)
    blocks = re.findall(rf"<{t}>(.*?)</{t}>", completion, flags=re.S)
    return "\n".join(blocks)


def _mentions(text: str, concepts: Sequence[Any]) -> set[str]:
    norm = f" {normalize_text(text)} "
    return {c for c in (normalize_text(str(x)) for x in concepts) if c and re.search(rf"(?<!\w){re.escape(c)}(?!\w)",
                                                                                    norm)}


@register_reward("keywords", inline=True, grades=())
def keywords_reward(
    completions: list[str],
    *,
    keywords: list[Any] | None = None,
    forbidden: list[Any] | None = None,
    where: str = "think",
    think_tag: str = "think",
    **_: Any,
) -> list[float | None]:
    """Partial credit for naming the required visual concepts in the reasoning:

        r = max(0, |required named| - |forbidden named|) / |required|

    `keywords` (required) and `forbidden` are per-sample lists (dataset columns) or one list for every sample (a
    reward kwarg). Concepts match as whole words after `normalize_text` ("Red" names "red"; "redder" does not).
    None when a sample has no required concepts. `where`: "think" (default), "answer" or "all"."""
    n = len(completions)
    required_lists = per_sample(keywords if keywords and isinstance(keywords[0], (list, tuple)) else None, n,
                                keywords)
    forbidden_lists = per_sample(forbidden if forbidden and isinstance(forbidden[0], (list, tuple)) else None, n,
                                 forbidden)
    scores: list[float | None] = []
    for completion, required, banned in zip(completions, required_lists, forbidden_lists, strict=True):
        wanted = {normalize_text(str(k)) for k in (required or [])} - {""}
        if not wanted:
            scores.append(None)
            continue
        text = reasoning_text(completion_text(completion), where, think_tag)
        hits = len(_mentions(text, sorted(wanted)))
        misses = len(_mentions(text, [b for b in (banned or []) if normalize_text(str(b)) not in wanted]))
        scores.append(max(0, hits - misses) / len(wanted))
    return scores


SPLITS = {"lines": r"\n", "sentences": r"(?<=[.!?])\s+|\n", "paragraphs": r"\n\s*\n"}


def split_steps(text: str, split: str = "lines") -> list[str]:
    """Reasoning steps: non-empty lines ("lines"), sentences ("sentences"), or paragraphs ("paragraphs")."""
    return [text[a:b] for a, b in _piece_spans(text, 0, len(text), split)]


def _piece_spans(text: str, start: int, end: int, split: str) -> list[tuple[int, int]]:
    """Character spans of the non-empty, whitespace-stripped pieces of text[start:end] between `split`'s separators."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected lines, sentences or paragraphs")
    spans, pos = [], start
    cuts = [(start + m.start(), start + m.end()) for m in re.finditer(SPLITS[split], text[start:end])]
    for cut_start, cut_end in [*cuts, (end, end)]:
        piece = text[pos:cut_start]
        if piece.strip():
            lead = len(piece) - len(piece.lstrip())
            spans.append((pos + lead, pos + len(piece.rstrip())))
        pos = cut_end
    return spans


NO_STEPS = "no reasoning steps: a process reward model scores an answer by its steps"  # a PRM's failure reason


def step_spans(completion: str, split: str = "lines", think_tag: str = "think") -> list[tuple[int, int]]:
    """Character spans [start, end) of a completion's reasoning steps, in order: the steps of its think blocks, or,
    when they hold no text, of everything outside its last answer block. What the `process` reward scores and where
    a process reward model reads a step's score (after the step's last token)."""
    t = re.escape(think_tag)
    blocks = [m.span(1) for m in re.finditer(rf"<{t}>(.*?)</{t}>", completion, flags=re.S)]
    if not any(completion[a:b].strip() for a, b in blocks):
        answers = list(re.finditer(r"<answer>.*?</answer>", completion, flags=re.S))
        last = answers[-1].span() if answers else (len(completion), len(completion))
        blocks = [(0, last[0]), (last[1], len(completion))]
    return [span for a, b in blocks for span in _piece_spans(completion, a, b, split)]


@register_reward("process")
def process_reward(
    completions: list[str],
    *,
    step_fn: str,
    aggregate: str = "mean",
    split: str = "lines",
    think_tag: str = "think",
    **columns: Any,
) -> list[float | None]:
    """Hook for per-step process rewards: the reasoning (think blocks, or the text outside the answer when there is
    none) is split into steps (`split_steps`), and `step_fn` ("file.py:function" or "module:function") scores each:

        step_fn(step: str, index: int, steps: list[str], **sample_columns) -> float | None

    with this sample's value of every column. Step scores that are None are skipped; the rest are aggregated by
    `aggregate` (mean, min, last, sum). None when no step was scored. This reward runs user code, so it runs in a
    worker process under the spec's time limit."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate={aggregate!r}: expected one of {AGGREGATES}")
    scorer = resolve_reward(step_fn)
    n = len(completions)
    rows = {k: per_sample(v, n, None) for k, v in columns.items()}
    scores: list[float | None] = []
    for i, completion in enumerate(completions):
        text = completion_text(completion)
        steps = [text[a:b] for a, b in step_spans(text, split, think_tag)]
        sample = {k: v[i] for k, v in rows.items()}
        values = [v for v in (scorer(step, j, steps, **sample) for j, step in enumerate(steps)) if v is not None]
        if not values:
            scores.append(None)
        elif aggregate == "mean":
            scores.append(sum(values) / len(values))
        elif aggregate == "min":
            scores.append(min(values))
        elif aggregate == "last":
            scores.append(values[-1])
        else:
            scores.append(sum(values))
    return scores
