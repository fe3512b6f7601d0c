"""Stage IV, update: the policy-gradient update (with optional critic) and online DPO.

`ppo_epochs` passes over the rollout batch, each split into `minibatches` (one optimizer step each) and chunks of at
most `micro_batch` rows and `micro_batch_tokens` padded tokens (gradient accumulation: memory only; every chunk's loss
is normalised by its whole minibatch, so the gradient does not depend on the chunking).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.algorithms.kl import kl_estimate
from vlmrl.algorithms.losses import POLICY_LOSSES, aggregate, dpo_loss, masked_mean, value_loss
from vlmrl.models.qwen_vl import PromptBatch
from vlmrl.trainer.distributed import all_sum, no_sync
from vlmrl.trainer.rl import StepContext, Trajectories


def _clip_and_step(params: list, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    return float(norm)


def update(ctx: StepContext, prompts: PromptBatch, traj: Trajectories) -> dict[str, float]:
    if ctx.algorithm.policy_loss == "dpo":
        return update_online_dpo(ctx, prompts, traj)
    algo, cfg, critic = ctx.algorithm, ctx.trainer, ctx.critic
    n = traj.advantages.shape[0]
    warmup = critic is not None and ctx.step <= algo.critic_warmup_steps  # train only the critic
    policy_params = [p for p in ctx.policy.model.parameters() if p.requires_grad]
    sums: dict[str, float] = {}
    updates = 0
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(n, generator=ctx.generator) if cfg.minibatches > 1 else torch.arange(n)
        for minibatch in order.chunk(cfg.minibatches):
            # normalise by the whole minibatch across ranks; DDP/FSDP2 average gradients over ranks, hence / world
            world = ctx.dist.world
            mb_tokens = (all_sum(traj.loss_mask[minibatch].sum(), ctx.dist) / world).clamp(min=1).float()
            mb_seqs = float(all_sum(len(minibatch), ctx.dist)) / world
            ctx.optimizer.zero_grad(set_to_none=True)
            if critic is not None:
                critic.optimizer.zero_grad(set_to_none=True)
            lengths = row_tokens(prompts, traj) if cfg.micro_batch_tokens else None
            chunks = micro_batches(minibatch, lengths, cfg.micro_batch, cfg.micro_batch_tokens)
            for i, rows in enumerate(chunks):
                with no_sync(ctx.forward, last=i == len(chunks) - 1):
                    loss, parts = micro_batch_loss(ctx, prompts, traj, rows, mb_tokens, mb_seqs, warmup)
                    loss.backward()
                for key, value in parts.items():  # losses already carry their share; means are weighted here
                    weight = 1.0 if key in ("loss", "value_loss") else len(rows) / len(minibatch)
                    sums[key] = sums.get(key, 0.0) + value * weight
            if critic is not None:
                critic_params = [p for group in critic.optimizer.param_groups for p in group["params"]]
                _clip_and_step(critic_params, critic.optimizer, cfg.max_grad_norm)
            if not warmup:
                sums["grad_norm"] = sums.get("grad_norm", 0.0) + _clip_and_step(policy_params, ctx.optimizer,
                                                                                cfg.max_grad_norm)
            updates += 1
    ctx.scheduler.step()
    metrics = {k: v / updates for k, v in sums.items()}
    metrics["lr"] = ctx.scheduler.get_last_lr()[0]
    return metrics


def row_tokens(prompts: PromptBatch, traj: Trajectories) -> tuple[Tensor, Tensor]:
    """Per trajectory row: its prompt's length (left padding excluded) and its completion's length [N], [N]."""
    return prompts.attention_mask.sum(-1)[traj.prompt_index], traj.loss_mask.sum(-1)


def micro_batches(rows: Tensor, lengths: tuple[Tensor, Tensor] | None, max_rows: int = 0, max_tokens: int = 0
                  ) -> list[Tensor]:
    """Split a minibatch's row indices into forward/backward chunks.

    Without a token budget: consecutive chunks of `max_rows` (0 = one chunk). With `max_tokens`: rows go longest
    first (prompt + completion), and a chunk closes before its padded size, rows x (longest prompt + longest
    completion), would pass `max_tokens` or its row count `max_rows`; a row longer than the budget goes alone. Every
    row lands in exactly one chunk; the order of rows never changes the gradient (losses are normalised by the whole
    minibatch).
    """
    if not max_tokens:
        return list(rows.split(max_rows or len(rows)))
    prompt_len, completion_len = (x[rows] for x in lengths)
    order = torch.argsort(prompt_len + completion_len, descending=True, stable=True)
    chunks, current, p_max, c_max = [], [], 0, 0
    for i in order.tolist():
        p, c = max(p_max, int(prompt_len[i])), max(c_max, int(completion_len[i]))
        if current and ((len(current) + 1) * (p + c) > max_tokens or len(current) == (max_rows or len(rows))):
            chunks.append(rows[current])
            current, p, c = [], int(prompt_len[i]), int(completion_len[i])
        current.append(i)
        p_max, c_max = p, c
    return chunks + [rows[current]]


def micro_batch_loss(ctx: StepContext, prompts: PromptBatch, traj: Trajectories, rows: Tensor, mb_tokens: Tensor,
                     mb_seqs: float, warmup: bool) -> tuple[Tensor, dict[str, float]]:
    """This chunk's share of the minibatch loss (policy loss, KL in the loss, entropy bonus, value loss)."""
    algo, critic = ctx.algorithm, ctx.critic
    mask = traj.loss_mask[rows]
    out = ctx.forward(prompts, traj.prompt_index[rows], traj.completion_ids[rows], mask, ctx.rollout.temperature,
                      with_entropy=True, entropy_grad=algo.entropy_coef > 0,
                      with_hidden=critic is not None and critic.mode == "head")
    pl = POLICY_LOSSES[algo.policy_loss](out.logprobs, traj.old_logprobs[rows], traj.advantages[rows], mask,
                                         epsilon_low=algo.epsilon_low, epsilon_high=algo.epsilon_high,
                                         dual_clip=algo.dual_clip)
    per_token = pl.per_token_loss
    parts = {"clip_fraction": pl.clip_fraction.item(), "entropy": masked_mean(out.entropy.detach(), mask).item()}
    if traj.ref_logprobs is not None:
        kl = kl_estimate(out.logprobs, traj.ref_logprobs[rows], algo.kl_estimator)
        if algo.kl_in == "loss" and algo.beta:
            per_token = per_token + algo.beta * kl
        parts["kl"] = masked_mean(kl.detach(), mask).item()
    if algo.entropy_coef:
        per_token = per_token - algo.entropy_coef * out.entropy
    loss = aggregate(per_token, mask, algo.loss_aggregation, ctx.rollout.max_new_tokens, batch_tokens=mb_tokens,
                     batch_sequences=mb_seqs)
    if warmup:
        loss = loss * 0.0
    if critic is not None:
        if critic.mode == "head":
            values = critic.values_from_hidden(out.hidden, mask)
        else:
            values = critic.values(prompts, traj.prompt_index[rows], traj.completion_ids[rows], mask,
                                   ctx.rollout.temperature)
        vl, vclip = value_loss(values, traj.old_values[rows], traj.returns[rows], mask, algo.value_clip)
        vl = aggregate(vl, mask, "token-mean", batch_tokens=mb_tokens)
        loss = loss + (algo.vf_coef if critic.mode == "head" else 1.0) * vl
        parts.update({"value_loss": vl.item(), "value_clip_fraction": vclip.item()})
    parts["loss"] = loss.item()
    return loss, parts


