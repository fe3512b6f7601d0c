"""The judge's prompt templates and the parser of its replies: verdict tag or 0-10 score, plus short reasons.

Used by the `judge` reward and by the ReCLIP track (which trains on the reasons), so it is a small pure API:

    fb = parse_feedback("+ the answer names the red circle\\n- it misses the square\\n[RELEVANT]")
    fb.verdict == "RELEVANT"; fb.score == 1.0; fb.reasons == ["the answer names ...", "it misses ..."]
    fb.signals == [1.0, -1.0]
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from vlmrl.rewards.parsing import strip_think

POSITIVE, NEGATIVE = "RELEVANT", "IRRELEVANT"
MAX_REASON_CHARS = 200

VERDICT_TEMPLATE = """You grade an answer to a question about the attached image(s).

Question: {question}
Reference answer: {reference}
Answer to grade: {prediction}

Is the answer correct and relevant to the question and the image? Give at most {max_reasons} short reasons, one per \
line, each starting with "+" if it supports the answer or "-" if it counts against it. Then end with one line that \
holds exactly one verdict tag: [RELEVANT] or [IRRELEVANT]."""

SCORE_TEMPLATE = """You grade an answer to a question about the attached image(s).

Question: {question}
Reference answer: {reference}
Answer to grade: {prediction}

How correct and relevant is the answer, given the question and the image? Give at most {max_reasons} short reasons, \
one per line, each starting with "+" if it supports the answer or "-" if it counts against it. Then end with one \
line "Score: N/10", N an integer from 0 (wrong or irrelevant) to 10 (fully correct)."""

TEMPLATES = {"verdict": VERDICT_TEMPLATE, "score": SCORE_TEMPLATE}
_VERDICT = re.compile(rf"\[\s*({NEGATIVE}|{POSITIVE})\s*\]", flags=re.I)
_SCORE = re.compile(r"\bscore\b\s*[:=]?\s*\[?\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*10)?\s*\]?", flags=re.I)
_BULLET = re.compile(r"^\s*(?:([+\-\u2212])|[*\u2022]|\d+[.)])\s*(.+)$")


@dataclass
class Feedback:
    """A parsed judge reply.

    verdict: "RELEVANT" / "IRRELEVANT", or None (no tag, or both tags).
    score: the scalar reward in [0, 1]: 1.0 / 0.0 from the verdict (a graded judge: `probability`), else the 0-10
        rating / 10, else None.
    reasons: at most `max_reasons` short reasons, in order; signals: +1.0 (a "+" reason), -1.0 ("-"), 0.0 (other).
    raw: the reply as received; error: why no score could be read (None when `score` is set).
    probability: a graded judge's P(RELEVANT) at the token that decided the verdict (`verdict_probability`)."""

    verdict: str | None
    score: float | None
    reasons: list[str] = field(default_factory=list)
    signals: list[float] = field(default_factory=list)
    raw: str = ""
    error: str | None = None
    probability: float | None = None

    def to_dict(self) -> dict:
        return {"verdict": self.verdict, "score": self.score, "reasons": self.reasons, "signals": self.signals,
                "raw": self.raw, "error": self.error, "probability": self.probability}


def fill_template(template: str, **values: object) -> str:
    """`template` with each `{name}` of `values` replaced (question, prediction, reference, max_reasons); any other
    brace is left alone, so a template may show JSON."""
    out = template
    for name, value in values.items():
        out = out.replace("{" + name + "}", str(value))
    return out


def parse_feedback(text: str, max_reasons: int | None = None) -> Feedback:
    """Parse a judge reply into a Feedback. Reasoning in `<think>` blocks is ignored.

    Verdict: a `[RELEVANT]` or `[IRRELEVANT]` tag (any case); a reply holding both is ambiguous and gets no verdict,
    so a judge (or a prompt injection in the graded answer that it echoes) cannot pay by listing both. Rating: the
    last "Score: N", "Score: N/10" or "[Score: N]" with 0 <= N <= 10 (outside that range: no rating). Reasons:
    bulleted lines ("+", "-", "*", "•", "1.", "1)") other than the verdict or score line, each cut at 200
    characters, at most `max_reasons` of them."""
    body = strip_think(text or "")
    verdicts = {m.group(1).upper() for m in _VERDICT.finditer(body)}
    verdict = next(iter(verdicts)) if len(verdicts) == 1 else None
    rating = None
    scores = list(_SCORE.finditer(body))
    if scores:
        value = float(scores[-1].group(1))
        rating = value if 0.0 <= value <= 10.0 else None
    reasons, signals = [], []
    for line in body.splitlines():
        if _VERDICT.search(line) or _SCORE.search(line):
            continue
        bullet = _BULLET.match(line)
        if bullet and bullet.group(2).strip():
            sign = bullet.group(1)
            reasons.append(bullet.group(2).strip()[:MAX_REASON_CHARS])
            signals.append(1.0 if sign == "+" else -1.0 if sign in ("-", "\u2212") else 0.0)
    if max_reasons is not None:
        reasons, signals = reasons[:max_reasons], signals[:max_reasons]
    if verdict is not None:
        score: float | None = 1.0 if verdict == POSITIVE else 0.0
    else:
        score = rating / 10.0 if rating is not None else None
    error = None
    if score is None:
        error = "the reply holds both verdict tags" if len(verdicts) > 1 else "no verdict tag or score in the reply"
    return Feedback(verdict, score, reasons, signals, text or "", error)


def verdict_probability(entries: list[dict] | None) -> float | None:
    """P(RELEVANT) at the token that decides the reply's last verdict tag, from the reply's per-token log-probs
    (OpenAI's `choices[0].logprobs.content`: each entry's `token`, `logprob` and `top_logprobs`); None when the
    entries do not show the decision (no entries, no tag in them, or the tag's token has no alternatives listed).

    The two tags agree up to their second character ("[R..." vs "[IR..."). At the token that writes that character,
    every listed alternative that continues the same text up to it and then writes the start of one tag counts
    toward that tag: P = m(RELEVANT) / (m(RELEVANT) + m(IRRELEVANT)), each m the sum of its alternatives'
    probabilities (the token written counts once, listed or not). A tag the alternatives never start has m = 0."""
    if not entries:
        return None
    texts = [str(e.get("token", "")) for e in entries]
    text = "".join(texts)
    tags = list(_VERDICT.finditer(text))
    if not tags:
        return None
    at = tags[-1].start(1)  # the tag's first letter: where the two tags differ
    start, k = 0, 0  # entry k writes text[start:start + len(texts[k])], the character at `at` among it
    while start + len(texts[k]) <= at:
        start += len(texts[k])
        k += 1
    entry, piece = entries[k], texts[k]
    if not entry.get("top_logprobs"):
        return None
    before = text[start:at]  # what the deciding token writes before the tags differ (often "[" or nothing)
    options = {piece: float(entry["logprob"]), **{str(o.get("token", "")): float(o["logprob"])
                                                  for o in entry.get("top_logprobs") or []}}
    mass = {POSITIVE: 0.0, NEGATIVE: 0.0}
    for token, logprob in options.items():
        if not token.startswith(before) or len(token) == len(before):
            continue
        rest = token[len(before):].upper().lstrip()
        for tag in (POSITIVE, NEGATIVE):
            if rest and (f"{tag}]".startswith(rest) or rest.startswith(tag)):
                mass[tag] += math.exp(logprob)
    total = mass[POSITIVE] + mass[NEGATIVE]
    return mass[POSITIVE] / total if total > 0 else None
