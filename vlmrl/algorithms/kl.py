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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    log_ratio = ref_logp - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        # clamp keeps exp() finite when the two models disagree wildly; identical to the formula elsewhere
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"kl estimator must be one of 'k1', 'k2', 'k3', got {estimator!r}")


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
