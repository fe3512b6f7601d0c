"""From samples to model inputs and back: prompts for a batch of samples, and dataset columns for reward functions."""

from __future__ import annotations

from torch import Tensor

from vlmrl.models.batch import PromptBatch
from vlmrl.models.policy import Policy


def make_prompts(policy: Policy, samples: list[dict], template: str = "{problem}",
                 max_prompt_length: int | None = None) -> PromptBatch:
    """Process `samples` through the policy's processor (the one path for generation and training)."""
    problems = [template.format(**s) for s in samples]
    return policy.processor(problems, [s.get("images") or [] for s in samples], [s["id"] for s in samples],
                            max_prompt_length)


def reward_columns(samples: list[dict], prompt_index: Tensor) -> dict[str, list]:
    """Every dataset column, repeated so row n holds the column of the prompt of trajectory n. `images` rows are the
    same list objects for a prompt's G answers (not copies); `compute_rewards` passes them only to rewards that
    name an `images` parameter (the judge)."""
    keys = dict.fromkeys(k for s in samples for k in s)
    rows = prompt_index.tolist()
    return {k: [samples[i].get(k) for i in rows] for k in keys}
