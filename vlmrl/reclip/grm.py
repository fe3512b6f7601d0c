"""A generative reward model made with vlmrl: judging retrievals as a task a VLM learns, and how far a judge agrees
with the programmatic one.

The loop (docs/reclip.md, "Train your own judge"), every step on a CPU:

    vlmrl reclip grm-data data/grm                       # judged retrievals of the built-in scenes, as data files
    vlmrl train recipes/reclip_grm.yaml                  # SFT, then RL paid by agreement with the programmatic judge
    vlmrl serve runs/reclip_grm --port 8001              # an OpenAI-compatible endpoint
    vlmrl reclip grm-eval --base-url http://127.0.0.1:8001/v1 --model reclip_grm   # agreement, reason P/R
    vlmrl reclip train judge.name=llm judge.options="{base_url: http://127.0.0.1:8001/v1, model: reclip_grm, ...}"

A row is one retrieval as ReCLIP's LLM judge sends it (`judge_fields` with GRM_TEMPLATE, the image attached) and, as
its solution, the programmatic judge's verdict and reasons written as a judge reply (`reply_text`):

    - colour: red != blue
    - relation: left-of != right-of
    [IRRELEVANT]

so the served model is asked exactly what it learned, and its reply goes through the same parsers as any LLM judge.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vlmrl.eval.metrics import wilson_interval
from vlmrl.reclip.feedback import Feedback, Reason
from vlmrl.reclip.judge import SceneGraphJudge, View, from_rewards_feedback, judge_fields
from vlmrl.reclip.scenes import CaptionItem, caption
from vlmrl.rewards.feedback import fill_template, parse_feedback
from vlmrl.rewards.parsing import completion_text
from vlmrl.rewards.registry import RewardFailure, register_reward

# What the learned judge is asked: short (the tiny VLM reads every token), the fields ReCLIP's LLM judge fills.
GRM_TEMPLATE = "Ground truth: {reference}\nRetrieved: {prediction}"
MAX_REASONS = 4  # reasons a reply keeps (the first ones, in the programmatic judge's order)
KINDS = ("truth", "near", "random")  # what a row's retrieved item is; see judged_retrievals


@dataclass
class Retrieval:
    """One judged retrieval: the views a judge is given and the programmatic judge's feedback on them."""

    direction: str  # "t2i" (a caption retrieved an image) or "i2t" (an image retrieved a caption)
    kind: str  # one of KINDS
    query: View
    retrieved: View
    truth: View
    gold: Feedback


def reply_text(fb: Feedback, max_reasons: int = MAX_REASONS) -> str:
    """A feedback as a judge's reply: one "- attribute: expected != got" line per reason (the first `max_reasons`),
    then the verdict tag. `vlmrl.rewards.feedback.parse_feedback` + `judge.from_rewards_feedback` read it back."""
    lines = [f"- {reason}" for reason in fb.reasons[:max_reasons]]
    return "\n".join([*lines, f"[{fb.verdict.upper()}]"])


def read_reply(text: str, max_reasons: int = MAX_REASONS) -> Feedback | None:
    """A judge's reply as ReCLIP reads it through the LLM judge path; None when it holds no verdict."""
    fb = parse_feedback(text, max_reasons=max_reasons)
    return None if fb.score is None else from_rewards_feedback(fb)


def reason_key(reason: Reason) -> tuple[str, str, str]:
    """A reason's identity for agreement: attribute and both values, case and spacing ignored."""
    def norm(value: str | None) -> str:
        return " ".join((value or "").lower().split())

    return reason.attribute, norm(reason.expected), norm(reason.got)


def compare(predicted: Feedback | None, gold: Feedback, max_reasons: int = MAX_REASONS) -> tuple[bool, int, int, int]:
    """(verdict agrees, reasons in both, predicted reasons, gold reasons) for one judgement; the gold keeps its first
    `max_reasons` reasons (what the judge was asked for), and so does the prediction (a reply's further reasons are
    not read: `read_reply`); a missing prediction agrees on nothing."""
    gold_keys = Counter(reason_key(r) for r in gold.reasons[:max_reasons])
    if predicted is None:
        return False, 0, 0, sum(gold_keys.values())
    pred_keys = Counter(reason_key(r) for r in predicted.reasons[:max_reasons])
    return (predicted.verdict == gold.verdict, sum((pred_keys & gold_keys).values()), sum(pred_keys.values()),
            sum(gold_keys.values()))


def agreement_score(predicted: Feedback | None, gold: Feedback, max_reasons: int = MAX_REASONS) -> float:
    """The learned judge's reward: half for the verdict, half for the reasons' F1 (1 when neither has any)."""
    verdict, both, n_pred, n_gold = compare(predicted, gold, max_reasons)
    if predicted is None:
        return 0.0
    f1 = 1.0 if n_pred == n_gold == 0 else 2 * both / (n_pred + n_gold)
    return 0.5 * verdict + 0.5 * f1


