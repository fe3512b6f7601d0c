"""The typed values that flow between the stages of an RL step: what a step needs (`StepContext`) and what stage III
hands stage IV (`Trajectories`). Kept apart from the stages themselves so that `rl.py` (stages I-III) and
`update.py` (stage IV) both import them and neither imports the other's internals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from vlmrl.algorithms.correction import Correction, resolve_correction
from vlmrl.algorithms.kl import KLController
from vlmrl.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from vlmrl.models.policy import Policy
from vlmrl.models.reference import Reference
from vlmrl.rewards import RewardSpec
from vlmrl.trainer.distributed import DistInfo, TrainingForward
from vlmrl.trainer.guard import NonfiniteGuard


@dataclass
class StepContext:
    """What an RL step needs besides its prompts: the models, the optimizer and the recipe's sections."""

    policy: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rewards: list[RewardSpec]
    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    template: str = "{problem}"
    max_prompt_length: int | None = None
    reference: Reference | None = None  # the RL start, when algorithm.beta > 0 and for DPO (vlmrl.models.reference)
    critic: object | None = None  # vlmrl.trainer.critic.Critic, for advantage "gae"
    generator: torch.Generator | None = None
    step: int = 0
    dist: DistInfo = field(default_factory=DistInfo)
    forward: torch.nn.Module | None = None  # the training forward, wrapped by DDP/FSDP2 when distributed
    engine: object | None = None  # rollout.engine=vllm: vlmrl.rollout.vllm_engine.VLLMEngine (None: built-in sampler)
    # the curriculum's bookkeeping: (sample, its group's correctness, whether the group's rewards differed)
    observe: Callable[[dict, list[bool], bool], None] | None = None
    kl: KLController | None = None  # the KL coefficient beta, fixed or adaptive (algorithm.kl_target)
    replay: object | None = None  # vlmrl.trainer.replay.Replay: the SFT loss mixed into the update (replay.weight)
    teacher: object | None = None  # on-policy distillation: the frozen teacher (vlmrl.trainer.distill.load_teacher)
    agent: object | None = None  # vlmrl.agent.AgentSpec: multi-turn rollouts with tools (the recipe's `agent`)
    guard: NonfiniteGuard = field(default_factory=NonfiniteGuard)  # optimizer steps skipped for a NaN/inf, run-long
    signal_share: float | None = None  # dynamic sampling: the last step's share of generated groups with a signal
    solved: object | None = None  # vlmrl.eval.generative.Solved: what counts as right (None: accuracy, IoU >= 0.5)
    correction: Correction | None = None  # the off-policy correction (algorithm.rollout_correction, auto resolved)

    def __post_init__(self):
        if self.forward is None:
            self.forward = TrainingForward(self.policy)
        if self.kl is None:
            self.kl = KLController(self.algorithm.beta, self.algorithm.kl_target, self.algorithm.kl_rate)
        if self.correction is None:
            self.correction = resolve_correction(self.algorithm, self.rollout)

    @property
    def batch_used_once(self) -> bool:
        """One pass, one minibatch: the update's own forward (detached) gives the old log-probs, ratio exactly 1."""
        return self.trainer.ppo_epochs * self.trainer.minibatches == 1


class Trajectories(NamedTuple):
    """Stage III output: everything the update needs, one row per trajectory (rows of a group contiguous).

    The token masks mark the policy's own tokens, which need not be contiguous: a multi-turn trajectory (vlmrl.agent)
    is policy turn | observation | policy turn ..., the observations masked out. Every per-token computation honours
    that: the sequence reward lands on the last policy token (`algorithms.advantages.last_token`), returns and GAE
    run over the policy tokens only (value flows across an observation), and an observation never gets a loss.
    Single-turn rows are the one-segment case."""

    prompt_index: Tensor  # [N]
    completion_ids: Tensor  # [N, T]
    loss_mask: Tensor  # [N, T] tokens that receive gradient (overlong filtering may drop truncated answers)
    # [N, T] the PPO ratio's denominator: the proximal policy's log-probs (the weights before the update, recomputed
    # when the batch is reused; None when it is used once: the update's own forward then gives them, detached), or
    # under algorithm.ratio_denominator=behaviour the sampler's own (`sample_logprobs`)
    old_logprobs: Tensor | None
    ref_logprobs: Tensor | None  # [N, T] frozen reference
    advantages: Tensor  # [N] or [N, T]
    rewards: Tensor  # [N] the sequence rewards the advantages came from
    old_values: Tensor | None = None  # [N, T] critic values at rollout time (gae)
    returns: Tensor | None = None  # [N, T] value targets (gae)
    # [N, T] the behaviour policy's log-probs, kept with the rollout (the built-in sampler's or vLLM's): the
    # off-policy correction's and the mismatch metrics' mu (vlmrl.algorithms.correction)
    sample_logprobs: Tensor | None = None
    # [N] bool: rows whose reward was computed (a failed reward, e.g. a judge timeout, is False: advantage 0, no loss,
    # no DPO pair); None: every row
    scored: Tensor | None = None
    # torchrun + dynamic sampling: the rows are one group held only so that this rank runs the update's collectives
    # (its forwards train nothing and count in no normalisation)
    padding: bool = False
    prompt_images: Tensor | None = None  # [N] images in each row's prompt (the mismatch metrics' split)