def dpo_pairs(rewards: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Online DPO pairs: in each group whose rewards differ, the best answer (chosen) and the worst (rejected);
    ties go to the earliest row. Returns row indices (chosen [P], rejected [P])."""
    groups = rewards.view(-1, group_size)
    differ = (groups.max(1).values - groups.min(1).values) > 1e-8
    base = torch.arange(groups.shape[0]) * group_size
    chosen = (base + groups.argmax(1))[differ]
    rejected = (base + groups.argmin(1))[differ]
    return chosen, rejected


def update_online_dpo(ctx: StepContext, prompts: PromptBatch, traj: Trajectories) -> dict[str, float]:
    """One optimizer step of DPO on (best, worst) answer pairs from the policy's own groups.

    The loss is the mean over the step's pairs on all ranks. Under torchrun a rank whose groups gave no pair still
    runs one forward with a zero loss, so that DDP/FSDP2's gradient synchronisation sees every rank."""
    algo, cfg = ctx.algorithm, ctx.trainer
    chosen, rejected = dpo_pairs(traj.rewards, ctx.rollout.group_size)
    metrics = {"dpo/pairs": float(len(chosen))}
    pairs = float(all_sum(len(chosen), ctx.dist))  # the step's pairs on all ranks
    if pairs == 0:
        ctx.scheduler.step()
        return {**metrics, "loss": 0.0, "lr": ctx.scheduler.get_last_lr()[0]}
    ctx.optimizer.zero_grad(set_to_none=True)
    per_rank = pairs / ctx.dist.world  # DDP/FSDP2 average gradients over ranks
    total, margins, micro = 0.0, [], cfg.micro_batch or max(len(chosen), 1)
    starts = list(range(0, len(chosen), micro)) or [0]
    for i, start in enumerate(starts):
        c, r = chosen[start:start + micro], rejected[start:start + micro]
        idle = len(c) == 0  # no pair on this rank: one row, weight 0
        both = torch.zeros(1, dtype=torch.long) if idle else torch.cat([c, r])
        mask = traj.loss_mask[both]
        with no_sync(ctx.forward, last=i == len(starts) - 1):
            out = ctx.forward(prompts, traj.prompt_index[both], traj.completion_ids[both], mask,
                              ctx.rollout.temperature)
            if idle:
                loss = out.logprobs.sum() * 0.0
            else:
                seq = out.logprobs.sum(-1)
                ref = (traj.ref_logprobs[both] * mask).sum(-1)
                k = len(c)
                loss, margin = dpo_loss(seq[:k], seq[k:], ref[:k], ref[k:], algo.dpo_beta, algo.dpo_label_smoothing)
                loss = loss.sum() / per_rank
                margins.append(margin)
            loss.backward()
        total += loss.item()  # (over ranks, reduce_metrics' mean of these is the mean over all pairs)
    grad_norm = _clip_and_step([p for p in ctx.policy.model.parameters() if p.requires_grad], ctx.optimizer,
                               cfg.max_grad_norm)
    ctx.scheduler.step()
    margin = torch.cat(margins) if margins else torch.zeros(0)
    # sums scaled so that the mean over ranks (reduce_metrics) is the mean over all of the step's pairs
    return {**metrics, "loss": total, "grad_norm": grad_norm, "lr": ctx.scheduler.get_last_lr()[0],
            "dpo/margin": margin.sum().item() / per_rank, "dpo/accuracy": (margin > 0).sum().item() / per_rank}
