"""Stage IV, update: the policy-gradient update (with optional critic) and online DPO.

`ppo_epochs` passes over the rollout batch, each split into exactly `minibatches` minibatches (sizes differ by at
most one row; one optimizer step each) and chunks of at most `micro_batch` rows and `micro_batch_tokens` padded
tokens (gradient accumulation: memory only; every chunk's loss is normalised by its whole minibatch, so the gradient
does not depend on the chunking).

With `replay` (vlmrl/trainer/replay.py), each optimizer step of a due RL step also accumulates weight x the SFT
loss of a labelled batch into the gradients before it is taken.

Every optimizer step goes through `guarded_step` (vlmrl/trainer/guard.py): a non-finite loss or gradient norm skips
it on every rank and is counted (`nonfinite_steps`, over the run), `trainer.max_nonfinite_steps` in a row stop the
run, and an all-zero policy gradient is not stepped. The learning-rate schedule advances once per update in which the
policy took at least one optimizer step (`optimizer_steps` counts them), never for a skipped one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.algorithms.advantages import nonzero_variance_groups
from vlmrl.algorithms.correction import correction_weights, mismatch_metrics
from vlmrl.algorithms.kl import kl_estimate
from vlmrl.algorithms.losses import aggregate, dpo_loss, masked_mean, resolve_policy_loss, value_loss
from vlmrl.models.batch import PromptBatch
from vlmrl.models.scoring import logprob_gap, micro_batches, row_lengths
from vlmrl.trainer.distributed import all_max, all_sum, gather_counts, no_sync
from vlmrl.trainer.guard import guarded_step
from vlmrl.trainer.types import StepContext, Trajectories


def _finish(ctx: StepContext, metrics: dict[str, float], policy_steps: int) -> dict[str, float]:
    """Advance the learning-rate schedule when the policy moved; add the step-count metrics and the lr."""
    if policy_steps:
        ctx.scheduler.step()
    metrics["optimizer_steps"] = float(policy_steps)
    metrics["nonfinite_steps"] = float(ctx.guard.total)
    metrics["lr"] = ctx.scheduler.get_last_lr()[0]
    return metrics


def update(ctx: StepContext, prompts: PromptBatch, traj: Trajectories) -> dict[str, float]:
    if ctx.algorithm.policy_loss == "dpo":
        return update_online_dpo(ctx, prompts, traj)
    algo, cfg, critic = ctx.algorithm, ctx.trainer, ctx.critic
    n = 0 if traj.padding else traj.advantages.shape[0]
    warmup = critic is not None and ctx.step <= algo.critic_warmup_steps  # train only the critic
    policy_params = [p for p in ctx.policy.model.parameters() if p.requires_grad]
    sums: dict[str, float] = {"loss": 0.0}  # (a rank holding only padding: its share of the loss is 0)
    updates, policy_steps, finite_norms, gap_sum, gap_max, gap_count = 0, 0, 0, 0.0, 0.0, 0
    # the proximal policy's log-probs for the mismatch metrics: recomputed before the update, or (batch used once, or
    # the behaviour denominator) this update's forward before its first optimizer step, on the rows it scored then
    proximal = traj.old_logprobs if algo.ratio_denominator == "proximal" else None
    scored_before = None
    if proximal is None and traj.sample_logprobs is not None and n:
        proximal = torch.zeros_like(traj.sample_logprobs)
        scored_before = torch.zeros(n, dtype=torch.bool)
    for epoch in range(cfg.ppo_epochs):
        for minibatch in minibatch_rows(n, ctx):
            # normalise by the whole minibatch across ranks; DDP/FSDP2 average gradients over ranks, hence / world
            world = ctx.dist.world
            mb_tokens = (all_sum(traj.loss_mask[minibatch].sum(), ctx.dist) / world).clamp(min=1).float()
            mb_seqs = float(all_sum(len(minibatch), ctx.dist)) / world
            ctx.optimizer.zero_grad(set_to_none=True)
            if critic is not None:
                critic.optimizer.zero_grad(set_to_none=True)
            lengths = row_tokens(prompts, traj) if cfg.micro_batch_tokens else None
            chunks = [c for c in micro_batches(minibatch, lengths, cfg.micro_batch, cfg.micro_batch_tokens) if len(c)]
            chunks = padded_chunks(chunks, ctx)
            mb_loss = 0.0
            for i, rows in enumerate(chunks):
                with no_sync(ctx.forward, last=i == len(chunks) - 1):
                    if rows is None:  # this rank has no rows left: a zero-weight forward keeps the ranks in step
                        idle_forward(ctx, prompts, traj)
                        continue
                    loss, parts = micro_batch_loss(ctx, prompts, traj, rows, mb_tokens, mb_seqs, warmup)
                    loss.backward()
                mb_loss += parts["loss"]
                gap = parts.pop("_gap", None)
                logp = parts.pop("_logp")
                if scored_before is not None and epoch == 0 and updates == 0:
                    proximal[rows], scored_before[rows] = logp, True
                if gap is not None and epoch == 0 and updates == 0:  # same weights as the sampler's
                    gap_sum, gap_max, gap_count = gap_sum + gap[0], max(gap_max, gap[1]), gap_count + gap[2]
                for key, value in parts.items():  # losses already carry their share; means are weighted here
                    weight = 1.0 if key in ("loss", "value_loss") else len(rows) / len(minibatch)
                    sums[key] = sums.get(key, 0.0) + value * weight
            if ctx.replay is not None and ctx.replay.due(ctx.step) and not warmup:  # + weight x the SFT loss
                replay_loss = ctx.replay.backward(ctx.policy, ctx.generator, ctx.forward, ctx.dist)
                mb_loss += ctx.replay.weight * replay_loss
                sums["replay/loss"] = sums.get("replay/loss", 0.0) + replay_loss
            groups = [] if warmup else [(ctx.optimizer, policy_params)]
            if critic is not None:
                if ctx.dist.active:  # the critic is outside the policy's wrapper: its gradients averaged here
                    critic.average_gradients(ctx.dist)
                groups.append((critic.optimizer, critic.parameters()))
            step = guarded_step(groups, mb_loss, cfg.max_grad_norm, ctx.guard, ctx.dist, ctx.step,
                                cfg.max_nonfinite_steps)
            if not warmup:
                policy_steps += step.stepped[0]
                if step.finite:  # (a skipped non-finite step's norm is not averaged into the curve)
                    sums["grad_norm"] = sums.get("grad_norm", 0.0) + step.norms[0]
                    finite_norms += 1
            updates += 1
    metrics = {k: v / updates for k, v in sums.items() if k != "grad_norm"}
    if finite_norms:
        metrics["grad_norm"] = sums["grad_norm"] / finite_norms
    if traj.old_logprobs is None and traj.sample_logprobs is not None and gap_count:  # sampler vs the update's forward
        metrics["rollout/logprob_gap_mean"] = gap_sum / max(gap_count, 1)
        metrics["rollout/logprob_gap_max"] = gap_max
    if proximal is not None and traj.sample_logprobs is not None:  # the sampler–trainer mismatch (correction.py)
        seen = slice(None) if scored_before is None else scored_before
        images = None if traj.prompt_images is None else traj.prompt_images[seen]
        metrics.update(mismatch_metrics(proximal[seen], traj.sample_logprobs[seen], traj.loss_mask[seen],
                                        ctx.correction, images))
    return _finish(ctx, metrics, policy_steps)


def minibatch_rows(n: int, ctx: StepContext) -> list[Tensor]:
    """This rank's rows (of its n) in each of exactly `trainer.minibatches` minibatches of one pass: a permutation
    of the step's rows on all ranks, split into minibatches (sizes differ by at most one row), each rank taking its
    own. The permutation is drawn from the run's generator over the step's total row count, so every rank draws the
    same (the generator also draws the prompts: it must stay the same on every rank, whatever rows each holds) and a
    minibatch holds the rows it would hold in one process. A rank's rows come after those of lower ranks."""
    m = ctx.trainer.minibatches
    if m == 1:
        return [torch.arange(n)]
    counts = gather_counts(n, ctx.dist)
    offset = sum(counts[:ctx.dist.rank])
    order = torch.randperm(sum(counts), generator=ctx.generator)
    return [rows[(rows >= offset) & (rows < offset + n)] - offset for rows in order.tensor_split(m)]


