"""Stage IV, update: policy losses and the aggregation of per-token losses into one scalar.

Shapes: per-token tensors are [N, T] over completion tokens, with `mask` 1 on real tokens and 0 on padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor


class PolicyLossOutput(NamedTuple):
    per_token_loss: Tensor  # [N, T]
    clip_fraction: Tensor  # share of real tokens whose ratio was clipped (scalar)
    ratio_mean: Tensor


POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {}


def register_policy_loss(name: str):
    def wrap(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return wrap


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask == 1; 0 (not NaN) when the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, epsilon_low: float = 0.2,
                  epsilon_high: float = 0.2) -> PolicyLossOutput:
    """PPO's clipped surrogate, per token: L = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A),
    rho = exp(logp - old_logp), A the trajectory's advantage broadcast over its tokens.

    epsilon_high > epsilon_low is DAPO's clip-higher. On the first pass over a fresh rollout rho = 1 and the gradient
    is the plain policy gradient -A * grad(logp).
    """
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped).float()
    return PolicyLossOutput(loss, masked_mean(was_clipped, mask).detach(), masked_mean(ratio, mask).detach())


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "token-mean", max_tokens: int | None = None,
              batch_tokens: Tensor | float | None = None, batch_sequences: int | None = None) -> Tensor:
    """Reduce a per-token loss [N, T] to a scalar.

    token-mean              sum over all real tokens / number of real tokens in the batch (DAPO, TRL's default)
    seq-mean-token-mean     mean over sequences of each sequence's token mean (the original GRPO)
    seq-mean-token-sum-norm sum over all real tokens / (N * max_tokens) (Dr.GRPO: no length bias)

    For a micro-batch of a larger rollout batch, pass the whole batch's `batch_tokens` / `batch_sequences`: the
    micro-batch then returns its share, and the shares sum to the loss of the whole batch, so micro-batching never
    changes the gradient (DESIGN.md invariant 5). Fully masked rows contribute 0 and never NaN.
    """
    mask = mask.to(per_token.dtype)
    n = per_token.shape[0] if batch_sequences is None else batch_sequences
    if mode == "token-mean":
        denom = mask.sum().clamp(min=1) if batch_tokens is None else batch_tokens
        return (per_token * mask).sum() / denom
    if mode == "seq-mean-token-mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / n
    if mode == "seq-mean-token-sum-norm":
        t = max_tokens if max_tokens is not None else per_token.shape[-1]
        return (per_token * mask).sum() / (n * t)
    raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
