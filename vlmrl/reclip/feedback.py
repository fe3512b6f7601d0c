"""Language feedback from a generative reward model: its format, its parser, self-compression, and the reward.

The format (the programmatic judge writes it; an LLM judge is asked for it):

    [RELEVANT]
    [IRRELEVANT] colour: red != blue; relation: left-of != right-of
    [PARTIAL] count: 2 != 3

A verdict in brackets, then reasons separated by ";" or new lines. A reason names an attribute and what the truth
has versus what was retrieved (`attribute: expected != got`); looser spellings such as "colour wrong: red vs blue" or
"Relation reversed" parse too, keeping the attribute. An optional `score: 0.3` entry is the judge's own score.

Reward (`feedback_reward`): the verdict gives the global weight, each reason an attribute-level penalty,

    r = verdict_weights[verdict] - sum_{reason} penalties[attribute(reason)],   clipped to [min_reward, 1].

A graded judge (an LLM judge whose server returns token log-probs, `judge.options.graded`) also gives P(relevant),
the probability it put on [RELEVANT] where it wrote the tag; the verdict's weight is then the expected one,
p * verdict_weights[relevant] + (1 - p) * verdict_weights[irrelevant].

Self-compression (`compress`) keeps only the reasons that bear on the decision before the reward is computed: none
for a relevant verdict, and for the others only mismatches, once each, about attributes the reward knows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

VERDICTS = ("relevant", "partial", "irrelevant")
ATTRIBUTES = ("colour", "shape", "count", "relation", "missing", "extra", "other")
SYNONYMS = {
    "color": "colour", "colours": "colour", "colors": "colour",
    "shapes": "shape", "object": "shape", "objects": "shape",
    "number": "count", "counts": "count", "quantity": "count",
    "relations": "relation", "position": "relation", "spatial": "relation", "layout": "relation",
    "absent": "missing", "additional": "extra", "unexpected": "extra",
}
DEFAULT_VERDICT_WEIGHTS = {"relevant": 1.0, "partial": 0.5, "irrelevant": 0.0}
DEFAULT_PENALTIES = {"colour": 0.25, "shape": 0.25, "count": 0.25, "relation": 0.25, "missing": 0.5, "extra": 0.5,
                     "other": 0.25}

_VERDICT = re.compile(r"^\s*\[\s*(relevant|partial(?:ly relevant)?|irrelevant|not relevant)\s*\]\s*(.*)$",
                      re.IGNORECASE | re.DOTALL)
_SCORE = re.compile(r"^score\s*[:=]\s*([+-]?\d+(?:\.\d*)?|\.\d+)$", re.IGNORECASE)
_PAIR = re.compile(r"^(?P<attr>[\w\s-]+?)\s*(?:wrong|mismatch|differs)?\s*:\s*(?P<a>.+?)\s*(?:!=|≠|\bvs\.?\b|->)\s*"
                   r"(?P<b>.+?)$", re.IGNORECASE)


class FeedbackParseError(ValueError):
    """Judge output that does not start with a [VERDICT]; the message quotes it."""


@dataclass(frozen=True)
class Reason:
    """One reason: an attribute (one of ATTRIBUTES), and when the judge wrote them, the expected and retrieved
    values. `text` is the reason as written."""

    attribute: str
    expected: str | None = None
    got: str | None = None
    text: str = ""

    def is_mismatch(self) -> bool:
        """False only for a reason that states agreement (`colour: red == red`, or equal values)."""
        if "==" in self.text:
            return False
        return self.expected is None or self.got is None or self.expected.lower() != self.got.lower()

    def __str__(self) -> str:
        if self.expected is not None and self.got is not None:
            return f"{self.attribute}: {self.expected} != {self.got}"
        return self.text or self.attribute


@dataclass
class Feedback:
    """A judge's verdict on one retrieved item: verdict (one of VERDICTS), optional score, reasons, and a graded
    judge's P(relevant) (`probability`)."""

    verdict: str
    reasons: list[Reason] = field(default_factory=list)
    score: float | None = None
    probability: float | None = None

    def __str__(self) -> str:
        return format_feedback(self)