def idle_forward(ctx: StepContext, prompts: PromptBatch, traj: Trajectories) -> None:
    """One row's forward and backward with a zero loss: the collectives of a chunk, none of its gradient."""
    row = torch.zeros(1, dtype=torch.long)
    out = ctx.forward(prompts, traj.prompt_index[row], traj.completion_ids[row], traj.loss_mask[row].clamp(min=1),
                      ctx.rollout.temperature, with_hidden=ctx.critic is not None and ctx.critic.mode == "head")
    loss = out.logprobs.sum() * 0.0
    if out.hidden is not None:
        loss = loss + ctx.critic.values_from_hidden(out.hidden, traj.loss_mask[row]).sum() * 0.0
    loss.backward()


def row_tokens(prompts: PromptBatch, traj: Trajectories) -> tuple[Tensor, Tensor]:
    """Per trajectory row: its prompt's length (left padding excluded) and its completion's length [N], [N]."""
    return row_lengths(prompts, traj.prompt_index, traj.loss_mask)


def padded_chunks(chunks: list[Tensor], ctx: StepContext) -> list[Tensor | None]:
    """`chunks`, then `None` (a zero-weight forward/backward) until every rank has as many as the rank with the most:
    FSDP2 gathers and reduces parameters in every forward and backward, so all ranks must run the same sequence of
    them whatever their data (a token budget gives longer answers more chunks)."""
    if not ctx.dist.active:
        return list(chunks)
    most = int(all_max(len(chunks), ctx.dist))
    return list(chunks) + [None] * (most - len(chunks))


