"""Stage IV, update: policy losses and the aggregation of per-token losses into one scalar.

Shapes: per-token tensors are [N, T] over completion tokens, with `mask` 1 on real tokens and 0 on padding.

A policy loss is called with the keyword arguments of POLICY_LOSS_KWARGS and returns a `PolicyLossOutput` (or a
bare per-token loss [N, T]); `aggregate` then reduces it. Adding one is a function and `@register_policy_loss`, or a
function in a file of your own named in the recipe (`algorithm.policy_loss: my_loss.py:fn`), which
`resolve_policy_loss` checks when the run starts (docs/algorithms.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from vlmrl.algorithms.contracts import load_user_function, refuse
from vlmrl.errors import TrainingError


class PolicyLossOutput(NamedTuple):
    per_token_loss: Tensor  # [N, T]
    clip_fraction: Tensor  # share of real tokens whose ratio was clipped (scalar)
    ratio_mean: Tensor


POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {}

# What stage IV passes every policy loss, by keyword (vlmrl/trainer/update.py), for N trajectories of T tokens:
#   logp [N, T] (the policy's log-probs, with gradient), old_logp [N, T] (the behaviour policy's, no gradient),
#   advantages [N] or [N, T] (as the estimator returned them), mask [N, T] 1 on the tokens that get a loss,
#   epsilon_low, epsilon_high float, dual_clip float or None (the recipe's algorithm.* values).
POLICY_LOSS_KWARGS = ("logp", "old_logp", "advantages", "mask", "epsilon_low", "epsilon_high", "dual_clip")
POLICY_LOSS_RETURNS = ("a PolicyLossOutput (or a tensor) whose per_token_loss is [N, T] like logp, finite, with a "
                       "gradient through logp")
_USER_LOSSES: dict[tuple[str, str], Callable[..., PolicyLossOutput]] = {}
# |log importance ratio| is clamped here before exp (as verl and OpenRLHF do): exp(20) ~ 5e8 is far past any clip
# range, and an unclamped exp of a wild log-ratio overflows to inf and turns the loss into NaN
LOG_RATIO_CLAMP = 20.0


def importance_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    """exp(logp - old_logp), the log-ratio clamped to +-LOG_RATIO_CLAMP first (no gradient past the clamp)."""
    return torch.exp((logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def register_policy_loss(name: str):
    def wrap(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return wrap


def resolve_policy_loss(ref: str, key: str = "algorithm.policy_loss") -> Callable[..., PolicyLossOutput]:
    """The loss `ref` names: a key of POLICY_LOSSES, or a user's "file.py:function" checked against the contract
    (signature, then one call on a made-up batch) the first time it is named; ConfigError naming `key` if not."""
    if ref in POLICY_LOSSES:
        return POLICY_LOSSES[ref]
    if (ref, key) not in _USER_LOSSES:
        fn = load_user_function(ref, key, "policy loss", POLICY_LOSSES, POLICY_LOSS_KWARGS)
        old = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.125, 0.5, 0.5]]))
        logp = (old + torch.tensor([[0.1, -0.1, 0.0], [0.3, 0.0, -0.2]])).requires_grad_()
        mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        trial = dict(logp=logp, old_logp=old, advantages=torch.tensor([1.0, -1.0]), mask=mask, epsilon_low=0.2,
                     epsilon_high=0.2, dual_clip=None)
        try:
            out, problem = _as_loss(fn(**trial), logp, old, mask)
        except Exception as exc:
            raise refuse(key, ref, fn, f"raised {type(exc).__name__}: {exc}", POLICY_LOSS_RETURNS) from exc
        if problem is None and not torch.isfinite(out.per_token_loss).all():
            problem = "returned a non-finite loss"
        if problem is None and not out.per_token_loss.requires_grad:
            problem = "returned a loss with no gradient through logp (it would train nothing)"
        if problem is not None:
            raise refuse(key, ref, fn, problem, POLICY_LOSS_RETURNS)
        _USER_LOSSES[ref, key] = _checked_loss(fn, ref, key)
    return _USER_LOSSES[ref, key]


def _as_loss(out: Any, logp: Tensor, old_logp: Tensor, mask: Tensor) -> tuple[PolicyLossOutput, str | None]:
    """`out` as a PolicyLossOutput (a bare tensor gets clip fraction 0 and the measured mean ratio), and what is
    wrong with it (None: fine)."""
    if isinstance(out, Tensor):
        zero = torch.zeros((), device=logp.device)
        out = PolicyLossOutput(out, zero, masked_mean(importance_ratio(logp, old_logp), mask).detach())
    if not isinstance(out, PolicyLossOutput) or not isinstance(out.per_token_loss, Tensor):
        return PolicyLossOutput(logp, logp, logp), f"returned {type(out).__name__}, not PolicyLossOutput or a tensor"
    if out.per_token_loss.shape != logp.shape:
        return out, f"returned a per-token loss of shape {tuple(out.per_token_loss.shape)} for logp of shape " \
                    f"{tuple(logp.shape)}"
    return out, None


def _checked_loss(fn: Callable[..., Any], ref: str, key: str) -> Callable[..., PolicyLossOutput]:
    """`fn` whose answer is checked at every call too (a shape that the made-up batch did not show)."""

    def loss(**kwargs: Any) -> PolicyLossOutput:
        out, problem = _as_loss(fn(**kwargs), kwargs["logp"], kwargs["old_logp"], kwargs["mask"])
        if problem is not None:
            raise TrainingError(f"{key}={ref!r} {problem}; expected {POLICY_LOSS_RETURNS}")
        return out

    loss.__wrapped__ = fn  # type: ignore[attr-defined]
    return loss


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask == 1; 0 (not NaN) when the mask is empty."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


@register_policy_loss("ppo_clip")
def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, epsilon_low: float = 0.2,
                  epsilon_high: float = 0.2, dual_clip: float | None = None, **_) -> PolicyLossOutput:
    """PPO's clipped surrogate, per token: L = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A),
    rho = exp(logp - old_logp), A the trajectory's (or token's) advantage.

    epsilon_high > epsilon_low is DAPO's clip-higher. `dual_clip` = c > 1 (dual-clip PPO) also bounds the loss of
    negative-advantage tokens with a huge ratio: for A < 0, L = min(L, -c * A). On the first pass over a fresh
    rollout rho = 1 and the gradient is the plain policy gradient -A * grad(logp). The log-ratio is clamped to
    +-20 before exp.
    """
    ratio = importance_ratio(logp, old_logp)
    adv = _per_token(advantages)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return PolicyLossOutput(loss, masked_mean(was_clipped.float(), mask).detach(), masked_mean(ratio, mask).detach())


@register_policy_loss("gspo")
def gspo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, epsilon_low: float = 3e-4,
              epsilon_high: float = 4e-4, **_) -> PolicyLossOutput:
    """GSPO: one importance ratio per sequence, the geometric mean of its token ratios,
    s_i = exp(mean_t (logp_t - old_logp_t)), clipped as in PPO: L_i = -min(s_i * A_i, clip(s_i, 1-eps_l, 1+eps_h) * A_i).

    Written per token as s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]) (GSPO-token), whose value is s_i and whose
    gradient is s_i * grad(logp_t) / |y_i| under seq-mean-token-mean aggregation. GSPO's clip range is tiny
    (3e-4, 4e-4) because a sequence ratio moves much less than a token ratio. The sequence log-ratio is clamped to
    +-20 before exp.
    """
    m = mask.to(logp.dtype)
    seq_log_ratio = (((logp - old_logp) * m).sum(-1) / m.sum(-1).clamp(min=1)).clamp(-LOG_RATIO_CLAMP,
                                                                                     LOG_RATIO_CLAMP)
    token_ratio = torch.exp(seq_log_ratio.detach().unsqueeze(-1) + logp - logp.detach())
    adv = _per_token(advantages)
    unclipped = token_ratio * adv
    clipped = token_ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    seq_ratio = torch.exp(seq_log_ratio.detach())
    seq_clipped = ((seq_ratio < 1 - epsilon_low) | (seq_ratio > 1 + epsilon_high)).float()
    rows = (m.sum(-1) > 0).float()
    return PolicyLossOutput(loss, ((seq_clipped * rows).sum() / rows.sum().clamp(min=1)).detach(),
                            ((seq_ratio * rows).sum() / rows.sum().clamp(min=1)).detach())


@register_policy_loss("reinforce")
def reinforce_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, **_) -> PolicyLossOutput:
    """Plain on-policy REINFORCE: L = -A * logp (no ratio, no clipping; use with ppo_epochs = 1)."""
    adv = _per_token(advantages)
    zero = torch.zeros((), device=logp.device)
    return PolicyLossOutput(-adv * logp, zero, masked_mean(importance_ratio(logp, old_logp), mask).detach())


def _per_token(advantages: Tensor) -> Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float | None = 0.2) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2).

    Returns (per-token loss, share of real tokens where the clipped branch was larger)."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros((), device=values.device)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), masked_mean((clipped > unclipped).float(), mask).detach()


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor,
             beta: float = 0.1, label_smoothing: float = 0.0) -> tuple[Tensor, Tensor]:
    """DPO on sequence log-probs [B]: h = beta * ((pi_c - ref_c) - (pi_r - ref_r)),
    L = -(1 - eps) * log sigmoid(h) - eps * log sigmoid(-h)   (eps = label smoothing, cDPO).

    Returns (loss per pair [B], reward margin h / beta per pair, detached)."""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    h = beta * margin
    loss = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
    return loss, margin.detach()


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> tuple[Tensor, Tensor]:
    """Bradley-Terry on a reward model's scalar scores [B] of preference pairs: P(chosen > rejected) =
    sigmoid(r_c - r_r), L = -log sigmoid(r_c - r_r), whose gradient is dL/dr_c = -(1 - sigmoid(r_c - r_r)) =
    -dL/dr_r.

    Returns (loss per pair [B], margin r_c - r_r per pair, detached: > 0 where the pair is ranked right)."""
    margin = chosen - rejected
    return -F.logsigmoid(margin), margin.detach()


def preference_kl(student_margin: Tensor, teacher_margin: Tensor, temperature: float = 1.0) -> Tensor:
    """Reward-model distillation: per pair, KL(teacher || student) between the two Bradley-Terry preferences
    p_t = sigmoid(m_t / T) and p_s = sigmoid(m_s), m = r_c - r_r (the teacher's margin detached),

        KL = p_t (log p_t - log p_s) + (1 - p_t) (log(1 - p_t) - log(1 - p_s)),   dKL/dm_s = p_s - p_t.

    With p_t in {0, 1} it is the Bradley-Terry loss of the teacher's ranking; T > 1 softens the teacher."""
    p_t = torch.sigmoid(teacher_margin.detach() / temperature)
    entropy = torch.special.xlogy(p_t, p_t) + torch.special.xlogy(1 - p_t, 1 - p_t)
    return entropy - p_t * F.logsigmoid(student_margin) - (1 - p_t) * F.logsigmoid(-student_margin)


def aggregate(per_token: Tensor, mask: Tensor, mode: str = "token-mean", max_tokens: int | None = None,
              batch_tokens: Tensor | float | None = None, batch_sequences: int | None = None) -> Tensor:
    """Reduce a per-token loss [N, T] to a scalar.

    token-mean              sum over all real tokens / number of real tokens in the batch (DAPO, TRL's default)
    seq-mean-token-mean     mean over sequences of each sequence's token mean (the original GRPO)
    seq-mean-token-sum-norm sum over all real tokens / (N * max_tokens) (Dr.GRPO: no length bias)

    For a micro-batch of a larger rollout batch, pass the whole batch's `batch_tokens` / `batch_sequences`: the
    micro-batch then returns its share, and the shares sum to the loss of the whole batch, so micro-batching never
    changes the gradient (invariant 5 in docs/concepts.md). Fully masked rows contribute 0 and never NaN.
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
