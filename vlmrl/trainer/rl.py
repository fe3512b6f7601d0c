"""One RL step in four stages: I collect -> II score -> III trajectories -> IV update.

Each stage is a function with a typed result, so one step can be traced from `rl_step` to `optimizer.step()` here,
and a researcher can swap a stage. The math lives in `vlmrl.algorithms` (advantages, losses, KL).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from vlmrl.algorithms.advantages import ADVANTAGES, zero_variance_fraction
from vlmrl.algorithms.kl import kl_estimate
from vlmrl.algorithms.losses import POLICY_LOSSES, aggregate, masked_mean
from vlmrl.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from vlmrl.eval.generative import correctness
from vlmrl.models.forward import completion_logprobs
from vlmrl.models.policy import Policy
from vlmrl.models.qwen_vl import PromptBatch
from vlmrl.rewards import RewardOutput, RewardSpec, compute_rewards
from vlmrl.rollout.batch import make_prompts, reward_columns
from vlmrl.rollout.generate import Rollout, generate


class Trajectories(NamedTuple):
    """Stage III output: everything the update needs, one row per trajectory (rows of a group contiguous)."""

    prompt_index: Tensor  # [N] row of the PromptBatch this answer belongs to
    completion_ids: Tensor  # [N, T]
    completion_mask: Tensor  # [N, T]
    old_logprobs: Tensor  # [N, T] behaviour-policy log-probs
    ref_logprobs: Tensor | None  # [N, T] frozen reference, when beta > 0
    advantages: Tensor  # [N]


@dataclass
class StepContext:
    """What an RL step needs besides the batch: the policy, its optimizer and the recipe's sections."""

    policy: Policy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rewards: list[RewardSpec]
    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    template: str = "{problem}"
    max_prompt_length: int | None = None
    reference: Policy | None = None  # frozen copy, only when algorithm.beta > 0
    generator: torch.Generator | None = None


# -- Stage I ------------------------------------------------------------------------------------------------------
def collect(ctx: StepContext, samples: list[dict]) -> tuple[PromptBatch, Rollout]:
    """G answers for every prompt, in one batched generation call."""
    prompts = make_prompts(ctx.policy, samples, ctx.template, ctx.max_prompt_length)
    ctx.policy.model.eval()
    r = ctx.rollout
    rollout = generate(ctx.policy, prompts, r.group_size, r.max_new_tokens, r.temperature, r.top_k, r.top_p,
                       ctx.generator)
    ctx.policy.model.train()
    return prompts, rollout


# -- Stage II -----------------------------------------------------------------------------------------------------
def score(ctx: StepContext, samples: list[dict], rollout: Rollout) -> tuple[RewardOutput, dict[str, list]]:
    """Every reward function on every answer; failures become None and are counted, never raised."""
    columns = reward_columns(samples, rollout.prompt_index)
    columns["completion_truncated"] = rollout.truncated.tolist()
    columns["completion_lengths"] = rollout.lengths.tolist()
    return compute_rewards(ctx.rewards, rollout.texts, columns), columns


# -- Stage III ----------------------------------------------------------------------------------------------------
def sequence_logprobs(policy: Policy, prompts: PromptBatch, prompt_index: Tensor, completion_ids: Tensor,
                      completion_mask: Tensor, temperature: float, with_entropy: bool = False):
    """Log-probs of completions; each prompt's image goes through the vision tower once, for all its answers."""
    used = sorted(set(prompt_index.tolist()))
    sub = prompts.subset(used) if used != list(range(len(prompts))) else prompts
    local = {p: i for i, p in enumerate(used)}
    rows = torch.tensor([local[p] for p in prompt_index.tolist()], device=completion_ids.device)
    embeds = policy.family.prompt_embeds(sub).select(rows)
    return completion_logprobs(policy.family, embeds, completion_ids, completion_mask, temperature, with_entropy)


def build_trajectories(ctx: StepContext, prompts: PromptBatch, rollout: Rollout, rewards: Tensor) -> Trajectories:
    """Advantages by the named estimator; old log-probs from generation when the batch is used once, else
    recomputed; reference log-probs only when beta > 0."""
    algo, temp = ctx.algorithm, ctx.rollout.temperature
    advantages = ADVANTAGES[algo.advantage](rewards, ctx.rollout.group_size, scale=algo.advantage_scale)
    args = (prompts, rollout.prompt_index, rollout.completion_ids, rollout.completion_mask, temp)
    with torch.no_grad():
        if ctx.trainer.ppo_epochs * ctx.trainer.minibatches == 1:
            old = rollout.logprobs
        else:
            ctx.policy.model.eval()
            old = sequence_logprobs(ctx.policy, *args)[0]
            ctx.policy.model.train()
        ref = sequence_logprobs(ctx.reference, *args)[0] if ctx.reference is not None else None
    return Trajectories(rollout.prompt_index, rollout.completion_ids, rollout.completion_mask, old, ref, advantages)