def micro_batch_loss(ctx: StepContext, prompts: PromptBatch, traj: Trajectories, rows: Tensor, mb_tokens: Tensor,
                     mb_seqs: float, warmup: bool) -> tuple[Tensor, dict[str, float]]:
    """This chunk's share of the minibatch loss (policy loss, KL in the loss, entropy bonus, value loss)."""
    algo, critic = ctx.algorithm, ctx.critic
    mask = traj.loss_mask[rows]
    out = ctx.forward(prompts, traj.prompt_index[rows], traj.completion_ids[rows], mask, ctx.rollout.temperature,
                      with_entropy=True, entropy_grad=algo.entropy_coef > 0,
                      with_hidden=critic is not None and critic.mode == "head")
    # used once: the old log-probs are this forward's own (detached), so the first ratio is exactly 1
    old = out.logprobs.detach() if traj.old_logprobs is None else traj.old_logprobs[rows]
    pl = resolve_policy_loss(algo.policy_loss)(logp=out.logprobs, old_logp=old, advantages=traj.advantages[rows],
                                               mask=mask, epsilon_low=algo.epsilon_low,
                                               epsilon_high=algo.epsilon_high, dual_clip=algo.dual_clip)
    per_token = pl.per_token_loss
    if ctx.correction.method != "none" and traj.sample_logprobs is not None:  # the sampler–trainer gap, corrected
        per_token = per_token * correction_weights(old, traj.sample_logprobs[rows], mask, ctx.correction)
    parts = {"_logp": out.logprobs.detach(), "clip_fraction": pl.clip_fraction.item(),
             "entropy": masked_mean(out.entropy.detach(), mask).item()}
    if traj.ref_logprobs is not None:
        kl = kl_estimate(out.logprobs, traj.ref_logprobs[rows], algo.kl_estimator)
        if algo.kl_in == "loss" and ctx.kl.beta:
            per_token = per_token + ctx.kl.beta * kl
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
    if traj.old_logprobs is None and traj.sample_logprobs is not None:
        parts["_gap"] = logprob_gap(traj.sample_logprobs[rows], out.logprobs, mask)
    return loss, parts


def dpo_pairs(rewards: Tensor, group_size: int, scored: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Online DPO pairs: in each group whose scored rewards differ, the best scored answer (chosen) and the worst
    (rejected); ties go to the earliest row; an answer whose reward failed is never in a pair. Returns row indices
    (chosen [P], rejected [P])."""
    groups = rewards.view(-1, group_size)
    keep = torch.ones_like(groups, dtype=torch.bool) if scored is None else scored.to(groups.device).view_as(groups)
    differ = nonzero_variance_groups(rewards, group_size, scored=scored)
    base = torch.arange(groups.shape[0], device=groups.device) * group_size
    chosen = (base + groups.masked_fill(~keep, float("-inf")).argmax(1))[differ]
    rejected = (base + groups.masked_fill(~keep, float("inf")).argmin(1))[differ]
    return chosen, rejected


def update_online_dpo(ctx: StepContext, prompts: PromptBatch, traj: Trajectories) -> dict[str, float]:
    """One optimizer step of DPO on (best, worst) answer pairs from the policy's own groups.

    The loss is the mean over the step's pairs on all ranks. Under torchrun a rank whose groups gave no pair still
    runs one forward with a zero loss, so that DDP/FSDP2's gradient synchronisation sees every rank."""
    algo, cfg = ctx.algorithm, ctx.trainer
    chosen, rejected = dpo_pairs(traj.rewards, ctx.rollout.group_size, traj.scored)
    metrics = {"dpo/pairs": float(len(chosen))}
    pairs = float(all_sum(len(chosen), ctx.dist))  # the step's pairs on all ranks
    if pairs == 0:  # nothing to learn from: no optimizer step, and the schedule waits
        return _finish(ctx, {**metrics, "loss": 0.0}, 0)
    ctx.optimizer.zero_grad(set_to_none=True)
    per_rank = pairs / ctx.dist.world  # DDP/FSDP2 average gradients over ranks
    total, margins, micro = 0.0, [], cfg.micro_batch or max(len(chosen), 1)
    # every rank runs as many chunks as the rank with the most pairs (FSDP2 collectives); past its own, idle ones
    chunks = int(all_max(max(1, -(-len(chosen) // micro)), ctx.dist))
    starts = [i * micro for i in range(chunks)]
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
    step = guarded_step([(ctx.optimizer, [p for p in ctx.policy.model.parameters() if p.requires_grad])], total,
                        cfg.max_grad_norm, ctx.guard, ctx.dist, ctx.step, cfg.max_nonfinite_steps)
    margin = torch.cat(margins) if margins else torch.zeros(0)
    # sums scaled so that the mean over ranks (reduce_metrics) is the mean over all of the step's pairs
    metrics.update({"loss": total, "grad_norm": step.norms[0], "dpo/margin": margin.sum().item() / per_rank,
                    "dpo/accuracy": (margin > 0).sum().item() / per_rank})
    return _finish(ctx, metrics, int(step.stepped[0]))
