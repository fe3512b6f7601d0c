"""Rewards: verifiable reward functions, the registry, and safe weighted composition (the "score" stage).

Importing this package registers the built-in rewards: accuracy, format, counting, length (verifiable.py); iou, giou,
detection (boxes.py); classification (classification.py); exact_match, token_f1, bleu, rouge_l (textmatch.py);
keywords, process (reasoning.py); judge (judge.py); tool_use (tool_use.py); reward_model (reward_model.py: a
learned outcome reward model).
"""

from vlmrl.rewards.boxes import box_giou, box_iou, detection_reward, giou_reward, iou_reward
from vlmrl.rewards.classification import classification_reward
from vlmrl.rewards.judge import Feedback, JudgeClient, parse_feedback
from vlmrl.rewards.judge_reward import judge_reward
from vlmrl.rewards.reasoning import keywords_reward, process_reward
from vlmrl.rewards.registry import (
    REWARDS,
    FatalRewardError,
    RewardBatch,
    RewardFailure,
    RewardFn,
    RewardOutput,
    RewardSpec,
    call_reward,
    compute_rewards,
    register_reward,
    resolve_reward,
)
from vlmrl.rewards.reward_model import reward_model_reward
from vlmrl.rewards.textmatch import bleu_reward, exact_match_reward, rouge_l_reward, token_f1_reward
from vlmrl.rewards.tool_use import tool_use_reward
from vlmrl.rewards.verifiable import (
    accuracy_reward,
    counting_reward,
    format_reward,
    length_penalty,
)

__all__ = [
    "REWARDS",
    "FatalRewardError",
    "Feedback",
    "JudgeClient",
    "RewardBatch",
    "RewardFailure",
    "RewardFn",
    "RewardOutput",
    "RewardSpec",
    "tool_use_reward",
    "accuracy_reward",
    "bleu_reward",
    "box_giou",
    "box_iou",
    "call_reward",
    "classification_reward",
    "compute_rewards",
    "counting_reward",
    "detection_reward",
    "exact_match_reward",
    "format_reward",
    "giou_reward",
    "iou_reward",
    "judge_reward",
    "keywords_reward",
    "length_penalty",
    "parse_feedback",
    "process_reward",
    "reward_model_reward",
    "register_reward",
    "resolve_reward",
    "rouge_l_reward",
    "token_f1_reward",
]
