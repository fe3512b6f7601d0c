"""Stage III, trajectories: advantage estimators, registered by name (`algorithm.advantage` in a recipe).

Rewards arrive as a flat tensor [N] where rows of one group (the G answers to one prompt) are contiguous, so a
[num_groups, G] view is the group layout. Every estimator takes keyword arguments (it ignores those it does not
use) and returns an `Advantages`: one advantage per trajectory [N] (broadcast over its tokens by the loss) or per
token [N, T], plus value targets for estimators with a critic.

Two keyword arguments every estimator honours:

- `scored` [N] bool (None: all True): rows whose reward could be computed. A row that is not scored (its reward
  failed, e.g. a judge timeout) gets advantage 0 and is left out of every group and batch statistic, so a failure
  is never read as a low reward; a group left with fewer than two scored answers (one, for ReMax's greedy
  baseline) has no signal and gets 0.
- `reduce`: a function that sums a tensor over the data-parallel ranks (None: one process). Statistics "over the
  batch" (`advantage_scale: batch`, REINFORCE++'s and GAE's whitening) go through it, so every rank uses the global
  batch's mean and std, as one process would.

Adding an estimator is a function and a decorator:

    @register_advantage("mine")
    def mine(rewards, group_size, **_) -> Advantages: ...

or, without touching vlmrl, a function in a file of your own named in the recipe (`algorithm.advantage:
my_adv.py:mine`). It is called with the keyword arguments of ADVANTAGE_KWARGS and returns an `Advantages` or a
bare tensor (the advantages); `resolve_advantage` checks both when the run starts (docs/algorithms.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from vlmrl.algorithms.contracts import load_user_function, refuse
from vlmrl.errors import TrainingError

Reduce = Callable[[Tensor], Tensor]  # sum over data-parallel ranks


class Advantages(NamedTuple):
    advantages: Tensor  # [N] per trajectory or [N, T] per token
    returns: Tensor | None = None  # [N, T] value targets (gae only)


ADVANTAGES: dict[str, Callable[..., Advantages]] = {}

# What stage III passes every estimator, by keyword (vlmrl/trainer/rl.py), N trajectories of T completion tokens:
#   rewards [N] float (groups of group_size contiguous rows), group_size int, scale str (algorithm.advantage_scale),
#   mask [N, T] 1 on policy tokens, kl [N, T] or None (per-token KL when kl_in is "reward" and beta > 0), beta float
#   (the KL-in-reward coefficient, else 0), gamma, lam float, values [N, T] or None (a critic's, gae only),
#   baseline str (algorithm.reinforce_pp_baseline), baseline_rewards [N] or None (remax only), scored [N] bool,
#   reduce (sum over data-parallel ranks) or None.
ADVANTAGE_KWARGS = ("rewards", "group_size", "scale", "mask", "kl", "beta", "gamma", "lam", "values", "baseline",
                    "baseline_rewards", "scored", "reduce")
ADVANTAGE_RETURNS = "an Advantages (or a tensor) whose advantages are [N] per trajectory or [N, T] per token, " \
                    "finite, and whose returns are None or [N, T]"
_USER_ADVANTAGES: dict[tuple[str, str], Callable[..., Advantages]] = {}


def register_advantage(name: str):
    def wrap(fn):
        ADVANTAGES[name] = fn
        return fn
    return wrap


def resolve_advantage(ref: str, key: str = "algorithm.advantage") -> Callable[..., Advantages]:
    """The estimator `ref` names: a key of ADVANTAGES, or a user's "file.py:function" checked against the contract
    (signature, then one call on a made-up batch) the first time it is named; ConfigError naming `key` if not."""
    if ref in ADVANTAGES:
        return ADVANTAGES[ref]
    if (ref, key) not in _USER_ADVANTAGES:
        fn = load_user_function(ref, key, "advantage estimator", ADVANTAGES, ADVANTAGE_KWARGS)
        rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
        mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
        trial = dict(rewards=rewards, group_size=2, scale="group", mask=mask, kl=None, beta=0.0, gamma=1.0, lam=0.95,
                     values=None, baseline="none", baseline_rewards=None, scored=torch.ones(4, dtype=torch.bool),
                     reduce=None)
        try:
            out = fn(**trial)
        except Exception as exc:
            raise refuse(key, ref, fn, f"raised {type(exc).__name__}: {exc}", ADVANTAGE_RETURNS) from exc
        result, problem = _as_advantages(out, rewards, mask)
        if problem is None and not torch.isfinite(result.advantages).all():
            problem = "returned a non-finite advantage"
        if problem is not None:
            raise refuse(key, ref, fn, problem, ADVANTAGE_RETURNS)
        _USER_ADVANTAGES[ref, key] = _checked_advantage(fn, ref, key)
    return _USER_ADVANTAGES[ref, key]


def _as_advantages(out: Any, rewards: Tensor, mask: Tensor) -> tuple[Advantages, str | None]:
    """`out` as Advantages, and what is wrong with it for N = len(rewards) rows of mask's T columns (None: fine)."""
    if isinstance(out, Tensor):
        out = Advantages(out)
    if not isinstance(out, Advantages) or not isinstance(out.advantages, Tensor):
        return Advantages(rewards), f"returned {type(out).__name__}, not Advantages or a tensor"
    n, t = mask.shape
    adv, returns = out.advantages, out.returns
    if tuple(adv.shape) not in ((n,), (n, t)) or not adv.is_floating_point():
        return out, f"returned advantages of shape {tuple(adv.shape)} ({adv.dtype}) for N={n} rows of T={t} tokens"
    if returns is not None and (not isinstance(returns, Tensor) or tuple(returns.shape) != (n, t)):
        shape = tuple(returns.shape) if isinstance(returns, Tensor) else type(returns).__name__
        return out, f"returned returns of shape {shape} for N={n} rows of T={t} tokens"
    return out, None


