"""Rewards: verifiable reward functions, the registry, and safe weighted composition (the "score" stage).

Importing this package registers the built-in rewards: accuracy, format, iou, giou, counting, length.
"""

from vlmrl.rewards.registry import (
    REWARDS,
    RewardFn,
    RewardOutput,
    RewardSpec,
    call_reward,
    compute_rewards,
    register_reward,
    resolve_reward,
)
from vlmrl.rewards.verifiable import (
    accuracy_reward,
    box_giou,
    box_iou,
    counting_reward,
    format_reward,
    giou_reward,
    iou_reward,
    length_penalty,
)

__all__ = [
    "REWARDS",
    "RewardFn",
    "RewardOutput",
    "RewardSpec",
    "accuracy_reward",
    "box_giou",
    "box_iou",
    "call_reward",
    "compute_rewards",
    "counting_reward",
    "format_reward",
    "giou_reward",
    "iou_reward",
    "length_penalty",
    "register_reward",
    "resolve_reward",
]