@register_reward("judgement", inline=True, grades=("text",))
def judgement_reward(completions, solution, **_) -> list[float]:
    """The reward of a model that learns to judge (recipes/reclip_grm.yaml names it
    `vlmrl.reclip.grm:judgement_reward`; once this module is imported, also `judgement`): the solution is a judge's
    reply (as `reply_text` writes the programmatic judge's), the completion is read as ReCLIP reads any LLM judge's
    reply, and the value is `agreement_score`: half for the verdict, half for the reasons' F1. 1.0 is full
    agreement, so `solved: {reward: judgement, threshold: 1.0}` counts exact agreement. A solution that is not a judge
    reply fails that sample (fix the data), never a silent 0."""
    out: list[float] = []
    for completion, gold_text in zip(completions, solution, strict=True):
        gold = read_reply(gold_text or "")
        if gold is None:
            out.append(RewardFailure(f"judgement: the solution {str(gold_text)[:80]!r} is not a judge reply (reasons, "
                                     "then [RELEVANT] or [IRRELEVANT]); write it as vlmrl reclip grm-data does"))
            continue
        out.append(agreement_score(read_reply(completion_text(completion)), gold))
    return out


def agreement(pairs: Sequence[tuple[Feedback | None, Feedback]], max_reasons: int = MAX_REASONS) -> dict:
    """How a judge agrees with the programmatic one over (predicted, gold) judgements: verdict agreement with its
    95% Wilson interval, Cohen's kappa on the verdict, reason-level precision / recall / F1 (micro, over
    (attribute, expected, got)), per-attribute recall, exact agreement (verdict and every reason), replies without a
    verdict; and, over the judgements a graded judge gave a P(relevant) (`graded`), how well it ranks the gold
    verdicts: ROC AUC of the probability beside that of the tag alone, and the Brier score (`graded_metrics`)."""
    n = len(pairs)
    verdicts = both = n_pred = n_gold = exact = 0
    per_attr: dict[str, list[int]] = {}
    for predicted, gold in pairs:
        v, b, p, g = compare(predicted, gold, max_reasons)
        verdicts += v
        both, n_pred, n_gold = both + b, n_pred + p, n_gold + g
        exact += bool(v and b == p == g)
        pred_keys = Counter(reason_key(r) for r in (predicted.reasons[:max_reasons] if predicted else []))
        for reason in gold.reasons[:max_reasons]:
            hit = per_attr.setdefault(reason.attribute, [0, 0])
            hit[1] += 1
            if pred_keys[reason_key(reason)] > 0:
                pred_keys[reason_key(reason)] -= 1
                hit[0] += 1
    low, high = wilson_interval(verdicts, n) if n else (0.0, 0.0)
    precision = both / n_pred if n_pred else None  # None: no reason to count (a row of relevant retrievals)
    recall = both / n_gold if n_gold else None
    gold_pos = sum(g.verdict == "relevant" for _, g in pairs) / n if n else 0.0
    pred_pos = sum(p is not None and p.verdict == "relevant" for p, _ in pairs) / n if n else 0.0
    chance = gold_pos * pred_pos + (1 - gold_pos) * (1 - pred_pos)
    observed = verdicts / n if n else 0.0
    return {
        "n": n, "verdict_agreement": observed, "verdict_ci_low": low, "verdict_ci_high": high,
        "kappa": (observed - chance) / (1 - chance) if chance < 1 else 0.0,
        "reason_precision": precision, "reason_recall": recall,
        "reason_f1": None if precision is None or recall is None else
        2 * precision * recall / (precision + recall) if precision + recall else 0.0,
        "exact": exact / n if n else 0.0,
        "no_verdict": sum(p is None for p, _ in pairs),
        "recall_by_attribute": {a: hit / total for a, (hit, total) in sorted(per_attr.items())},
        **graded_metrics(pairs),
    }


def graded_metrics(pairs: Sequence[tuple[Feedback | None, Feedback]]) -> dict:
    """Over the pairs whose judgement has a P(relevant): how many (`graded`), the share the judge hesitated on
    (`uncertain`: 0.01 < p < 0.99), the ROC AUC of that probability and of the tag (1 relevant, 0 not) against the
    gold verdict, and the Brier score of the probability; None where there are no such pairs or only one gold
    verdict among them."""
    from sklearn.metrics import roc_auc_score

    graded = [(p, g) for p, g in pairs if p is not None and p.probability is not None]
    gold = [g.verdict == "relevant" for _, g in graded]
    out = {"graded": len(graded), "uncertain": None, "auc_probability": None, "auc_tag": None, "brier": None}
    if graded:
        probs = [p.probability for p, _ in graded]
        out["uncertain"] = sum(0.01 < q < 0.99 for q in probs) / len(graded)
        out["brier"] = sum((q - y) ** 2 for q, y in zip(probs, gold, strict=True)) / len(graded)
        if len(set(gold)) == 2:
            out["auc_probability"] = float(roc_auc_score(gold, probs))
            out["auc_tag"] = float(roc_auc_score(gold, [p.verdict == "relevant" for p, _ in graded]))
    return out


