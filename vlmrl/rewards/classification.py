"""Classification reward: one normalised label, optional synonyms, nothing for an empty answer or several labels.

Peers' classification rewards paid an empty answer (a substring test: "" is in every label) and an answer that lists
several labels ("cat, dog, bird" contains "cat"). Here the answer must name exactly one label.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from vlmrl.rewards.parsing import normalize_text
from vlmrl.rewards.registry import register_reward
from vlmrl.rewards.verifiable import _select_answer, is_missing, per_sample

_SEPARATORS = re.compile(r"\s*(?:[,;/|&+\n]|\band\b|\bor\b)\s*")


def synonym_table(synonyms: Mapping[str, Sequence[str]] | None) -> dict[str, str]:
    """{normalised variant: normalised label} from {label: [variants]}; each label maps to itself."""
    table: dict[str, str] = {}
    for label, variants in (synonyms or {}).items():
        canonical = normalize_text(str(label))
        for variant in [label, *([variants] if isinstance(variants, str) else variants)]:
            table[normalize_text(str(variant))] = canonical
    return table


def _canonical(text: str, table: dict[str, str]) -> str:
    norm = normalize_text(text)
    return table.get(norm, norm)


def named_labels(answer: str, labels: Sequence[str], table: dict[str, str]) -> set[str]:
    """Canonical labels (and synonyms) that `answer` mentions as whole words, longest names first, so "dark red"
    is one mention, not also "red"."""
    text = f" {normalize_text(answer)} "
    names = {normalize_text(str(label)): _canonical(str(label), table) for label in labels}
    names.update({variant: canonical for variant, canonical in table.items()})
    found: set[str] = set()
    for name in sorted((n for n in names if n), key=len, reverse=True):
        pattern = rf"(?<![\w]){re.escape(name)}(?![\w])"
        if re.search(pattern, text):
            found.add(names[name])
            text = re.sub(pattern, " ", text)
    return found


@register_reward("classification", inline=True, grades=("text", "choice"))
def classification_reward(
    completions: list[str],
    solution: list[Any],
    *,
    labels: list[Any] | None = None,
    synonyms: Mapping[str, Sequence[str]] | None = None,
    extract: str = "tag",
    strict: bool = True,
    completion_truncated: list[bool] | None = None,
    **_: Any,
) -> list[float | None]:
    """1.0 when the answer names exactly one label and it is the solution's, else 0.0 (None for an empty solution).

    The answer is selected as in `accuracy` (`extract`, `strict`). Labels compare after `normalize_text` and the
    `synonyms` mapping ({label: [variants]}, e.g. {"car": ["automobile"]}). An empty answer pays 0. An answer that
    lists several labels pays 0: split on `,` `;` `/` `|` `&` `+`, "and", "or", two parts naming different labels
    is a list. With the label set (`labels`: a kwarg, or a column of per-sample lists) the answer may be a phrase
    ("It is a cat.") that mentions exactly one label; without it, the whole answer must be the label.
    A solution that is a list pays when any element matches; an empty or missing (None, NaN) solution gives None. Raises
    ValueError only for an `extract` mode outside those listed or a column of the wrong length."""
    n = len(completions)
    table = synonym_table(synonyms)
    truncated = per_sample(completion_truncated, n, False)
    label_sets = per_sample(labels if labels and isinstance(labels[0], (list, tuple)) else None, n, labels)
    scores: list[float | None] = []
    for completion, sol, trunc, label_set in zip(completions, solution, truncated, label_sets, strict=True):
        given = sol if isinstance(sol, (list, tuple)) else [sol]
        targets = {_canonical(str(t), table) for t in given if not is_missing(t)} - {""}
        if not targets:
            scores.append(None)
            continue
        answer = _select_answer(completion if isinstance(completion, str) else str(completion), bool(trunc),
                                extract, strict)
        whole = _canonical(answer, table) if answer else ""
        if not whole:
            scores.append(0.0)
            continue
        known = set(table.values()) | {_canonical(str(x), table) for x in (label_set or [])} | targets
        if whole in known:
            scores.append(float(whole in targets))
            continue
        parts = {_canonical(p, table) for p in _SEPARATORS.split(normalize_text(answer)) if p.strip()}
        if len(parts) > 1:
            scores.append(0.0)  # a list of labels
            continue
        mentioned = named_labels(answer, list(label_set or []), table) if label_set else set()
        scores.append(float(len(mentioned) == 1 and mentioned <= targets))
    return scores