def _checked_advantage(fn: Callable[..., Any], ref: str, key: str) -> Callable[..., Advantages]:
    """`fn` whose answer is checked at every step too (a shape that the made-up batch did not show)."""

    def estimator(**kwargs: Any) -> Advantages:
        out, problem = _as_advantages(fn(**kwargs), kwargs["rewards"], kwargs["mask"])
        if problem is not None:
            raise TrainingError(f"{key}={ref!r} {problem}; expected {ADVANTAGE_RETURNS}")
        return out

    estimator.__wrapped__ = fn  # type: ignore[attr-defined]
    return estimator


def _safe_div(x: Tensor, d: Tensor) -> Tensor:
    """x / d, and 0 where d == 0 (an all-equal group with eps = 0 has x == 0 exactly: 0 / 0 must be 0, not NaN)."""
    d = torch.as_tensor(d, dtype=x.dtype).expand_as(x)
    return torch.where(d > 0, x / d.clamp(min=torch.finfo(x.dtype).tiny), torch.zeros_like(x))


def _keep(rewards: Tensor, scored: Tensor | None) -> Tensor:
    """The scored mask [N] as rewards' dtype (all ones when None)."""
    if scored is None:
        return torch.ones_like(rewards)
    return scored.to(device=rewards.device, dtype=rewards.dtype)


def _sum(x: Tensor, reduce: Reduce | None) -> Tensor:
    return x if reduce is None else reduce(x)


