"""Generative reward models (GRMs): judge a retrieved item against the ground truth, in words.

A judge is any callable `judge(query, retrieved, truth) -> Feedback` over `View`s (what it may look at of each side:
text, image, scene description). Built in:

- `SceneGraphJudge`: programmatic, for data with scene descriptions (the built-in scenes). It compares what the
  retrieved item shows or says with what the truth does, and writes the feedback format of feedback.py:
  `[IRRELEVANT] colour: red != blue; relation: left-of != right-of`.
- `ExactJudge`: for user data without scene graphs; relevant iff the retrieved item's caption equals the truth's
  (case and spaces ignored). It gives no reasons, so the reward is the verdict alone.
- `LLMJudge`: an LLM through the judge client of `vlmrl.rewards.judge` (any OpenAI-compatible endpoint).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from PIL import Image

from vlmrl.reclip.feedback import Feedback, Reason, parse_feedback, parse_reason
from vlmrl.reclip.scenes import INVERSE, Description, Group


@dataclass
class View:
    """One side of a judgement: a text (caption), an image, and the scene description when the data has one."""

    text: str | None = None
    image: Image.Image | None = None
    description: Description | None = None


class Judge(Protocol):
    def __call__(self, query: View, retrieved: View, truth: View) -> Feedback: ...


class JudgeError(ValueError):
    """A judge that cannot judge this data (for example, no scene descriptions); says which judge to use instead."""


def _rel(relation: str | None) -> str:
    return relation.replace(" ", "-") if relation else "none"


def _group_reasons(truth: Group, got: Group) -> list[Reason]:
    out = []
    if truth.count != got.count:
        out.append(Reason("count", str(truth.count), str(got.count)))
    if truth.color != got.color:
        out.append(Reason("colour", truth.color, got.color))
    if truth.shape != got.shape:
        out.append(Reason("shape", truth.shape, got.shape))
    return out


def _alignments(n: int, m: int) -> list[list[tuple[int, int]]]:
    """Every one-to-one pairing of min(n, m) truth groups with retrieved groups; in order when either side has more
    than 4 groups (where trying every pairing would be too slow)."""
    if max(n, m) > 4:
        return [[(i, i) for i in range(min(n, m))]]
    if n <= m:
        return [list(enumerate(order)) for order in itertools.permutations(range(m), n)]
    return [[(i, j) for j, i in enumerate(order)] for order in itertools.permutations(range(n), m)]


def compare_descriptions(truth: Description, got: Description) -> list[Reason]:
    """The reasons `got` does not mean `truth` (empty iff they mean the same).

    Groups are aligned to minimise the number of reasons (for two related groups, either order, the relation read
    from the matching side). Aligned groups differ in count, colour and shape; unaligned truth groups are `missing`,
    unaligned retrieved ones `extra`; related groups also compare their relation.
    """
    truth, got = truth.canonical(), got.canonical()
    if truth.key() == got.key():
        return []
    best: list[Reason] | None = None
    for pairs in _alignments(len(truth.groups), len(got.groups)):
        reasons: list[Reason] = []
        for i, j in pairs:
            reasons += _group_reasons(truth.groups[i], got.groups[j])
        reasons += [Reason("missing", g.phrase(), "none") for i, g in enumerate(truth.groups)
                    if i not in {a for a, _ in pairs}]
        reasons += [Reason("extra", "none", g.phrase()) for j, g in enumerate(got.groups)
                    if j not in {b for _, b in pairs}]
        if len(truth.groups) == 2 and len(got.groups) == 2 and len(pairs) == 2:
            same_side = dict(pairs)[0] == 0
            relation = got.relation if same_side else (INVERSE[got.relation] if got.relation else None)
            if relation != truth.relation:
                reasons.append(Reason("relation", _rel(truth.relation), _rel(relation)))
        if best is None or len(reasons) < len(best):
            best = reasons
    return best or [Reason("other", text="different scene")]


class SceneGraphJudge:
    """Programmatic GRM for data with scene descriptions: `[RELEVANT]` iff the retrieved item means the same as the
    truth, else `[IRRELEVANT]` with one reason per differing attribute (`attribute: truth != retrieved`)."""

    def __call__(self, query: View, retrieved: View, truth: View) -> Feedback:
        if truth.description is None or retrieved.description is None:
            raise JudgeError("the scene_graph judge needs scene descriptions (built-in reclip_scenes data); "
                             "for your own captions use judge.name=exact or judge.name=llm")
        reasons = compare_descriptions(truth.description, retrieved.description)
        return Feedback("irrelevant" if reasons else "relevant", reasons)


def _norm(text: str | None) -> str:
    return re.sub(r"\s+", " ", (text or "").strip().lower())


class ExactJudge:
    """Relevant iff the retrieved caption equals the truth's, ignoring case and spaces; no reasons."""

    def __call__(self, query: View, retrieved: View, truth: View) -> Feedback:
        if retrieved.text is None or truth.text is None:
            raise JudgeError("the exact judge compares captions; both items need one")
        return Feedback("relevant" if _norm(retrieved.text) == _norm(truth.text) else "irrelevant")


