"""Stage III, trajectories: advantage estimators, registered by name (`algorithm.advantage` in a recipe).

Rewards arrive as a flat tensor [N] where rows of one group (the G answers to one prompt) are contiguous, so a
[num_groups, G] view is the group layout. Each estimator returns one scalar advantage per trajectory, broadcast over
its completion tokens by the loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

ADVANTAGES: dict[str, Callable[..., Tensor]] = {}


def register_advantage(name: str):
    def wrap(fn):
        ADVANTAGES[name] = fn
        return fn
    return wrap


@register_advantage("grpo")
def grpo_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-6) -> Tensor:
    """GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + eps).

    scale="group" divides by the group's std (GRPO), "batch" by the std of the whole batch, "none" not at all
    (Dr.GRPO: the std division over-weights near-uniform groups). std is the unbiased estimate, as in the GRPO
    paper and TRL. A group whose rewards are all equal gets advantage 0 (never NaN); so does a group of one.
    """
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale == "none" or group_size == 1:
        return centred.flatten()
    if scale == "group":
        std = groups.std(dim=1, keepdim=True)
    elif scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
    else:
        raise ValueError(f"grpo scale must be one of 'group', 'batch', 'none', got {scale!r}")
    # an all-equal group has centred == 0 exactly; dividing by a zero std must still give 0, whatever eps is
    std = torch.as_tensor(std + eps).expand_as(centred)
    return torch.where(std > 0, centred / std.clamp(min=torch.finfo(rewards.dtype).tiny), 0.0).flatten()


def zero_variance_fraction(rewards: Tensor, group_size: int, tol: float = 1e-8) -> float:
    """Share of groups whose rewards are all equal: they carry no GRPO signal (DESIGN.md invariant 4)."""
    groups = rewards.view(-1, group_size)
    return ((groups.max(1).values - groups.min(1).values) <= tol).float().mean().item()
