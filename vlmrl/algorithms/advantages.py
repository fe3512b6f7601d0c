"""Stage III, trajectories: advantage estimators, registered by name (`algorithm.advantage` in a recipe).

Rewards arrive as a flat tensor [N] where rows of one group (the G answers to one prompt) are contiguous, so a
[num_groups, G] view is the group layout. Every estimator takes keyword arguments (it ignores those it does not
use) and returns an `Advantages`: one advantage per trajectory [N] (broadcast over its tokens by the loss) or per
token [N, T], plus value targets for estimators with a critic.

Adding an estimator is a function and a decorator:

    @register_advantage("mine")
    def mine(rewards, group_size, **_) -> Advantages: ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor


class Advantages(NamedTuple):
    advantages: Tensor  # [N] per trajectory or [N, T] per token
    returns: Tensor | None = None  # [N, T] value targets (gae only)


ADVANTAGES: dict[str, Callable[..., Advantages]] = {}


def register_advantage(name: str):
    def wrap(fn):
        ADVANTAGES[name] = fn
        return fn
    return wrap


def _safe_div(x: Tensor, d: Tensor) -> Tensor:
    """x / d, and 0 where d == 0 (an all-equal group has x == 0 exactly: 0 / 0 must be 0, not NaN)."""
    d = torch.as_tensor(d, dtype=x.dtype).expand_as(x)
    return torch.where(d > 0, x / d.clamp(min=torch.finfo(x.dtype).tiny), torch.zeros_like(x))


@register_advantage("grpo")
def grpo_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-6, **_) -> Advantages:
    """GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + eps).

    scale="group" divides by the group's std (GRPO), "batch" by the std of the whole batch, "none" not at all
    (Dr.GRPO: the std division over-weights near-uniform groups). std is the unbiased estimate, as in the GRPO
    paper and TRL. A group whose rewards are all equal gets advantage 0 (never NaN); so does a group of one.
    """
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale == "none" or group_size == 1:
        return Advantages(centred.flatten())
    if scale == "group":
        std = groups.std(dim=1, keepdim=True)
    elif scale == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
    else:
        raise ValueError(f"grpo scale must be one of 'group', 'batch', 'none', got {scale!r}")
    return Advantages(_safe_div(centred, std + eps).flatten())


@register_advantage("rloo")
def rloo_advantages(rewards: Tensor, group_size: int, **_) -> Advantages:
    """RLOO: A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean(r_group)), the leave-one-out baseline.

    A group of one has no other answer to compare with: advantage 0.
    """
    if group_size == 1:
        return Advantages(torch.zeros_like(rewards))
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    return Advantages((centred * group_size / (group_size - 1)).flatten())


@register_advantage("remax")
def remax_advantages(rewards: Tensor, baseline_rewards: Tensor, **_) -> Advantages:
    """ReMax: A_i = r_i - r(greedy answer to the same prompt); `baseline_rewards` [N] holds, for each trajectory,
    the reward of its prompt's greedy answer."""
    return Advantages(rewards - baseline_rewards)


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, beta: float = 0.0) -> Tensor:
    """Per-token rewards [N, T]: -beta * kl_t on every token, plus the sequence reward on its last real token
    (the KL-in-reward shaping of PPO-RLHF and REINFORCE++)."""
    mask = mask.to(rewards.dtype)
    out = torch.zeros_like(mask)
    if kl is not None and beta:
        out = out - beta * kl * mask
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    has_tokens = mask.sum(-1) > 0
    out[torch.arange(len(rewards)), last] += torch.where(has_tokens, rewards, torch.zeros_like(rewards))
    return out


def discounted_returns(token_reward: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k over real tokens (right-to-left scan)."""
    out = torch.zeros_like(token_reward)
    running = torch.zeros_like(token_reward[:, 0])
    for t in range(token_reward.shape[1] - 1, -1, -1):
        running = token_reward[:, t] + gamma * running * mask[:, t]
        out[:, t] = running
    return out * mask


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the real tokens of the whole batch; padding stays 0."""
    mask = mask.to(x.dtype)
    n = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + eps) * mask


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(rewards: Tensor, group_size: int, mask: Tensor, kl: Tensor | None = None,
                            beta: float = 0.0, gamma: float = 1.0, baseline: str = "none", **_) -> Advantages:
    """REINFORCE++: token rewards r_t = -beta * KL_t (+ the sequence reward on the last token), returns-to-go
    G_t = sum_{k>=t} gamma^(k-t) r_k, whitened over every real token of the batch.

    baseline="none" is REINFORCE++ as MAYE trains it (works with one answer per prompt); baseline="group" first
    subtracts the group's mean reward (REINFORCE++-baseline, for G > 1).
    """
    if baseline == "group":
        groups = rewards.view(-1, group_size)
        rewards = (groups - groups.mean(dim=1, keepdim=True)).flatten()
    elif baseline != "none":
        raise ValueError(f"reinforce_pp baseline must be 'none' or 'group', got {baseline!r}")
    returns = discounted_returns(token_rewards(rewards, mask, kl, beta), mask, gamma)
    return Advantages(masked_whiten(returns, mask))


@register_advantage("gae")
def gae_advantages(rewards: Tensor, mask: Tensor, values: Tensor, kl: Tensor | None = None, beta: float = 0.0,
                   gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, **_) -> Advantages:
    """PPO's generalised advantage estimation with a learned value V_t per token:

        delta_t = r_t + gamma * V_{t+1} - V_t   (V after the last real token is 0)
        A_t = sum_k (gamma * lam)^k delta_{t+k},   returns_t = A_t + V_t (the critic's target)

    r_t are the token rewards (sequence reward on the last token, -beta * KL_t on every token). Advantages are
    whitened over real tokens when `whiten`; returns are not.
    """
    mask = mask.to(values.dtype)
    r = token_rewards(rewards, mask, kl, beta)
    values = values * mask
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = r[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running * (mask[:, t + 1] if t + 1 < values.shape[1] else 0)) * mask[:, t]
        adv[:, t] = running
    returns = (adv + values) * mask
    return Advantages(masked_whiten(adv, mask) if whiten else adv, returns)


def zero_variance_fraction(rewards: Tensor, group_size: int, tol: float = 1e-8) -> float:
    """Share of groups whose rewards are all equal: they carry no group-relative signal (invariant 4 in docs/concepts.md)."""
    groups = rewards.view(-1, group_size)
    return ((groups.max(1).values - groups.min(1).values) <= tol).float().mean().item()


def nonzero_variance_groups(rewards: Tensor, group_size: int, tol: float = 1e-8) -> Tensor:
    """Boolean [num_groups]: groups whose rewards differ (DAPO's dynamic sampling keeps only these)."""
    groups = rewards.view(-1, group_size)
    return (groups.max(1).values - groups.min(1).values) > tol