RECLIP_TEMPLATE = """You judge a retrieval system that matches images with captions.

Query: {question}
Ground truth (what should have been retrieved): {reference}
Retrieved: {prediction}

Does the retrieved item match the ground truth? Give at most {max_reasons} reasons, one per line: "- attribute: \
expected != retrieved" for each mismatch (attributes: colour, shape, count, relation, missing, extra), "+ ..." for an \
agreement. Then end with one line that holds exactly one verdict tag: [RELEVANT] or [IRRELEVANT]."""


class LLMJudge:
    """An LLM as the GRM, through `vlmrl.rewards.judge.JudgeClient` (any OpenAI-compatible endpoint, with its
    retries, bounded concurrency and disk cache). `options` are the client's arguments (`base_url` and `model` are
    required; `api_key_env`, `timeout`, `max_reasons`, `cache_dir`, ...); the prompt is RECLIP_TEMPLATE unless
    `options.template` says otherwise. The judge sees the query (a caption, or the attached query image), the truth's
    caption, and the retrieved item (its caption; for an image, the image attached). Its "-" reasons become
    attribute-level reasons (`parse_reason`); "+" reasons support the match and carry no penalty.

    `client`: instead of an endpoint, any function prompt -> reply text (tests, local models)."""

    remote = True  # ReCLIP's scorer sends a step's judgements at once (judge.options.concurrency in flight)

    def __init__(self, options: dict[str, Any] | None = None, client: Callable[[str], str] | None = None):
        self.options = dict(options or {})
        self.fn = client
        self.client = None if client is not None else _judge_client(self.options)

    def __call__(self, query: View, retrieved: View, truth: View) -> Feedback:
        question, prediction, _, image = judge_fields(query, retrieved, truth)
        if self.fn is not None:
            prompt = RECLIP_TEMPLATE.replace("{question}", question).replace("{reference}", truth.text or "")
            prompt = prompt.replace("{prediction}", prediction).replace("{max_reasons}", "4")
            return parse_feedback(self.fn(prompt))
        fb = self.client.judge(question=question, prediction=prediction, reference=truth.text or "",
                               images=[image] if image is not None else None)
        if fb is None or fb.score is None:
            raise JudgeError(f"LLM judge: {self.client.last_error if fb is None else fb.error}")
        return from_rewards_feedback(fb)


def judge_fields(query: View, retrieved: View, truth: View) -> tuple[str, str, str, Image.Image | None]:
    """What an LLM judge is shown of one retrieval: (question, prediction, reference, the attached image). The query
    (its caption, or "the attached image"), the truth's caption, the retrieved item (its caption; a retrieved image is
    attached, with its caption when it has one; otherwise the query image is attached)."""
    image = retrieved.image if retrieved.image is not None else query.image
    question = query.text or "the attached image"
    prediction = retrieved.text or "the attached image"
    if retrieved.image is not None:
        prediction = "the attached image" + (f" (captioned: {retrieved.text})" if retrieved.text else "")
    return question, prediction, truth.text or "", image


def from_rewards_feedback(fb: Any) -> Feedback:
    """`vlmrl.rewards.feedback.Feedback` (verdict tag or 0-10 score, +/- reasons) -> ReCLIP's Feedback: the tag
    gives the verdict (a score alone: 1 relevant, 0 irrelevant, else partial); "-" and unsigned reasons are parsed
    into attribute-level reasons; a graded judge's P(RELEVANT) is kept (`Feedback.probability`)."""
    if fb.verdict in ("RELEVANT", "IRRELEVANT"):
        verdict = fb.verdict.lower()
    else:
        verdict = "relevant" if fb.score >= 1.0 else "irrelevant" if fb.score <= 0.0 else "partial"
    reasons = [parse_reason(text) for text, sign in zip(fb.reasons, fb.signals, strict=True) if sign <= 0]
    # a tag's 1/0 score says nothing more than the tag
    return Feedback(verdict, reasons, None if fb.verdict else fb.score, fb.probability)


def _judge_client(options: dict[str, Any]):
    from vlmrl.rewards.judge import JudgeClient  # the rewards' LLM judge client: retries, concurrency, disk cache

    missing = [k for k in ("base_url", "model") if not options.get(k)]
    if missing:
        raise JudgeError(f"judge.name=llm needs judge.options.{missing[0]} (e.g. judge.options="
                         "{base_url: http://127.0.0.1:8000/v1, model: qwen2.5-vl-7b})")
    settings = dict(options)
    settings.setdefault("template", RECLIP_TEMPLATE)
    base_url, model = settings.pop("base_url"), settings.pop("model")
    try:
        return JudgeClient(base_url, model, **settings)
    except TypeError as error:
        raise JudgeError(f"judge.options: {error}; see vlmrl.rewards.judge.JudgeClient for the options") from None


def build_judge(name: str, options: dict[str, Any] | None = None) -> Judge:
    """`scene_graph`, `exact` or `llm` (see the module docstring)."""
    if name == "scene_graph":
        return SceneGraphJudge()
    if name == "exact":
        return ExactJudge()
    if name == "llm":
        return LLMJudge(options)
    raise ValueError(f"unknown judge {name!r}; use scene_graph, exact or llm")
