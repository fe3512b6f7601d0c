"""Held-out evaluation of a generative policy: accuracy (greedy and sampled), mean reward, answer length."""

from __future__ import annotations

from collections.abc import Callable

import torch

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


@torch.no_grad()
def evaluate(policy: Policy, samples: list[dict], *, temperature: float = 0.0, max_new_tokens: int = 12,
             batch_size: int = 64, template: str = "{problem}", max_prompt_length: int | None = None,
             rewards: list[RewardSpec] | None = None, seed: int = 0,
             progress: Callable[[int], None] | None = None) -> dict:
    """One answer per held-out sample at `temperature` (0 = greedy). Returns summary metrics and per-sample records."""
    was_training = policy.model.training
    policy.model.eval()
    generator = torch.Generator(device=policy.model.device).manual_seed(seed)
    correct, lengths, truncated, totals, records = [], [], [], [], []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        prompts = make_prompts(policy, chunk, template, max_prompt_length)
        rollout = generate(policy, prompts, 1, max_new_tokens, temperature, generator=generator)
        columns = reward_columns(chunk, rollout.prompt_index)
        columns["completion_truncated"] = rollout.truncated.tolist()
        columns["completion_lengths"] = rollout.lengths.tolist()
        ok = correctness(rollout.texts, columns)
        if rewards:
            totals += compute_rewards(rewards, rollout.texts, columns).total.tolist()
        correct += ok
        lengths += rollout.lengths.tolist()
        truncated += rollout.truncated.tolist()
        records += [{"id": s["id"], "answer": t, "solution": s["solution"], "correct": c}
                    for s, t, c in zip(chunk, rollout.texts, ok, strict=True)]
        if progress:
            progress(len(chunk))
    policy.model.train(was_training)
    n = max(len(correct), 1)
    metrics = {"accuracy": sum(correct) / n, "mean_length": sum(lengths) / n, "truncated_share": sum(truncated) / n,
               "n": len(correct)}
    if totals:
        metrics["mean_reward"] = sum(totals) / len(totals)
    return {"metrics": metrics, "records": records}
