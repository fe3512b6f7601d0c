"""One RL step in four stages: I collect -> II score -> III trajectories -> IV update.

Each stage is a function with a typed result, so one step can be traced from `rl_step` to `optimizer.step()` in
this file and `update.py`, and a researcher can swap a stage. The math lives in `vlmrl.algorithms` (advantages,
losses, KL estimators).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlmrl.agent.rollout import agent_metrics
from vlmrl.algorithms.advantages import nonzero_variance_groups, resolve_advantage, zero_variance_fraction
from vlmrl.algorithms.kl import kl_estimate
from vlmrl.eval.generative import correctness
from vlmrl.eval.metrics import marker_sets
from vlmrl.eval.reasoning import rollout_metrics, token_counter
from vlmrl.models.batch import PromptBatch, concat_prompt_batches
from vlmrl.models.scoring import logprob_gap, score_batch
from vlmrl.rewards import RewardOutput, compute_rewards
from vlmrl.rollout.batch import make_prompts, reward_columns
from vlmrl.rollout.generate import Rollout, concat_rollouts, generate
from vlmrl.trainer.distill import distill_advantages
from vlmrl.trainer.distributed import all_sum, gather_counts, gather_lists, gathered, shard, whole_ranks
from vlmrl.trainer.step_metrics import add_counts, pass_rate_histogram, task_reward_counts, task_signal_counts
from vlmrl.trainer.types import StepContext, Trajectories
from vlmrl.trainer.update import update


def prompt_seed(seed: int, step: int, round_index: int, position: int) -> int:
    """The random stream of one prompt's answers: a function of (seed, step, resampling round, global position), so
    a step samples the same answers in one process or sharded across ranks."""
    return (((seed * 1_000_003 + step) * 1_000_033 + round_index) * 1_000_037 + position) % (2**63 - 1)


@dataclass
class Batch:
    """Stages I + II output: prompts, G answers each, and their rewards (row n answers prompt prompt_index[n])."""

    samples: list[dict]
    prompts: PromptBatch
    rollout: Rollout
    rewards: RewardOutput
    columns: dict[str, list]
    baseline_rewards: Tensor | None = None  # ReMax: reward of the prompt's greedy answer, per row
    stats: dict[str, float] = field(default_factory=dict)
    greedy: Rollout | None = None  # ReMax: the greedy answer of each prompt (one row per prompt)
    baseline_scored: Tensor | None = None  # ReMax, per row: the greedy answer's reward did not fail
    correct: list[bool] = field(default_factory=list)  # per row: `correctness` of the answer (pass rates, accuracy)
    padding: bool = False  # torchrun + dynamic sampling: a group this rank holds only to run the update's collectives

    def scored(self) -> Tensor:
        """bool [N]: rows whose reward (and, for ReMax, whose baseline) could be computed; a failed one (a judge
        timeout, an exception in a reward) trains nothing. Padding trains nothing either."""
        scored = self.rewards.scored()
        if self.padding:
            return torch.zeros_like(scored)
        return scored if self.baseline_scored is None else scored & self.baseline_scored


# -- Stage I: collect ------------------------------------------------------------------------------------------------
def sampling_mode(ctx: StepContext):
    """The policy in eval mode while the built-in sampler generates with it. With an engine (vLLM) the policy only
    prepares the prompts, so its mode is left alone: an asynchronous producer runs beside the update on the live
    model, and switching it to eval mode there would turn gradient checkpointing and dropout off mid-update."""
    return ctx.policy.sampling() if ctx.engine is None else nullcontext()


def collect(ctx: StepContext, samples: list[dict], group_size: int | None = None,
            temperature: float | None = None, round_index: int = 0, offset: int = 0) -> tuple[PromptBatch, Rollout]:
    """G answers for every prompt, in one batched generation call. `offset`: the global position of samples[0] in
    its round (a rank's shard starts there), which with the step and round names each prompt's random stream."""
    prompts = make_prompts(ctx.policy, samples, ctx.template, ctx.max_prompt_length)
    r = ctx.rollout
    seeds = [prompt_seed(ctx.trainer.seed, ctx.step, round_index, offset + i) for i in range(len(samples))]
    temperature = r.temperature if temperature is None else temperature
    if ctx.agent is not None:  # multi-turn: the rollout's context holds each trajectory's whole conversation
        # (on vLLM every turn samples in the engine: the policy's full parameters are not needed)
        with sampling_mode(ctx), gathered(ctx.forward) if ctx.engine is None else nullcontext():
            out = ctx.agent.rollout(ctx.policy, prompts, samples, group_size or r.group_size, temperature, r.top_k,
                                    r.top_p, seeds, engine=ctx.engine)
        return prompts, out.rollout
    if ctx.engine is not None:
        return prompts, ctx.engine.generate(ctx.policy, prompts, samples, group_size or r.group_size,
                                            r.max_new_tokens, temperature, r.top_k, r.top_p, seeds)
    with ctx.policy.sampling(), gathered(ctx.forward):
        rollout = generate(ctx.policy, prompts, group_size or r.group_size, r.max_new_tokens, temperature, r.top_k,
                           r.top_p, ctx.generator, prompt_seeds=seeds)
    return prompts, rollout


# -- Stage II: score -------------------------------------------------------------------------------------------------
def score(ctx: StepContext, samples: list[dict], rollout: Rollout) -> tuple[RewardOutput, dict[str, list]]:
    """Every reward function on every answer; failures are marked (`RewardOutput.failed`) and counted, never
    raised, and never scored as a low reward."""
    columns = reward_columns(samples, rollout.prompt_index)
    columns["completion_truncated"] = rollout.truncated.tolist()
    columns["completion_lengths"] = rollout.lengths.tolist()
    columns.update(rollout.columns)  # multi-turn: turns, tool_calls, tool_failures, num_turns, env_reward
    return compute_rewards(ctx.rewards, rollout.texts, columns), columns


def collect_and_score(ctx: StepContext, samples: list[dict], round_index: int = 0) -> Batch:
    """Stages I + II for one generation round over `samples`, the round's prompts in order. Under torchrun this rank
    generates and scores its contiguous shard of them (the returned batch), and the curriculum observes every
    rank's groups, in the round's order, so its pass rates and filters are the same on every rank."""
    return score_collected(ctx, samples, collect_shard(ctx, samples, round_index))


def collect_shard(ctx: StepContext, samples: list[dict], round_index: int = 0) -> tuple:
    """Stage I of one round: this rank's shard of `samples`, its prompts and answers."""
    start, stop = shard(len(samples), ctx.dist)
    mine = samples[start:stop]
    return (mine, *collect(ctx, mine, round_index=round_index, offset=start))


def score_collected(ctx: StepContext, samples: list[dict], collected: tuple) -> Batch:
    """Stage II of one round collected by `collect_shard` (and ReMax's greedy answers, which it samples)."""
    mine, prompts, rollout = collected
    start = shard(len(samples), ctx.dist)[0]
    rewards, columns = score(ctx, mine, rollout)
    batch = Batch(mine, prompts, rollout, rewards, columns, correct=correctness(rollout.texts, columns, ctx.solved,
                                                                                 rewards))
    if ctx.observe is not None:  # the curriculum's pass rates: every generated group, resampling rounds included
        correct, g = gather_lists(batch.correct, ctx.dist), ctx.rollout.group_size
        signal = gather_lists(nonzero_variance_groups(rewards.total, g, scored=batch.scored()).tolist(), ctx.dist)
        for i, s in enumerate(samples):
            ctx.observe(s, correct[i * g:(i + 1) * g], signal[i])
    if ctx.algorithm.advantage == "remax":  # ReMax's baseline: the reward of the greedy answer to the same prompt
        _, batch.greedy = collect(ctx, mine, group_size=1, temperature=0.0, offset=start)
        greedy_rewards = score(ctx, mine, batch.greedy)[0]
        batch.baseline_rewards = greedy_rewards.total[rollout.prompt_index]
        batch.baseline_scored = greedy_rewards.scored()[rollout.prompt_index]
    return batch


def keep_groups(batch: Batch, keep: Tensor, group_size: int) -> Batch:
    """The groups (prompts) where `keep` [num_prompts] is True, all stage I/II data kept aligned."""
    prompts_kept = keep.nonzero().flatten()
    rows = (prompts_kept[:, None] * group_size + torch.arange(group_size)).flatten()
    new_index = torch.arange(len(prompts_kept)).repeat_interleave(group_size)
    rewards = batch.rewards.select(rows.tolist())
    greedy = batch.greedy
    return Batch([batch.samples[i] for i in prompts_kept.tolist()], batch.prompts.subset(prompts_kept.tolist()),
                 batch.rollout.select(rows, new_index), rewards,
                 {k: [v[i] for i in rows.tolist()] for k, v in batch.columns.items()},
                 None if batch.baseline_rewards is None else batch.baseline_rewards[rows], batch.stats,
                 None if greedy is None else greedy.select(prompts_kept, torch.arange(len(prompts_kept))),
                 None if batch.baseline_scored is None else batch.baseline_scored[rows],
                 [batch.correct[i] for i in rows.tolist()])


def concat_batches(batches: list[Batch], pad_token_id: int) -> Batch:
    rewards = RewardOutput.concat([b.rewards for b in batches])
    remax = batches[0].greedy is not None
    return Batch([s for b in batches for s in b.samples],
                 concat_prompt_batches([b.prompts for b in batches], pad_token_id),
                 concat_rollouts([b.rollout for b in batches], pad_token_id), rewards,
                 {k: [v for b in batches for v in b.columns[k]] for k in batches[0].columns},
                 torch.cat([b.baseline_rewards for b in batches]) if remax else None, batches[0].stats,
                 concat_rollouts([b.greedy for b in batches], pad_token_id) if remax else None,
                 torch.cat([b.baseline_scored for b in batches]) if remax else None,
                 [c for b in batches for c in b.correct])


def step_prompt_cap(ctx: StepContext) -> int:
    """The most prompts one dynamic-sampling step generates for: (1 + max_resample_rounds) x prompts_per_step."""
    return (1 + ctx.algorithm.max_resample_rounds) * ctx.rollout.prompts_per_step


def first_round_size(ctx: StepContext) -> int:
    """How many prompts a step's first generation call draws: prompts_per_step, or under dynamic sampling's fill
    draw as many as the previous step's share of groups with a signal says will fill the batch (at most the step's
    (1 + max_resample_rounds) x prompts_per_step), so most steps need one call. Under torchrun, a multiple of the
    number of processes."""
    want, a, share = ctx.rollout.prompts_per_step, ctx.algorithm, ctx.signal_share
    if not (a.dynamic_sampling and a.resample_draw == "fill") or share is None:
        return want
    cap = step_prompt_cap(ctx)
    return cap if share <= 0 else min(cap, whole_ranks(max(want, math.ceil(want / share)), ctx.dist))


def resample_size(ctx: StepContext, found: int, generated: int) -> int:
    """How many prompts the next dynamic-sampling round draws, after `generated` prompts gave `found` groups with a
    signal in this step: prompts_per_step, or (resample_draw "fill") the missing groups divided by the share found so
    far, within what is left of the step's (1 + max_resample_rounds) x prompts_per_step prompts (0: stop). Under
    torchrun, a multiple of the number of processes (prompts_per_step is one, so the cap is too)."""
    want, a = ctx.rollout.prompts_per_step, ctx.algorithm
    if a.resample_draw == "batch":
        return want
    missing, left = want - found, step_prompt_cap(ctx) - generated
    return max(0, min(left, whole_ranks(max(missing, math.ceil(missing * generated / max(found, 1))), ctx.dist)))


def dynamic_sampling(ctx: StepContext, first: Batch, draw: Callable[[int], list[dict]], first_size: int) -> Batch:
    """DAPO's dynamic sampling: keep groups whose rewards differ; sample more prompts (up to max_resample_rounds
    extra generation calls, each of `resample_size` prompts) until prompts_per_step such groups are found; use what
    was found if the cap is hit. Only scored answers count: a failed reward is no difference between answers.

    `first_size`: the first round's prompts on all ranks. Under torchrun every rank runs the same rounds (the
    counts that decide them are summed over the ranks), and the kept groups are the first prompts_per_step in the
    rounds' order, wherever they were generated: each rank trains the ones it holds (the update normalises by the
    whole step's tokens). A rank that holds none keeps one group as padding, which trains nothing (`Batch.padding`)
    but runs the update's collectives."""
    g, want = ctx.rollout.group_size, ctx.rollout.prompts_per_step
    kept, found, rounds, generated, size = [], 0, 0, 0, first_size
    batch, tasks = first, {}
    while True:
        generated += size
        keep = nonzero_variance_groups(batch.rewards.total, g, scored=batch.scored())
        add_counts(tasks, task_signal_counts(batch.samples, keep.tolist(), batch.correct, g))
        counts = gather_counts(int(keep.sum()), ctx.dist)  # each rank's groups with a signal, in the round's order
        before = found + sum(counts[:ctx.dist.rank])  # the round's groups on lower ranks come first
        keep &= torch.cumsum(keep.long(), 0) <= max(0, want - before)  # only the first `want` of the step
        if keep.any():
            kept.append(keep_groups(batch, keep, g))
        found += sum(counts)
        size = resample_size(ctx, found, generated)
        if found >= want or rounds >= ctx.algorithm.max_resample_rounds or size == 0:
            break
        rounds += 1
        batch = collect_and_score(ctx, draw(size), round_index=rounds)
    ctx.signal_share = found / generated  # (the next step's first round, under resample_draw "fill")
    stats = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/kept_groups": min(found, want),
             "dynamic_sampling/dropped_groups": generated - found, "dynamic_sampling/prompts": generated, **tasks}
    if not found:
        first.stats = {**stats, "dynamic_sampling/kept_groups": 0}
        return first  # nothing to learn from; the update sees all-zero advantages
    if not kept:  # other ranks hold this step's groups
        out = keep_groups(first, torch.arange(len(first.samples)) < 1, g)
        out.padding = True
    else:
        out = concat_batches(kept, ctx.policy.pad_token_id) if len(kept) > 1 else kept[0]
    # the share of ranks that held only padding this step (compute spent on collectives alone; 0 in one process)
    out.stats = {**stats, "dynamic_sampling/padding_ranks": float(out.padding)}
    return out