def judged_retrievals(items: Sequence[CaptionItem], n: int, seed: int, weights: Sequence[float] = (0.25, 0.4, 0.35),
                      near_pool: int = 64) -> list[Retrieval]:
    """`n` retrievals among `items` (built-in scenes), judged by the programmatic judge. Each: a truth item, a
    direction (half each), and what was retrieved, drawn by `weights` over KINDS: the truth itself (t2i: its image;
    i2t: its caption, or the same scene said from the other side), a near miss (i2t: one of its hard-negative
    captions; t2i: of `near_pool` random items, one that differs from it in the fewest attributes), or a random
    other item. Deterministic in (items, n, seed)."""
    if len(items) < 2 or any(it.description is None for it in items):
        raise ValueError("judged retrievals need at least two built-in scenes (items with scene descriptions)")
    judge, rng = SceneGraphJudge(), random.Random(f"vlmrl|reclip-grm|{seed}")
    out = []
    while len(out) < n:
        t = rng.randrange(len(items))
        truth = items[t]
        direction = rng.choice(("t2i", "i2t"))
        kind = rng.choices(KINDS, weights)[0]
        others = [j for j in rng.sample(range(len(items)), min(near_pool + 1, len(items))) if j != t]
        if kind == "near":
            if direction == "i2t" and truth.negatives:
                negative = rng.choice(truth.negatives)
                retrieved = View(negative.caption, None, negative.description)
            else:
                j = min(others, key=lambda j: (len(judge(View(), View(description=items[j].description),
                                                         View(description=truth.description)).reasons) or 99))
                retrieved = _view(items[j], direction)
        elif kind == "random":
            retrieved = _view(items[others[0]], direction)
        elif direction == "t2i":
            retrieved = _view(truth, direction)
        else:
            said = caption(truth.description, flip=rng.random() < 0.5)
            retrieved = View(said, None, truth.description)
        query = View(text=truth.caption) if direction == "t2i" else View(image=truth.image)
        truth_view = View(truth.caption, truth.image, truth.description)
        out.append(Retrieval(direction, kind, query, retrieved, truth_view, judge(query, retrieved, truth_view)))
    return out


def _view(item: CaptionItem, direction: str) -> View:
    return View(item.caption, item.image, item.description) if direction == "t2i" else \
        View(item.caption, None, item.description)


def judge_prompt(r: Retrieval, template: str = GRM_TEMPLATE):
    """(the prompt text, the attached image) that ReCLIP's LLM judge sends for this retrieval with `template`."""
    question, prediction, reference, image = judge_fields(r.query, r.retrieved, r.truth)
    text = fill_template(template, question=question, prediction=prediction, reference=reference,
                         max_reasons=MAX_REASONS)
    return text, image


def write_rows(retrievals: Sequence[Retrieval], out: Path, split: str, template: str = GRM_TEMPLATE) -> Path:
    """`out/{split}.jsonl` (rows `{id, image, problem, solution, direction, kind}`) with the images under
    `out/images/`; returns the file."""
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    path = out / f"{split}.jsonl"
    with path.open("w") as f:
        for i, r in enumerate(retrievals):
            text, image = judge_prompt(r, template)
            name = f"images/{split}-{i}.png"
            image.save(out / name)
            row = {"id": f"reclip_grm/{split}/{i}", "image": name, "problem": text, "solution": reply_text(r.gold),
                   "direction": r.direction, "kind": r.kind}
            f.write(json.dumps(row) + "\n")
    return path


def judge_retrievals(judge, retrievals: Sequence[Retrieval], concurrency: int = 8) -> tuple[list[Feedback | None],
                                                                                              list[str]]:
    """Every retrieval judged by `judge` (a `Judge`), `concurrency` at once; (feedbacks, errors): a judgement that
    failed is None in the first list and its error in the second (nothing dropped)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(r: Retrieval):
        try:
            return judge(r.query, r.retrieved, r.truth), None
        except Exception as error:  # counted as a reply without a verdict, its message kept
            return None, f"{type(error).__name__}: {error}"

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(pool.map(one, retrievals))
    return [fb for fb, _ in results], [err for _, err in results if err is not None]


def held_out_agreement(judge, n: int = 500, seed: int = 1, items: int = 300, concurrency: int = 8) -> dict:
    """`agreement` of `judge` with the programmatic judge on `n` retrievals among `items` held-out built-in scenes
    (captions never seen in training), overall and by kind of retrieved item; `errors`: the failed judgements'
    messages (at most 5)."""
    from vlmrl.reclip.scenes import make_scenes

    retrievals = judged_retrievals(make_scenes(items, "test", seed), n, seed)
    predicted, errors = judge_retrievals(judge, retrievals, concurrency)
    pairs = [(p, r.gold) for p, r in zip(predicted, retrievals, strict=True)]
    out = agreement(pairs)
    out["by_kind"] = {kind: agreement([pair for pair, r in zip(pairs, retrievals, strict=True) if r.kind == kind])
                      for kind in KINDS}
    out["by_direction"] = {d: agreement([pair for pair, r in zip(pairs, retrievals, strict=True) if r.direction == d])
                           for d in ("t2i", "i2t")}
    out["failed"], out["errors"] = len(errors), errors[:5]
    return out
