"""The recipe's algorithm choices, resolved and checked before anything is built: `check_algorithm` is what `vlmrl
train` calls, so a user's estimator or loss with the wrong signature or answer fails at load, naming its recipe key
and file, not at the first step."""

from __future__ import annotations

from typing import Any

from vlmrl.algorithms.advantages import resolve_advantage
from vlmrl.algorithms.kl import resolve_kl_estimator
from vlmrl.algorithms.losses import resolve_policy_loss


def check_algorithm(algorithm: Any) -> None:
    """ConfigError for an `algorithm.advantage`, `algorithm.policy_loss` or `algorithm.kl_estimator` (an
    `AlgorithmConfig`) that names no registered function, or a user's function that breaks its contract."""
    resolve_advantage(algorithm.advantage)
    if algorithm.policy_loss != "dpo":  # online DPO is its own update (vlmrl/trainer/update.py), not a registry entry
        resolve_policy_loss(algorithm.policy_loss)
    resolve_kl_estimator(algorithm.kl_estimator)
