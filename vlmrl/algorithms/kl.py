"""KL estimators between the policy and a frozen reference, per token, from log-probs of the sampled tokens.

With log_ratio = logp_ref - logp (x sampled from the policy):
  k1 = -log_ratio                       unbiased, high variance, can be negative
  k2 = log_ratio**2 / 2                 biased, low variance
  k3 = exp(log_ratio) - 1 - log_ratio   unbiased, always >= 0 (Schulman's estimator; GRPO's choice)
"""

from __future__ import annotations

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
