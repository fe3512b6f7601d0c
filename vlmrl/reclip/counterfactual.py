"""Counterfactual captions: a judge's reasons applied to the truth's caption, as negatives the student must separate.

A reason `colour: red != blue` says the retrieved item shows blue where the truth has red. Applied to the truth's
caption ("a red circle to the left of two green squares") it gives a caption one edit away that means something
else ("a blue circle to the left of two green squares"): the minimal pair the student confused, named by the judge.
Each reason is applied alone (one caption per place its value occurs), and all of a feedback's reasons together in
one simultaneous substitution (so `colour: red != blue; colour: blue != red` swaps the two colours: a binding
negative). Only what the words say is used; the scene description is never read.

Routing a reason to its caption span, per attribute:

- colour, shape, other: the expected value as a word (shapes also in the plural) -> the retrieved value;
- count: the expected count as a number word ("a", "one", "two", ... or a digit) -> the retrieved count, with the
  following noun turned singular or plural when the count crosses one;
- relation: "left-of" -> "right-of" as a phrase ("left of" -> "right of"); a caption that states the relation from
  the other side ("B to the right of A") gets the inverse edit ("right of" -> "left of" there);
- missing, extra, and values not found in the caption: not routed (counted by the caller).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from vlmrl.data.shapes import PLURAL
from vlmrl.reclip.feedback import Feedback, Reason

NUMBER_WORDS = {1: ("a", "an", "one"), 2: ("two",), 3: ("three",), 4: ("four",), 5: ("five",), 6: ("six",),
                7: ("seven",), 8: ("eight",), 9: ("nine",), 10: ("ten",)}
INVERSE_RELATIONS = {"left of": "right of", "right of": "left of", "above": "below", "below": "above",
                     "in front of": "behind", "behind": "in front of", "on top of": "under", "under": "on top of"}
SINGULAR = {plural: single for single, plural in PLURAL.items()}
ROUTED = ("colour", "shape", "count", "relation", "other")


def _plural(word: str) -> str:
    return PLURAL.get(word, word + ("es" if word.endswith(("s", "x", "ch", "sh")) else "s"))


def _count_of(value: str | None) -> int | None:
    value = (value or "").strip().lower()
    if value.isdigit():
        return int(value)
    return next((n for n, words in NUMBER_WORDS.items() if value in words), None)


def _relation(value: str | None) -> str:
    return re.sub(r"[\s_-]+", " ", (value or "").strip().lower()).removeprefix("to the ").strip()


def _phrase(relation: str, to_the: bool) -> str:
    """"to the left of" where the caption said "to the ..." or a bare "above"/"below"; else the bare words."""
    return f"to the {relation}" if to_the and relation in ("left of", "right of") else relation


def _word(text: str) -> str:
    return r"(?<![\w-])" + re.escape(text) + r"(?![\w-])"


def _spans(caption: str, reason: Reason) -> list[tuple[int, int, str]]:
    """Every (start, end, replacement) where `reason` routes into `caption` (see the module docstring)."""
    attr, low = reason.attribute, caption.lower()
    if attr not in ROUTED or not reason.expected or not reason.got or not reason.is_mismatch():
        return []
    if attr == "relation":
        expected, got = _relation(reason.expected), _relation(reason.got)
        pairs = [(expected, got)]
        if expected in INVERSE_RELATIONS and got in INVERSE_RELATIONS:
            pairs.append((INVERSE_RELATIONS[expected], INVERSE_RELATIONS[got]))
        for old, new in pairs:
            found = [(m.start(), m.end(), _phrase(new, bool(m[1]) or old in ("above", "below"))) for m in re.finditer(
                r"(?<![\w-])(to the )?" + re.escape(old) + r"(?![\w-])", low)] if old and new else []
            if found:
                return found
        return []
    if attr == "count":
        old, new = _count_of(reason.expected), _count_of(reason.got)
        if old is None or new is None:
            return []
        words = NUMBER_WORDS.get(old, ()) + (str(old),)
        spelled = str(new) if new > 10 else NUMBER_WORDS[new][0]
        out = []
        for word in words:
            for m in re.finditer(_word(word), low):
                vowel = re.match(r"\s*[aeiou]", low[m.end():]) is not None
                out.append((m.start(), m.end(), ("an" if vowel else "a") if new == 1 else spelled))
        return sorted(out)
    expected, got = reason.expected.lower(), reason.got.lower()
    out = [(m.start(), m.end(), got) for m in re.finditer(_word(expected), low)]
    if attr == "shape":
        out += [(m.start(), m.end(), _plural(got)) for m in re.finditer(_word(_plural(expected)), low)]
    return sorted(out)


def _fix_number(text: str, start: int, count: int) -> str:
    """After a count edit at `start`: the noun among the next three words agrees with `count`."""
    head, tail = text[:start], text[start:]
    words = tail.split(" ")
    for i in range(1, min(4, len(words))):
        word = words[i].lower()
        if count == 1 and word in SINGULAR:
            words[i] = SINGULAR[word]
            break
        if count != 1 and word in PLURAL:
            words[i] = PLURAL[word]
            break
        if word in SINGULAR.values() or word in PLURAL.values():
            break
    return head + " ".join(words)


def _apply(caption: str, spans: list[tuple[int, int, str, Reason]]) -> str:
    """Replace non-overlapping spans (right to left, so offsets hold), then fix noun number after count edits."""
    chosen, end = [], -1
    for span in sorted(spans, key=lambda s: s[0]):
        if span[0] >= end:
            chosen.append(span)
            end = span[1]
    out = caption
    for start, stop, new, reason in reversed(chosen):
        out = out[:start] + new + out[stop:]
        if reason.attribute == "count":
            out = _fix_number(out, start, _count_of(reason.got) or 1)
    return out


def counterfactuals(caption: str, feedback: Feedback, limit: int | None = None) -> tuple[list[str], int]:
    """Captions that mean what the retrieved item shows in one respect (or all routed respects) instead of what the
    truth's `caption` says. Returns (captions, reasons not routed): the joint edit first when the feedback has two or
    more routed reasons, then each reason alone at each place it routes to; none equal to `caption`; at most
    `limit`."""
    out: list[str] = []
    unrouted, joint = 0, []
    for reason in feedback.reasons:
        spans = _spans(caption, reason)
        if not spans:
            unrouted += 1
            continue
        joint.append(spans[0] + (reason,))
        out += [_apply(caption, [span + (reason,)]) for span in spans]
    if len(joint) > 1:
        out.insert(0, _apply(caption, joint))
    low = caption.lower()
    seen, kept = set(), []
    for text in out:
        if text.lower() != low and text.lower() not in seen:
            seen.add(text.lower())
            kept.append(text)
    return kept[:limit] if limit is not None else kept, unrouted


def gather(caption: str, feedbacks: Iterable[Feedback], limit: int) -> tuple[list[str], int]:
    """Up to `limit` distinct counterfactual captions of one truth from its judged candidates' feedback, in the
    candidates' order (the student's likeliest confusions first); and how many reasons could not be routed."""
    out: list[str] = []
    unrouted = 0
    for fb in feedbacks:
        if len(out) >= limit:
            break
        texts, missed = counterfactuals(caption, fb)
        unrouted += missed
        out += [t for t in texts if t not in out][:limit - len(out)]
    return out, unrouted