# -- Stage IV -----------------------------------------------------------------------------------------------------
def update(ctx: StepContext, prompts: PromptBatch, traj: Trajectories) -> dict[str, float]:
    """ppo_epochs passes over the rollout batch, split into minibatches (one optimizer step each) and micro-batches
    (gradient accumulation: memory only, the loss is normalised by the whole minibatch)."""
    algo, cfg = ctx.algorithm, ctx.trainer
    n = traj.advantages.shape[0]
    loss_fn = POLICY_LOSSES[algo.policy_loss]
    sums = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    updates = 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(n, generator=ctx.generator) if cfg.minibatches > 1 else torch.arange(n)
        for minibatch in order.chunk(cfg.minibatches):
            mb_tokens = traj.completion_mask[minibatch].sum().clamp(min=1)
            micro = cfg.micro_batch or len(minibatch)
            ctx.optimizer.zero_grad(set_to_none=True)
            for rows in minibatch.split(micro):
                mask = traj.completion_mask[rows]
                logp, entropy = sequence_logprobs(ctx.policy, prompts, traj.prompt_index[rows],
                                                  traj.completion_ids[rows], mask, ctx.rollout.temperature,
                                                  with_entropy=True)
                out = loss_fn(logp, traj.old_logprobs[rows], traj.advantages[rows], mask,
                              epsilon_low=algo.epsilon_low, epsilon_high=algo.epsilon_high)
                per_token = out.per_token_loss
                share = len(rows) / len(minibatch)
                if traj.ref_logprobs is not None:
                    kl = kl_estimate(logp, traj.ref_logprobs[rows], algo.kl_estimator)
                    per_token = per_token + algo.beta * kl
                    sums["kl"] += masked_mean(kl, mask).item() * share
                loss = aggregate(per_token, mask, algo.loss_aggregation, ctx.rollout.max_new_tokens,
                                 batch_tokens=mb_tokens, batch_sequences=len(minibatch))
                loss.backward()
                sums["loss"] += loss.item()
                sums["clip_fraction"] += out.clip_fraction.item() * share
                sums["entropy"] += masked_mean(entropy, mask).item() * share
            params = [p for p in ctx.policy.model.parameters() if p.requires_grad]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            ctx.optimizer.step()
            sums["grad_norm"] += float(grad_norm)
            updates += 1
    ctx.scheduler.step()
    metrics = {k: v / updates for k, v in sums.items()}
    metrics["lr"] = ctx.scheduler.get_last_lr()[0]
    if traj.ref_logprobs is None:
        metrics.pop("kl")
    return metrics


def rl_step(ctx: StepContext, samples: list[dict]) -> tuple[dict[str, float], dict]:
    """One generation step: returns its metrics and a rollout-gallery entry for the first prompt."""
    t0 = time.perf_counter()
    vision_before = ctx.policy.family.vision_calls
    prompts, rollout = collect(ctx, samples)
    vision_calls = ctx.policy.family.vision_calls - vision_before
    t1 = time.perf_counter()
    rewards, columns = score(ctx, samples, rollout)
    t2 = time.perf_counter()
    traj = build_trajectories(ctx, prompts, rollout, rewards.total)
    metrics = update(ctx, prompts, traj)
    t3 = time.perf_counter()
    g = ctx.rollout.group_size
    lengths = rollout.lengths.float()
    correct = correctness(rollout.texts, columns)
    metrics.update(rewards.metrics())
    metrics.update({
        "accuracy": sum(correct) / len(correct),
        "zero_variance_groups": zero_variance_fraction(rewards.total, g),
        "advantage_abs_mean": traj.advantages.abs().mean().item(),
        "response_length": lengths.mean().item(),
        "truncated_share": rollout.truncated.float().mean().item(),
        "vision_forward_calls_rollout": vision_calls,
        "time/collect": t1 - t0, "time/score": t2 - t1, "time/update": t3 - t2,
        "rollouts_per_second": len(rollout.texts) / (t3 - t0),
    })
    first = samples[0]
    gallery = {"id": first["id"], "problem": first["problem"], "solution": first["solution"],
               "answers": rollout.texts[:g], "rewards": rewards.total[:g].tolist()}
    return metrics, gallery
