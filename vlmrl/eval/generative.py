"""Held-out evaluation of a generative policy: n answers per prompt at one temperature, scored with MAYE's metrics.

`evaluate` returns flat summary metrics (what the trainer logs) and, beside them, a per-task breakdown, the reflection
counts and per-prompt records. The formulas live in `vlmrl.eval.metrics`:

- accuracy = mean@n: the share of all answers that are right (equal to the mean of pass@1)
- pass@k: the unbiased estimator 1 - C(n-c, k) / C(n, k) per prompt, averaged over prompts (k <= n)
- maj@n: the share of prompts whose most frequent well-formed answer is right
- mean_length (tokens) and truncated_share (answers that hit max_new_tokens without an end token)
- reflection/*: the five ratios over pooled counts, None where the denominator is empty
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vlmrl.eval.metrics import REFLECTION_WORDS, ReflectionCounts, answer_key, majority_vote, mean_pass_at_k
from vlmrl.models.policy import Policy
from vlmrl.rewards import REWARDS, RewardSpec, compute_rewards
from vlmrl.rollout.batch import make_prompts, reward_columns
from vlmrl.rollout.generate import generate


def correctness(completions: list[str], columns: dict[str, list], iou_threshold: float = 0.5) -> list[bool]:
    """Whether each answer is right: strict `accuracy` for numbers and text, IoU >= threshold for boxes."""
    acc = REWARDS["accuracy"](completions, **columns)
    iou = REWARDS["iou"](completions, **columns)
    return [bool((a if a is not None else 0.0) >= 1.0) if (i is None) else bool(i >= iou_threshold)
            for a, i in zip(acc, iou, strict=True)]


def summarize(records: list[dict], ks: Sequence[int]) -> dict[str, float]:
    """Accuracy metrics of per-prompt records (each with `answers_correct`, `lengths`, `truncated`, `vote`)."""
    correct = [r["answers_correct"] for r in records]
    n = len(correct[0])
    answers = sum(len(c) for c in correct)
    out = {"accuracy": sum(map(sum, correct)) / answers}
    for k in sorted({1, *ks}):
        if k <= n:
            out[f"pass@{k}"] = mean_pass_at_k(correct, k)
    if n > 1:
        out[f"mean@{n}"] = out["accuracy"]
        out[f"maj@{n}"] = sum(r["vote"] for r in records) / len(records)
    out["mean_length"] = sum(sum(r["lengths"]) for r in records) / answers
    out["truncated_share"] = sum(sum(r["truncated"]) for r in records) / answers
    out["n"] = len(records)
    return out


@torch.no_grad()
def evaluate(policy: Policy, samples: list[dict], *, temperature: float = 0.0, max_new_tokens: int = 12,
             batch_size: int = 64, template: str = "{problem}", max_prompt_length: int | None = None,
             rewards: list[RewardSpec] | None = None, seed: int = 0,
             progress: Callable[..., None] | None = None, n: int = 1, ks: Sequence[int] = (),
             reflection_words: Sequence[str] | None = None) -> dict:
    """`n` answers per held-out sample at `temperature` (0 = greedy, which always takes n = 1: its answers are equal).

    `batch_size` counts answers per generation call (prompts per call = batch_size // n). `ks`: the pass@k values to
    report (pass@1 always; k > n is skipped). Returns {"metrics": flat scalars, "per_task": {task: metrics},
    "reflection": {"ratios", "counts", "words"}, "records": one per sample}.
    """
    if not samples:
        raise ValueError("evaluate: no samples; check the eval data spec (data.eval or --data)")
    n = 1 if temperature <= 0 else n
    if n < 1:
        raise ValueError(f"evaluate: n={n} answers per prompt; use n >= 1")
    was_training = policy.model.training
    policy.model.eval()
    generator = torch.Generator(device=policy.model.device).manual_seed(seed)
    reflection = ReflectionCounts(tuple(reflection_words or REFLECTION_WORDS))
    totals, records, failed = [], [], 0
    step = max(1, batch_size // n)
    for start in range(0, len(samples), step):
        chunk = samples[start:start + step]
        prompts = make_prompts(policy, chunk, template, max_prompt_length)
        rollout = generate(policy, prompts, n, max_new_tokens, temperature, generator=generator)
        columns = reward_columns(chunk, rollout.prompt_index)
        columns["completion_truncated"] = rollout.truncated.tolist()
        columns["completion_lengths"] = rollout.lengths.tolist()
        ok = correctness(rollout.texts, columns)
        reflective = reflection.add(rollout.texts, ok)
        if rewards:
            scores = compute_rewards(rewards, rollout.texts, columns)
            failed += int((~scores.scored()).sum())  # a failed reward is not a score: left out, counted
            totals += scores.total[scores.scored()].tolist()
        lengths, truncated = rollout.lengths.tolist(), rollout.truncated.tolist()
        for i, s in enumerate(chunk):
            rows = slice(i * n, (i + 1) * n)  # the answers of prompt i are contiguous
            texts, good = rollout.texts[rows], ok[rows]
            keys = [answer_key(t, tr, s.get("answer_type")) for t, tr in zip(texts, truncated[rows], strict=True)]
            records.append({"id": s["id"], "task": s.get("task", ""), "solution": s["solution"],
                            "answer": texts[0], "correct": good[0], "answers": texts, "answers_correct": good,
                            "lengths": lengths[rows], "truncated": truncated[rows], "reflective": reflective[rows],
                            "vote": majority_vote(keys, good)})
        if progress:
            done = sum(sum(r["answers_correct"]) for r in records) / (len(records) * n)
            progress(len(chunk), acc=f"{done:.2f}")  # live accuracy for a progress bar
    policy.model.train(was_training)
    metrics = summarize(records, ks)
    metrics["samples_per_prompt"] = n
    if totals:
        metrics["mean_reward"] = sum(totals) / len(totals)
    if rewards:
        metrics["reward_failed_samples"] = float(failed)
    metrics.update({f"reflection/{k}": v for k, v in reflection.ratios().items()})
    tasks = sorted({r["task"] for r in records})
    per_task = {t: summarize([r for r in records if r["task"] == t], ks) for t in tasks}
    if len(tasks) > 1:
        metrics.update({f"task/{t}/{k}": v for t, m in per_task.items() for k, v in m.items()})
    return {"metrics": metrics, "per_task": per_task,
            "reflection": {"ratios": reflection.ratios(), "counts": reflection.counts(),
                           "words": reflection.frequencies()},
            "records": records}