def group_stats(rewards: Tensor, group_size: int, scored: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Per group [num_groups, 1], over its scored answers only: (count, mean, unbiased std; std 0 below 2)."""
    groups, keep = rewards.view(-1, group_size), _keep(rewards, scored).view(-1, group_size)
    count = keep.sum(1, keepdim=True)
    mean = (groups * keep).sum(1, keepdim=True) / count.clamp(min=1)
    var = (((groups - mean) * keep) ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)
    return count, mean, var.sqrt()


def batch_std(rewards: Tensor, scored: Tensor | None = None, reduce: Reduce | None = None) -> Tensor:
    """The unbiased std of the scored rewards of the whole batch (every rank's, through `reduce`); 0 below 2."""
    keep = _keep(rewards, scored)
    n = _sum(keep.sum(), reduce)
    mean = _sum((rewards * keep).sum(), reduce) / n.clamp(min=1)
    var = _sum((((rewards - mean) * keep) ** 2).sum(), reduce) / (n - 1).clamp(min=1)
    return var.sqrt()


@register_advantage("grpo")
def grpo_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-6,
                    scored: Tensor | None = None, reduce: Reduce | None = None, **_) -> Advantages:
    """GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + eps), over the group's scored answers.

    scale="group" divides by the group's std (GRPO), "batch" by the std of the whole batch (all ranks), "none" not
    at all (Dr.GRPO: the std division over-weights near-uniform groups). std is the unbiased estimate, as in the
    GRPO paper and TRL. A group whose rewards are all equal gets advantage 0 (never NaN), and so does a group of
    one, or a group with one scored answer.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"grpo scale must be one of 'group', 'batch', 'none', got {scale!r}")
    keep = _keep(rewards, scored).view(-1, group_size)
    count, mean, std = group_stats(rewards, group_size, scored)
    centred = (rewards.view(-1, group_size) - mean) * keep
    if scale == "none" or group_size == 1:
        return Advantages(centred.flatten())
    if scale == "batch":
        std = batch_std(rewards, scored, reduce)
    return Advantages(_safe_div(centred, std + eps).flatten())


@register_advantage("rloo")
def rloo_advantages(rewards: Tensor, group_size: int, scored: Tensor | None = None, **_) -> Advantages:
    """RLOO: A_i = r_i - mean_{j != i} r_j = k / (k - 1) * (r_i - mean(r_group)), the leave-one-out baseline over
    the group's k scored answers (k = G when every answer was scored).

    A group of one (or with one scored answer) has no other answer to compare with: advantage 0.
    """
    keep = _keep(rewards, scored).view(-1, group_size)
    count, mean, _ = group_stats(rewards, group_size, scored)
    centred = (rewards.view(-1, group_size) - mean) * keep
    return Advantages((centred * count / (count - 1).clamp(min=1)).flatten())


@register_advantage("remax")
def remax_advantages(rewards: Tensor, baseline_rewards: Tensor, scored: Tensor | None = None, **_) -> Advantages:
    """ReMax: A_i = r_i - r(greedy answer to the same prompt); `baseline_rewards` [N] holds, for each trajectory,
    the reward of its prompt's greedy answer (both with the same KL shaping when KL is in the reward). `scored`
    covers the baseline too: a prompt whose greedy answer failed has no baseline."""
    return Advantages((rewards - baseline_rewards) * _keep(rewards, scored))


def last_token(mask: Tensor) -> Tensor:
    """The column [N] of each row's last policy token (0 for a row without one).

    A row's policy tokens need not be contiguous: an agent's trajectory is policy turn | observation | policy turn
    ..., with the mask 0 on the observations (the `Trajectories` contract, vlmrl.trainer.types)."""
    t = mask.shape[-1]
    return (t - 1 - (mask != 0).long().flip(-1).argmax(-1)).clamp(min=0)


def token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, beta: float = 0.0) -> Tensor:
    """Per-token rewards [N, T]: -beta * kl_t on every policy token, plus the sequence reward on the last policy
    token (the KL-in-reward shaping of PPO-RLHF and REINFORCE++); never on an observation or padding column."""
    mask = mask.to(rewards.dtype)
    out = torch.zeros_like(mask)
    if kl is not None and beta:
        out = out - beta * kl * mask
    has_tokens = mask.sum(-1) > 0
    out[torch.arange(len(rewards)), last_token(mask)] += torch.where(has_tokens, rewards, torch.zeros_like(rewards))
    return out


def discounted_returns(token_reward: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{k >= t} gamma^(k - t) r_k over the policy tokens only (right-to-left scan).

    k counts policy tokens: a column with mask 0 (an observation between two turns, or padding) is skipped, neither
    discounting nor adding, so the return of a turn's tokens includes the later turns' rewards. On a contiguous
    mask this is the plain right-to-left return."""
    out = torch.zeros_like(token_reward)
    running = torch.zeros_like(token_reward[:, 0])
    policy = mask.bool()
    for t in range(token_reward.shape[1] - 1, -1, -1):
        running = torch.where(policy[:, t], token_reward[:, t] + gamma * running, running)
        out[:, t] = running
    return out * mask


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, reduce: Reduce | None = None) -> Tensor:
    """(x - mean) / std over the real tokens of the whole batch (every rank's, through `reduce`); padding stays 0."""
    mask = mask.to(x.dtype)
    n = _sum(mask.sum(), reduce).clamp(min=1)
    mean = _sum((x * mask).sum(), reduce) / n
    var = _sum((((x - mean) * mask) ** 2).sum(), reduce) / n
    return (x - mean) * torch.rsqrt(var + eps) * mask