def format_feedback(fb: Feedback) -> str:
    """`[IRRELEVANT] colour: red != blue; relation: left-of != right-of` (the parser's inverse)."""
    head = f"[{fb.verdict.upper()}]"
    parts = [str(r) for r in fb.reasons] + ([f"score: {fb.score:g}"] if fb.score is not None else [])
    return f"{head} {'; '.join(parts)}" if parts else head


def attribute_of(name: str) -> str:
    """Map an attribute as a judge wrote it to one of ATTRIBUTES ("Color" -> colour, "position" -> relation);
    unknown names -> "other"."""
    words = re.findall(r"[a-z]+", name.lower())
    for word in words:
        word = SYNONYMS.get(word, word)
        if word in ATTRIBUTES:
            return word
    return "other"


def parse_reason(text: str) -> Reason:
    """One reason: `attribute: expected != got` (also `vs`, `->`, `≠`), or free text naming an attribute."""
    text = text.strip().rstrip(".")
    match = _PAIR.match(text)
    if match:
        return Reason(attribute_of(match["attr"]), match["a"].strip(), match["b"].strip(), text)
    head = text.split(":", 1)[0]
    return Reason(attribute_of(head), text=text)


def parse_feedback(text: str) -> Feedback:
    """Parse a judge's output (see the module docstring). Raises FeedbackParseError without a leading [VERDICT]."""
    match = _VERDICT.match(text or "")
    if not match:
        shown = (text or "")[:120]
        raise FeedbackParseError(f"judge output must start with [RELEVANT], [PARTIAL] or [IRRELEVANT]; got {shown!r}")
    word = match[1].lower()
    verdict = "partial" if word.startswith("partial") else "irrelevant" if word == "not relevant" else word
    reasons, score = [], None
    for part in re.split(r"[;\n]", match[2]):
        part = part.strip().lstrip("-*• ").strip()
        if not part:
            continue
        scored = _SCORE.match(part)
        if scored:
            score = float(scored[1])
        else:
            reasons.append(parse_reason(part))
    return Feedback(verdict, reasons, score)


def compress(fb: Feedback, keep: Mapping[str, float] | None = None) -> tuple[Feedback, int]:
    """Self-compression: keep only the reasons that bear on the decision. A relevant verdict keeps none; otherwise
    agreements, repeats and (when `keep` is given) attributes outside `keep` are dropped. Returns the compressed
    feedback and how many reasons were dropped."""
    if fb.verdict == "relevant":
        return Feedback(fb.verdict, [], fb.score, fb.probability), len(fb.reasons)
    kept, seen = [], set()
    for reason in fb.reasons:
        key = (reason.attribute, (reason.expected or "").lower(), (reason.got or "").lower(), reason.text.lower())
        if not reason.is_mismatch() or key in seen or (keep is not None and reason.attribute not in keep):
            continue
        seen.add(key)
        kept.append(reason)
    return Feedback(fb.verdict, kept, fb.score, fb.probability), len(fb.reasons) - len(kept)


def feedback_reward(fb: Feedback, verdict_weights: Mapping[str, float] = DEFAULT_VERDICT_WEIGHTS,
                    penalties: Mapping[str, float] = DEFAULT_PENALTIES, min_reward: float = -1.0) -> float:
    """r = verdict_weights[verdict] - sum of penalties[attribute] over the reasons, clipped to [min_reward, 1]; a
    graded verdict weighs p * verdict_weights[relevant] + (1 - p) * verdict_weights[irrelevant]."""
    weight = verdict_weights[fb.verdict] if fb.probability is None else \
        fb.probability * verdict_weights["relevant"] + (1 - fb.probability) * verdict_weights["irrelevant"]
    r = weight - sum(penalties.get(reason.attribute, penalties.get("other", 0.0))
                                          for reason in fb.reasons)
    return float(min(1.0, max(min_reward, r)))