# -- Stage III: trajectories -----------------------------------------------------------------------------------------
def build_trajectories(ctx: StepContext, batch: Batch) -> Trajectories:
    """Old log-probs (recomputed when the batch is reused; when it is used once the update's own forward gives
    them), reference log-probs and the per-token KL when a reference exists, critic values for gae, then advantages
    by the named estimator. Every pass scores the batch in the update's chunks (`score_batch`), with full parameters
    under FSDP2 (the reference of a LoRA policy is the policy itself, adapters disabled).

    Rows whose reward failed (`Batch.scored`) get advantage 0, no loss and no place in any group or batch statistic.
    With `kl_in: reward`, -beta * KL is folded into the rewards: per token for reinforce_pp and gae, summed over the
    answer for the sequence-level estimators, and for ReMax into its greedy baseline too, so that an answer equal to
    the greedy one has advantage 0 (k1 is the estimator whose score-function gradient is the KL's; see kl.py)."""
    algo, rollout, temp = ctx.algorithm, batch.rollout, ctx.rollout.temperature
    mask = rollout.completion_mask
    args = (*rollout.scoring_inputs(batch.prompts), rollout.completion_ids, mask, temp)
    chunks = {"micro_batch": ctx.trainer.micro_batch, "micro_batch_tokens": ctx.trainer.micro_batch_tokens}
    beta = ctx.kl.beta  # fixed, or adapted after every step (algorithm.kl_target)
    reward_kl = algo.kl_in == "reward" and beta > 0 and ctx.reference is not None
    old = ref = values = policy_logprobs = greedy_kl = teacher_logprobs = None
    # no gradient: a critic's values would otherwise carry its graph into the advantages and value targets
    with torch.no_grad(), ctx.policy.sampling(), gathered(ctx.forward):
        recompute = not ctx.batch_used_once and algo.ratio_denominator == "proximal"
        if recompute or reward_kl:  # the policy's log-probs before the update
            policy_logprobs = score_batch(ctx.policy, *args, **chunks).logprobs
        if recompute:
            old = policy_logprobs
        if algo.ratio_denominator == "behaviour":  # bypass: the ratio is taken against the sampler itself
            old = rollout.logprobs.to(mask.device)
        if ctx.reference is not None:
            ref = ctx.reference.logprobs(*args, **chunks)
        if ctx.teacher is not None:  # on-policy distillation: the student's and the teacher's log-probs of its tokens
            if policy_logprobs is None:
                policy_logprobs = score_batch(ctx.policy, *args, **chunks).logprobs
            teacher_logprobs = ctx.teacher.logprobs(*args, samples=batch.samples, student=policy_logprobs, **chunks)
        if ctx.critic is not None:
            values = ctx.critic.values(*args, **chunks)
        if reward_kl and batch.greedy is not None:  # ReMax: the greedy baseline's own KL, summed over its tokens
            g = batch.greedy
            gargs = (*g.scoring_inputs(batch.prompts), g.completion_ids, g.completion_mask, temp)
            greedy_kl = (kl_estimate(score_batch(ctx.policy, *gargs, **chunks).logprobs,
                                     ctx.reference.logprobs(*gargs, **chunks), algo.kl_estimator)
                         * g.completion_mask).sum(-1)
    rewards = batch.rewards.total.to(mask.device)
    baseline = None if batch.baseline_rewards is None else batch.baseline_rewards.to(mask.device)
    scored = batch.scored().to(mask.device)
    kl = kl_estimate(policy_logprobs, ref, algo.kl_estimator) * mask if reward_kl else None
    reward_kl_beta = beta if reward_kl else 0.0
    if reward_kl_beta and algo.advantage in ("grpo", "rloo", "remax"):  # sequence-level estimators: fold sum_t KL
        rewards = rewards - reward_kl_beta * kl.sum(-1)
        if greedy_kl is not None:
            baseline = baseline - reward_kl_beta * greedy_kl[rollout.prompt_index]
    adv = resolve_advantage(algo.advantage)(
        rewards=rewards, group_size=ctx.rollout.group_size, scale=algo.advantage_scale, mask=mask, kl=kl,
        beta=reward_kl_beta, gamma=algo.gamma, lam=algo.lam, values=values, baseline=algo.reinforce_pp_baseline,
        baseline_rewards=baseline, scored=scored, reduce=rank_sum(ctx))
    advantages = adv.advantages
    if ctx.teacher is not None:
        advantages, distilled = distill_advantages(advantages, policy_logprobs, teacher_logprobs, mask,
                                                   ctx.teacher.coef)
        batch.stats = {**batch.stats, **distilled, **ctx.teacher.stats}
    loss_mask = mask * (~rollout.truncated).to(mask.device).long()[:, None] if algo.overlong_filter else mask
    loss_mask = loss_mask * scored.long()[:, None]  # a failed reward: no loss (its advantage is 0 too)
    images = torch.tensor([len(batch.samples[i].get("images") or []) for i in rollout.prompt_index.tolist()])
    return Trajectories(args[1], rollout.completion_ids, loss_mask, old, ref, advantages, rewards,
                        values, adv.returns, rollout.logprobs, scored, batch.padding, images)


