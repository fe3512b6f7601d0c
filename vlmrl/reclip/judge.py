"""Generative reward models (GRMs): judge a retrieved item against the ground truth, in words.

A judge is any callable `judge(query, retrieved, truth) -> Feedback` over `View`s (what it may look at of each side:
text, image, scene description). Built in:

- `SceneGraphJudge`: programmatic, for data with scene descriptions (the built-in scenes). It compares what the
  retrieved item shows or says with what the truth does, and writes the feedback format of feedback.py:
  `[IRRELEVANT] colour: red != blue; relation: left-of != right-of`.
- `ExactJudge`: for user data without scene graphs; relevant iff the retrieved item's caption equals the truth's
  (case and spaces ignored). It gives no reasons, so the reward is the verdict alone.
- `LLMJudge`: an adapter to the LLM judge client of `vlmrl.rewards.judge` (see its docstring).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from PIL import Image

from vlmrl.reclip.feedback import Feedback, Reason, parse_feedback
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


LLM_PROMPT = (
    "You judge a retrieval system. Query: {query}\nGround truth: {truth}\nRetrieved: {retrieved}\n"
    "Does the retrieved item match the ground truth? Answer with [RELEVANT], [PARTIAL] or [IRRELEVANT], then the "
    "reasons separated by ';', each as 'attribute: expected != retrieved' (attributes: colour, shape, count, "
    "relation, missing, extra)."
)


class LLMJudge:
    """An LLM as the GRM, through `vlmrl.rewards.judge.JudgeClient` (an OpenAI-compatible endpoint). The judge sees
    captions: the query's text (or, for an image query, the truth's caption), the truth's and the retrieved item's.
    Its answer is parsed by `vlmrl.rewards.judge.parse_feedback` when that exists, else by feedback.parse_feedback.
    `options` go to the client (endpoint, model, timeouts...)."""

    def __init__(self, options: dict[str, Any] | None = None, client: Callable[[str], str] | None = None):
        self.options = dict(options or {})
        self.client = client or _judge_client(self.options)

    def __call__(self, query: View, retrieved: View, truth: View) -> Feedback:
        prompt = LLM_PROMPT.format(query=query.text or truth.text, truth=truth.text, retrieved=retrieved.text)
        return parse_feedback(self.client(prompt))


def _judge_client(options: dict[str, Any]) -> Callable[[str], str]:
    try:
        from vlmrl.rewards import judge as judge_module  # written by the rewards issue (the LLM judge client)
    except ImportError:
        raise NotImplementedError(
            "judge.name=llm needs vlmrl.rewards.judge (the LLM judge client of the rewards issue), which is not in "
            "this installation yet; use judge.name=scene_graph or exact, or pass LLMJudge(client=callable)") from None
    raise NotImplementedError(  # pragma: no cover - wired once the client's interface is final
        f"vlmrl.rewards.judge exists ({judge_module.__file__}) but the ReCLIP adapter to its JudgeClient is not "
        "written yet; pass LLMJudge(client=callable) with a function prompt -> text")


def build_judge(name: str, options: dict[str, Any] | None = None) -> Judge:
    """`scene_graph`, `exact` or `llm` (see the module docstring)."""
    if name == "scene_graph":
        return SceneGraphJudge()
    if name == "exact":
        return ExactJudge()
    if name == "llm":
        return LLMJudge(options)
    raise ValueError(f"unknown judge {name!r}; use scene_graph, exact or llm")
