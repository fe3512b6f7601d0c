"""KL estimators between the policy and a frozen reference, per token, from log-probs of the sampled tokens.

With log_ratio = logp_ref - logp (x sampled from the policy):
  k1 = -log_ratio                       unbiased, high variance, can be negative
  k2 = log_ratio**2 / 2                 biased, low variance
  k3 = exp(log_ratio) - 1 - log_ratio   unbiased, always >= 0 (Schulman's estimator; GRPO's choice)

Where the estimate goes decides which one is right:

- in the loss (`kl_in: loss`), beta * k is differentiated through logp: k3's gradient is that of KL(pi_ref || pi)
  in expectation, k2's that of KL(pi || pi_ref); k1's expected gradient is 0 (no regularisation at all).
- in the reward (`kl_in: reward`), -beta * k is a constant that multiplies grad(logp) (the score function). Only k1
  gives the KL gradient then: E_pi[k1 * grad log pi] = grad KL(pi || pi_ref), because E_pi[grad log pi] = 0. k3 as a
  reward gives grad KL(pi || pi_ref) - grad KL(pi_ref || pi), which can point the wrong way
  (`tests/test_algorithms.py` enumerates a small categorical to show both).

An estimator is called with the keyword arguments `logp` and `ref_logp` (each [N, T]) and returns the per-token
estimate [N, T]. KL_ESTIMATORS holds k1, k2, k3; `algorithm.kl_estimator: my_kl.py:fn` names one of your own, which
`resolve_kl_estimator` checks when the run starts (docs/algorithms.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from vlmrl.algorithms.contracts import load_user_function, refuse
from vlmrl.errors import TrainingError

KL_ESTIMATORS: dict[str, Callable[..., Tensor]] = {}
KL_KWARGS = ("logp", "ref_logp")  # each [N, T]: the policy's and the reference's log-probs of the sampled tokens
KL_RETURNS = "a finite tensor [N, T] like logp"
_USER_KL: dict[tuple[str, str], Callable[..., Tensor]] = {}


def register_kl_estimator(name: str):
    def wrap(fn):
        KL_ESTIMATORS[name] = fn
        return fn
    return wrap


@register_kl_estimator("k1")
def k1(logp: Tensor, ref_logp: Tensor, **_) -> Tensor:
    """k1 = -log_ratio = logp - ref_logp."""
    return logp - ref_logp


@register_kl_estimator("k2")
def k2(logp: Tensor, ref_logp: Tensor, **_) -> Tensor:
    """k2 = log_ratio**2 / 2."""
    return 0.5 * (ref_logp - logp) ** 2


@register_kl_estimator("k3")
def k3(logp: Tensor, ref_logp: Tensor, **_) -> Tensor:
    """k3 = exp(log_ratio) - 1 - log_ratio, the log-ratio clamped to +-20 (keeps exp() finite when the two models
    disagree wildly; identical to the formula elsewhere)."""
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(log_ratio) - 1.0 - log_ratio


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """The per-token KL estimate [N, T] by `estimator` (a name of KL_ESTIMATORS or a user's "file.py:function")."""
    return resolve_kl_estimator(estimator)(logp=logp, ref_logp=ref_logp)


def resolve_kl_estimator(ref: str, key: str = "algorithm.kl_estimator") -> Callable[..., Tensor]:
    """The estimator `ref` names: a key of KL_ESTIMATORS, or a user's "file.py:function" checked against the contract
    (signature, then one call on made-up log-probs) the first time it is named; ConfigError naming `key` if not."""
    if ref in KL_ESTIMATORS:
        return KL_ESTIMATORS[ref]
    if (ref, key) not in _USER_KL:
        fn = load_user_function(ref, key, "kl estimator", KL_ESTIMATORS, KL_KWARGS)
        logp = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.125, 0.5, 0.9]]))
        ref_logp = torch.log(torch.tensor([[0.25, 0.25, 0.6], [0.5, 0.4, 0.9]]))
        try:
            out = fn(logp=logp, ref_logp=ref_logp)
        except Exception as exc:
            raise refuse(key, ref, fn, f"raised {type(exc).__name__}: {exc}", KL_RETURNS) from exc
        problem = _kl_problem(out, logp)
        if problem is None and not torch.isfinite(out).all():
            problem = "returned a non-finite estimate"
        if problem is not None:
            raise refuse(key, ref, fn, problem, KL_RETURNS)
        _USER_KL[ref, key] = _checked_kl(fn, ref, key)
    return _USER_KL[ref, key]


def _kl_problem(out: Any, logp: Tensor) -> str | None:
    if not isinstance(out, Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    if out.shape != logp.shape:
        return f"returned shape {tuple(out.shape)} for log-probs of shape {tuple(logp.shape)}"
    return None


def _checked_kl(fn: Callable[..., Any], ref: str, key: str) -> Callable[..., Tensor]:
    def estimator(**kwargs: Any) -> Tensor:
        out = fn(**kwargs)
        problem = _kl_problem(out, kwargs["logp"])
        if problem is not None:
            raise TrainingError(f"{key}={ref!r} {problem}; expected {KL_RETURNS}")
        return out

    estimator.__wrapped__ = fn  # type: ignore[attr-defined]
    return estimator


class KLController:
    """The KL coefficient beta: fixed, or adapted towards a target KL (PPO's adaptive controller, Ziegler et al. 2019,
    as TRL's AdaptiveKLController with one step per update):

        e = clip(kl / target - 1, -0.2, 0.2),    beta <- beta * (1 + rate * e)

    with kl the step's measured mean per-token KL. Above the target beta grows, below it shrinks, by at most a factor
    1 +- 0.2 * rate per step. `target=None` keeps beta fixed. `beta` is saved with a checkpoint (`state`)."""

    def __init__(self, beta: float, target: float | None = None, rate: float = 0.1):
        if target is not None and (target <= 0 or beta <= 0):
            raise ValueError(f"KLController: an adaptive beta needs target > 0 and a start beta > 0, got "
                             f"target={target}, beta={beta}")
        self.beta, self.target, self.rate = float(beta), target, rate

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    def update(self, kl: float | None) -> float:
        """Adapt beta to the step's KL (None: no KL was measured, beta stays); returns the new beta."""
        if self.target is not None and kl is not None and math.isfinite(kl):
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.beta *= 1.0 + self.rate * error
        return self.beta

    def state(self) -> dict:
        return {"beta": self.beta}

    def load(self, state: dict | None) -> None:
        if state:
            self.beta = float(state["beta"])