def rank_sum(ctx: StepContext) -> Callable[[Tensor], Tensor] | None:
    """Sum over the data-parallel ranks, for the advantages' batch statistics (None in one process)."""
    if not ctx.dist.active:
        return None
    return lambda t: all_sum(t, ctx.dist).to(dtype=t.dtype, device=t.device)


# -- Stage IV: update -> vlmrl/trainer/update.py ---------------------------------------------------------------------
@dataclass
class Produced:
    """Stages I + II of one step, ready for III + IV: the batch to train, the step's first (i.i.d.) round that
    accuracy and lengths describe, the vision-tower calls and seconds they took, and under asynchronous rollouts the
    policy version (optimizer updates so far) that sampled it (vlmrl.trainer.asynchronous)."""

    batch: Batch
    first: Batch
    vision_calls: int
    seconds: float
    version: int | None = None


def produce(ctx: StepContext, samples: list[dict], draw: Callable[[int], list[dict]] | None = None) -> Produced:
    """Stages I + II of a step: every generation call of it, dynamic sampling's resampling rounds included."""
    t0 = time.perf_counter()
    vision_before = ctx.policy.family.vision_calls
    with sampling_mode(ctx):
        batch = collect_and_score(ctx, samples)
        vision_calls = ctx.policy.family.vision_calls - vision_before
        first = batch
        if ctx.algorithm.dynamic_sampling and draw is not None:
            batch = dynamic_sampling(ctx, batch, draw, len(samples))
    return Produced(batch, first, vision_calls, time.perf_counter() - t0)