def _scored_tokens(mask: Tensor, scored: Tensor | None) -> Tensor:
    """The token mask [N, T] without the rows whose reward failed."""
    return mask if scored is None else mask * scored.to(device=mask.device, dtype=mask.dtype)[:, None]


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(rewards: Tensor, group_size: int, mask: Tensor, kl: Tensor | None = None,
                            beta: float = 0.0, gamma: float = 1.0, baseline: str = "none",
                            scored: Tensor | None = None, reduce: Reduce | None = None, **_) -> Advantages:
    """REINFORCE++: token rewards r_t = -beta * KL_t (+ the sequence reward on the last token), returns-to-go
    G_t = sum_{k>=t} gamma^(k-t) r_k, whitened over every real token of the batch (all ranks).

    baseline="none" is REINFORCE++ as MAYE trains it (works with one answer per prompt); baseline="group" first
    subtracts the group's mean reward (REINFORCE++-baseline, for G > 1).
    """
    if baseline == "group":
        _, mean, _ = group_stats(rewards, group_size, scored)
        rewards = (rewards.view(-1, group_size) - mean).flatten()
    elif baseline != "none":
        raise ValueError(f"reinforce_pp baseline must be 'none' or 'group', got {baseline!r}")
    mask = _scored_tokens(mask, scored)
    returns = discounted_returns(token_rewards(rewards, mask, kl, beta), mask, gamma)
    return Advantages(masked_whiten(returns, mask, reduce=reduce))


@register_advantage("gae")
def gae_advantages(rewards: Tensor, mask: Tensor, values: Tensor, kl: Tensor | None = None, beta: float = 0.0,
                   gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, scored: Tensor | None = None,
                   reduce: Reduce | None = None, **_) -> Advantages:
    """PPO's generalised advantage estimation with a learned value V_t per token:

        delta_t = r_t + gamma * V_{t+1} - V_t   (V after the last policy token is 0)
        A_t = sum_k (gamma * lam)^k delta_{t+k},   returns_t = A_t + V_t (the critic's target)

    t and t+1 are consecutive *policy* tokens: an observation between two turns (mask 0) is skipped, so V_{t+1} of a
    turn's last token is the value at the next turn's first token and the advantage flows across the observation.
    r_t are the token rewards (sequence reward on the last policy token, -beta * KL_t on every policy token).
    Advantages are whitened over policy tokens (all ranks) when `whiten`; returns are not.
    """
    mask = _scored_tokens(mask, scored).to(values.dtype)
    r = token_rewards(rewards, mask, kl, beta)
    values = values * mask
    policy = mask.bool()
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(running)  # V at the next policy token (0 after the last)
    for t in range(values.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - values[:, t]
        running = torch.where(policy[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(policy[:, t], values[:, t], next_value)
        adv[:, t] = running
    adv = adv * mask
    returns = (adv + values) * mask
    return Advantages(masked_whiten(adv, mask, reduce=reduce) if whiten else adv, returns)


def zero_variance_fraction(rewards: Tensor, group_size: int, tol: float = 1e-8, scored: Tensor | None = None
                           ) -> float:
    """Share of groups whose scored rewards are all equal (or that have fewer than two scored answers): they carry
    no group-relative signal (invariant 4 in docs/concepts.md)."""
    return 1.0 - nonzero_variance_groups(rewards, group_size, tol, scored).float().mean().item()


def nonzero_variance_groups(rewards: Tensor, group_size: int, tol: float = 1e-8, scored: Tensor | None = None
                            ) -> Tensor:
    """Boolean [num_groups]: groups whose scored rewards differ (DAPO's dynamic sampling keeps only these). A
    failed reward is no evidence of a difference: a group of equal answers plus one failure is not kept."""
    groups = rewards.view(-1, group_size)
    keep = _keep(rewards, scored).view(-1, group_size) > 0
    top = groups.masked_fill(~keep, float("-inf")).max(1).values
    bottom = groups.masked_fill(~keep, float("inf")).min(1).values
    return (top - bottom) > tol