def generate_step(ctx: StepContext, samples: list[dict]) -> tuple[tuple, int, float]:
    """Stage I of a step of one round (no dynamic sampling): what `score_step` scores, the vision-tower calls and
    the seconds it took."""
    t0 = time.perf_counter()
    vision_before = ctx.policy.family.vision_calls
    with sampling_mode(ctx):
        collected = collect_shard(ctx, samples)
    return collected, ctx.policy.family.vision_calls - vision_before, time.perf_counter() - t0


def score_step(ctx: StepContext, samples: list[dict], generated: tuple[tuple, int, float]) -> Produced:
    """Stage II of a step `generate_step` sampled: the step as `produce` gives it."""
    collected, vision_calls, seconds = generated
    t0 = time.perf_counter()
    batch = score_collected(ctx, samples, collected)
    return Produced(batch, batch, vision_calls, seconds + time.perf_counter() - t0)


def rl_step(ctx: StepContext, samples: list[dict], draw: Callable[[int], list[dict]] | None = None,
            markers: dict[str, tuple[str, ...]] | None = None) -> tuple[dict[str, float], list[dict]]:
    """One generation step: returns its metrics and rollout-gallery entries for its first prompts. `markers`: the
    word lists whose answer shares are logged (default `marker_sets()`: reflection, backtracking)."""
    return learn(ctx, produce(ctx, samples, draw), markers)


def learn(ctx: StepContext, produced: Produced, markers: dict[str, tuple[str, ...]] | None = None,
          push_weights: bool = True) -> tuple[dict[str, float], list[dict]]:
    """Stages III + IV on a produced batch, then the step's metrics and gallery entries (`gallery_entry`). `push_weights`: hand a vLLM
    engine the updated weights now (asynchronous rollouts push them when they next sample instead)."""
    batch, first, vision_calls = produced.batch, produced.first, produced.vision_calls
    t1 = time.perf_counter()
    if not ctx.policy.model.training:  # (a loaded model starts in eval mode) the update trains with dropout as set
        ctx.policy.model.train()
    traj = build_trajectories(ctx, batch)
    metrics = update(ctx, batch.rollout.scoring_inputs(batch.prompts)[0], traj)
    if traj.old_logprobs is not None and ctx.algorithm.ratio_denominator == "proximal":  # recomputed: the sampler's
        # gap to them (else the update's)
        total, largest, count = logprob_gap(batch.rollout.logprobs, traj.old_logprobs, batch.rollout.completion_mask)
        metrics["rollout/logprob_gap_mean"] = total / max(count, 1)
        metrics["rollout/logprob_gap_max"] = largest
    if ctx.engine is not None and push_weights:  # the next step samples from the updated weights
        with gathered(ctx.forward):
            ctx.engine.push_weights(ctx.policy)
    t2 = time.perf_counter()
    g = ctx.rollout.group_size
    rollout = first.rollout  # accuracy and lengths describe the i.i.d. sample, before any filtering
    correct = first.correct
    if "turns" in rollout.columns:  # multi-turn: tool use, failures, turns and images per episode
        metrics.update(agent_metrics(rollout.columns))
    metrics.update(first.rewards.metrics())
    metrics.update(task_reward_counts(first))
    if not any(k.endswith("/signal_groups") for k in batch.stats):  # one round: its groups, per task
        signal = nonzero_variance_groups(first.rewards.total, g, scored=first.scored()).tolist()
        metrics.update(task_signal_counts(first.samples, signal, first.correct, g))
    metrics.update(batch.stats)
    if not batch.padding:  # (a rank that trained nothing logs nothing about the trained batch)
        metrics.update(pass_rate_histogram(batch.correct, g))
        metrics["advantage_abs_mean"] = traj.advantages.abs().mean().item()
    metrics.update({
        "accuracy": sum(correct) / len(correct),
        "zero_variance_groups": zero_variance_fraction(first.rewards.total, g, scored=first.scored()),
        "response_length": rollout.lengths.float().mean().item(),
        "truncated_share": rollout.truncated.float().mean().item(),
        "vision_forward_calls_rollout": vision_calls,
        "time/collect_score": produced.seconds, "time/update": t2 - t1,
        "rollouts_per_second": len(rollout.texts) / (produced.seconds + t2 - t1),
        # tokens this rank processed (prompts once per answer, as the training forward sees them, plus answers)
        "tokens_per_second": float(batch.prompts.attention_mask.sum(-1)[batch.rollout.prompt_index].sum()
                                   + batch.rollout.lengths.sum()) / (produced.seconds + t2 - t1),
    })
    device = ctx.policy.family.device
    # reasoning chain, token efficiency, marker shares and compute per 1,000 rollouts, pooled over the ranks
    reduce = rank_sum(ctx)
    pool = None if reduce is None else lambda xs: reduce(torch.tensor(xs, dtype=torch.float64)).tolist()
    metrics.update(rollout_metrics(rollout.texts, correct, rollout.lengths.tolist(),
                                   token_counter(ctx.policy.processor.tokenizer), markers or marker_sets(),
                                   produced.seconds + t2 - t1,
                                   ctx.dist.world if device.type == "cuda" else 0, pool))
    if device.type == "cuda":  # this rank's peak GPU memory during the step
        metrics["memory/peak_gpu_gb"] = torch.cuda.max_memory_allocated(device) / 1024**3
        torch.cuda.reset_peak_memory_stats(device)
    gallery = [gallery_entry(first, p, g) for p in range(min(ctx.trainer.log_rollouts_prompts, len(first.samples)))]
    return metrics, gallery


def gallery_entry(first, p: int, g: int) -> dict:
    """The rollout-gallery entry of prompt `p` of a step's first round: its G answers, rewards, verdicts, components,
    the judge's feedback, the image (the logger saves it as RUN_DIR/gallery/*.png) and a multi-turn answer's turns."""
    s, rows = first.samples[p], slice(p * g, (p + 1) * g)
    rollout = first.rollout
    entry = {"id": s["id"], "problem": s["problem"], "solution": s["solution"], "answers": rollout.texts[rows],
             "rewards": first.rewards.total[rows].tolist(), "correct": first.correct[rows],
             "components": {k: v[rows] for k, v in first.rewards.components.items()},
             "details": {k: v[rows] for k, v in getattr(first.rewards, "details", {}).items()},  # judge feedback
             "image": (s.get("images") or [None])[0]}
    if "turns" in rollout.columns:  # multi-turn: each answer's turns, their tool calls and the images tools returned
        entry["turns"] = [[{k: t[k] for k in ("text", "tool_calls", "errors", "images")} for t in episode]
                          for episode in rollout.columns["turns"][rows]]
    return entry
