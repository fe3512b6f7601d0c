"""The RL phase of a `vlmrl train` job: its state (`RLJob`: the step context, the prompt stream or curriculum, what a
checkpoint saves) and how it is built (`prepare_rl`: reference, optimizer, scheduler, critic, curriculum, replay, the
adaptive KL controller; from a checkpoint's state when resuming). `vlmrl.trainer.run` drives it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmrl.agent import AgentSpec
from vlmrl.config import Config
from vlmrl.data import build_dataset
from vlmrl.errors import ConfigError
from vlmrl.eval.generative import Solved
from vlmrl.eval.metrics import marker_sets
from vlmrl.models.policy import Policy
from vlmrl.models.reference import Reference
from vlmrl.models.trainable import disable_dropout
from vlmrl.optim import adamw
from vlmrl.rewards import RewardSpec
from vlmrl.trainer.checkpoint import (
    begin_checkpoint,
    partial_path,
    rng_state,
    rotate_checkpoints,
    save_checkpoint,
    save_rank_rng,
)
from vlmrl.trainer.critic import Critic
from vlmrl.trainer.curriculum import Curriculum, difficulties
from vlmrl.trainer.distributed import (
    DistInfo,
    barrier,
    full_state_dict,
    gathered,
    load_sharded_optimizer,
    reduce_metrics,
    save_sharded_optimizer,
    shard,
    wrap,
)
from vlmrl.trainer.dpo import OfflineDPO, synthetic_preferences
from vlmrl.trainer.inputs import Datasets, PromptStream
from vlmrl.trainer.replay import Replay
from vlmrl.trainer.reward_guards import GuardStop
from vlmrl.trainer.rl import StepContext, first_round_size, learn, rl_step


def lr_lambda(schedule: str, warmup: int, total: int):
    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0
    return factor


@dataclass
class RLJob:
    """Everything the RL phase holds: the step context (policy, optimizer, scheduler, reference, critic), the prompt
    stream, offline DPO when configured, and what a checkpoint needs to save it."""

    cfg: Config
    ctx: StepContext
    stream: PromptStream
    train_set: list[dict]
    run_dir: Path
    start_eval: dict
    dpo: OfflineDPO | None = None
    wall_before: float = 0.0  # seconds of this run spent in earlier processes (up to the resumed checkpoint)
    notes: list[str] = field(default_factory=list)  # warnings the RL loop gave (repeated in the summary)
    guard_stop: GuardStop | None = None  # set when a guard ended the run (vlmrl.trainer.reward_guards)
    t_start: float = 0.0  # time.perf_counter() when this process started
    rollouts: object | None = None  # vlmrl.trainer.asynchronous.AsyncRollouts (rollout.asynchronous)
    rollout_policy: Policy | None = None  # the copy asynchronous rollouts sample with (max_staleness > 0)

    def checkpoint(self, step: int, eval_pending: bool = False) -> Path:
        """RUN_DIR/checkpoint-STEP, written atomically (vlmrl.trainer.checkpoint): the weights (loadable with
        from_pretrained) and the resumable state. Under torchrun every rank joins the gather, writes its RNG states
        and, under FSDP2, its optimizer shard, before rank 0 completes and publishes the folder. `eval_pending`: the
        evaluation scheduled at this step has not run (a stop); the resumed run runs it first."""
        ctx, dist_info, t = self.ctx, self.ctx.dist, self.cfg.trainer
        path = self.run_dir / f"checkpoint-{step}"
        sharded = dist_info.mode == "fsdp2" and dist_info.active
        if dist_info.is_main:
            begin_checkpoint(path)
        barrier(dist_info)
        staging = partial_path(path)
        full = full_state_dict(ctx.forward, dist_info)
        if sharded and ctx.optimizer.state:  # (an empty state needs no file; torch would "initialise" it with a step)
            save_sharded_optimizer(ctx.forward, ctx.optimizer, staging / "sharded", dist_info.group)
        if not dist_info.is_main:
            save_rank_rng(staging, dist_info.rank, ctx.generator)
        if self.rollouts is not None:  # the steps produced but not yet trained (whole steps, from every rank)
            self.rollouts.save(staging, dist_info.rank)
        barrier(dist_info)
        if dist_info.is_main:
            guard = getattr(ctx, "guard", None)
            state = {"step": step, "optimizer": None if sharded else ctx.optimizer.state_dict(),
                     "sharded_optimizer": sharded, "optimizer_empty": not ctx.optimizer.state,
                     "distributed": dist_info.mode, "world": dist_info.world,
                     "scheduler": ctx.scheduler.state_dict(), "data": self.stream.state(),
                     "rng": rng_state(ctx.generator), "start_eval": self.start_eval,
                     "critic": ctx.critic.state_dict() if ctx.critic is not None else None,
                     "guard": dict(vars(guard)) if guard is not None else None, "eval_pending": eval_pending,
                     "kl": ctx.kl.state(), "signal_share": ctx.signal_share,
                     "wall_seconds": self.wall_before + time.perf_counter() - self.t_start}
            save_checkpoint(path, ctx.policy, self.cfg, state, state_dict=full, staged=True)
            rotate_checkpoints(self.run_dir, t.keep_checkpoints, newest=step, final=t.steps)
        barrier(dist_info)
        return path

    def step(self, step: int) -> tuple[dict[str, float], dict | None]:
        """One RL (or offline DPO) step on the next prompts; under torchrun this rank generates for its shard."""
        ctx, rollout = self.ctx, self.cfg.rollout
        ctx.step = step
        if self.dpo is not None:
            metrics = self.dpo.step(self.stream.next(rollout.prompts_per_step), ctx.optimizer, ctx.scheduler,
                                    ctx.forward, ctx.dist)
            metrics.setdefault("reward/total/mean", metrics["dpo/accuracy"])
            metrics.setdefault("accuracy", metrics["dpo/accuracy"])
            return metrics, None
        curriculum = self.stream if isinstance(self.stream, Curriculum) else None
        if curriculum is not None and self.rollouts is None:  # (asynchronous: when the step's prompts are drawn)
            curriculum.set_step(step)
        markers = marker_sets(self.cfg.eval.reflection_words, self.cfg.eval.backtracking_words)
        beta = ctx.kl.beta
        if self.rollouts is not None:  # answers a producer sampled while earlier steps trained
            produced = self.rollouts.batch_for(step)
            metrics, gallery = learn(ctx, produced, markers, push_weights=False)
            metrics.update(self.rollouts.metrics(step, produced))
        else:
            # every rank draws the same prompts (one stream, one generator); each generates its shard of every round
            metrics, gallery = rl_step(ctx, self.draw(), draw=self.resample, markers=markers)
        metrics = reduce_metrics(metrics, ctx.dist)
        if ctx.kl.adaptive:  # the next step's beta, from this step's KL (the same on every rank: reduced first)
            metrics["kl_beta"] = beta
            ctx.kl.update(metrics.get("kl"))
        if curriculum is not None:
            metrics.update(curriculum.metrics())
        return metrics, gallery


    def draw(self, step: int | None = None) -> list[dict]:
        """The prompts of the next step to generate (`step`: which one, under asynchronous rollouts, where prompts
        are drawn ahead: a curriculum opens its share for that step)."""
        if step is not None and isinstance(self.stream, Curriculum):
            self.stream.set_step(step)
        return [self.train_set[i] for i in self.stream.next(first_round_size(self.ctx))]

    def resample(self, k: int) -> list[dict]:
        """Dynamic sampling's `k` more prompts from the same stream."""
        return [self.train_set[i] for i in self.stream.next(k)]

    def start_rollouts(self, resume: Path | None, start_step: int = 0) -> None:
        """Asynchronous rollouts (rollout.asynchronous): the producer, with the steps a checkpoint saved as produced;
        with rollout ranks, the producer is on them (vlmrl.trainer.rollout_ranks), told to load the weights of
        `resume` (else checkpoint-0), version `start_step`."""
        from vlmrl.trainer.asynchronous import AsyncRollouts

        r = self.cfg.rollout
        if self.ctx.dist.links is not None:
            from vlmrl.trainer.rollout_ranks import RemoteRollouts

            self.rollouts = RemoteRollouts(self.ctx, self.draw, r.max_staleness, r.producer_timeout)
        else:
            self.rollouts = AsyncRollouts(self.ctx, self.draw, r.max_staleness, r.producer_timeout,
                                          self.rollout_policy, self.resample)
        if resume is not None:
            self.rollouts.load(resume, self.ctx.dist.rank)
        if self.ctx.dist.links is not None:
            self.rollouts.start(resume or self.run_dir / "checkpoint-0", start_step)

    def close(self, failed: bool = False) -> None:
        """Stop the producer; `failed`: the run is ending with an error, so nothing it holds is waited for."""
        if self.rollouts is not None:
            self.rollouts.close(failed)


def check_distributed(cfg: Config, dist_info: DistInfo) -> None:
    """What torchrun with several processes needs of a recipe, checked before any data, model or SFT step is built:
    every feature runs there; batch sizes must split evenly over the ranks (with rollout ranks: over the training
    ranks and over the rollout ranks, checked on every rank so that all of them stop)."""
    links = dist_info.links
    if links is not None:
        for count, kind in ((links.trainers, "training"), (len(links.rollout), "rollout")):
            if cfg.rollout.prompts_per_step % count:
                raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be a multiple of the "
                                  f"number of {kind} ranks ({count}): each takes an equal share of every step")
    if not dist_info.active or dist_info.role == "rollout":
        return
    shard(cfg.rollout.prompts_per_step, dist_info)  # every rank takes the same number of prompts (or DPO pairs)
    r, a = cfg.rollout, cfg.algorithm
    if r.asynchronous and r.max_staleness > 0 and (a.dynamic_sampling or cfg.curriculum.active):
        raise ConfigError("rollout.asynchronous with max_staleness > 0 and dynamic sampling or a curriculum under "
                          "torchrun: both count groups over the ranks while they generate, which would meet the "
                          "update's collectives; set rollout.max_staleness=0, or turn them off")
    if cfg.replay.weight > 0 and cfg.replay.batch_size % dist_info.world:  # each rank trains its share of a batch
        raise ConfigError(f"replay.batch_size={cfg.replay.batch_size} must be a multiple of the number of processes "
                          f"({dist_info.world}) under torchrun: each trains its share of every replay batch")


def prepare_rl(cfg: Config, policy: Policy, run_dir: Path, data: Datasets, rewards: list[RewardSpec],
               generator: torch.Generator, dist_info, start_eval: dict, resume: Path | None,
               resume_state: dict | None, teacher) -> RLJob:
    """Reference, offline DPO pairs, the distributed wrapper, optimizer, scheduler, prompt stream and critic; from a
    checkpoint's state when resuming. `teacher`: on-policy distillation's (`vlmrl.trainer.distill.load_teacher`,
    loaded before any work so a wrong one is refused early), or None."""
    d, m, algo, t = cfg.data, cfg.model, cfg.algorithm, cfg.trainer
    offline_dpo = d.preferences is not None
    if t.disable_dropout:
        disable_dropout(policy.model)
    reference = None
    if algo.beta > 0 or algo.policy_loss == "dpo" or offline_dpo or t.kl_budget is not None:
        # the RL start: a frozen copy (checkpoint-0 when resuming), or under LoRA the policy with adapters disabled
        reference = Reference.of(policy, None if resume_state is None else run_dir / "checkpoint-0", dtype=m.dtype,
                                 device=dist_info.device, min_pixels=m.min_pixels, max_pixels=m.max_pixels,
                                 autocast=m.autocast)
    dpo, train_set = None, data.train
    if offline_dpo:
        pairs, pref_report = build_dataset(d.preferences, "train", d.seed + 2, d.on_error)
        if pref_report is None:  # a built-in task: pairs from its labels (chosen = right answer, rejected = wrong)
            pairs = synthetic_preferences(pairs, cfg.sft.target_template, d.seed)
        with reference.active() as reference_policy:
            dpo = OfflineDPO(policy, reference_policy, pairs, cfg)
        train_set = pairs
    # a separate critic copies the policy's whole weights, before FSDP2 shards them (vlmrl.trainer.critic)
    critic = Critic(policy, algo.critic, algo.critic_lr) if algo.advantage == "gae" else None
    # asynchronous rollouts sample with a copy of the weights (none at staleness 0, none for a vLLM engine), also made
    # before FSDP2 shards them
    r = cfg.rollout
    rollout_policy = policy.clone() if r.asynchronous and r.max_staleness > 0 and r.engine != "vllm" and \
        not r.rollout_ranks else None
    forward = wrap(policy, dist_info)  # before the optimizer: FSDP2 replaces parameters with shards
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = adamw(params, t.lr, t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.lr_schedule, t.warmup_steps, t.steps))
    if cfg.curriculum.active:
        order = cfg.curriculum.order
        stream = Curriculum(len(train_set), generator, cfg.curriculum, t.steps,
                            difficulties(train_set) if order == "easy_to_hard" else None)
    else:
        stream = PromptStream(len(train_set), generator)
    sharded = dist_info.mode == "fsdp2" and dist_info.active
    if resume_state is not None:  # (the RNG states are restored last, in `train`, right before the first step)
        if len(resume_state["data"]["order"]) != len(train_set):
            raise ConfigError(f"{resume}: its prompt order covers {len(resume_state['data']['order'])} prompts, "
                              f"this run has {len(train_set)}: data.train (or data.preferences) changed; resume "
                              "with the checkpoint's data, or start a new run from its weights")
        if resume_state["optimizer"] is not None and not sharded:  # FSDP2: each rank loads its shard below
            optimizer.load_state_dict(resume_state["optimizer"])
        scheduler.load_state_dict(resume_state["scheduler"])
        stream.load(resume_state["data"])
    if critic is not None and resume_state is not None:
        critic.load_state_dict(resume_state["critic"])
    ctx = StepContext(policy, optimizer, scheduler, rewards, cfg.rollout, algo, t, d.prompt_template,
                      d.max_prompt_length, reference, critic, generator, dist=dist_info,
                      forward=forward, agent=AgentSpec.from_config(cfg.agent, policy.processor),
                      solved=Solved.from_config(cfg))
    if cfg.curriculum.active:
        position = {id(sample): i for i, sample in enumerate(train_set)}
        ctx.observe = lambda sample, correct, signal: stream.observe(position[id(sample)], correct, signal)
    ctx.teacher = teacher
    if cfg.replay.weight > 0:
        ctx.replay = Replay(data.replay, cfg.replay.weight, cfg.replay.every, cfg.replay.batch_size,
                            cfg.sft.target_template, d.prompt_template, d.max_prompt_length, ctx.agent)
    if resume_state is not None:
        ctx.kl.load(resume_state.get("kl"))
        ctx.signal_share = resume_state.get("signal_share")
    if resume_state is not None and sharded and (Path(resume) / "sharded").exists():
        load_sharded_optimizer(forward, optimizer, Path(resume) / "sharded", dist_info.group)
    guard = getattr(ctx, "guard", None)
    if resume_state is not None and guard is not None and resume_state.get("guard"):
        vars(guard).update(resume_state["guard"])
    return RLJob(cfg, ctx, stream, train_set, run_dir, start_eval, dpo, rollout_policy=rollout_policy)


def start_vllm(cfg: Config, ctx: StepContext, run_dir: Path, dist_info):
    """A colocated vLLM engine started from checkpoint-0 (under LoRA a merged copy of it), then given the current
    weights (a resumed run's)."""
    from vlmrl.models.trainable import merge_checkpoint
    from vlmrl.rollout.vllm_engine import VLLMEngine, engine_options

    start = run_dir / "checkpoint-0"
    if ctx.policy.has_adapters:
        merged = run_dir / "vllm_start"
        if dist_info.is_main and not merged.exists():
            merge_checkpoint(start, merged, dtype=cfg.model.dtype)  # the precision training runs in
        barrier(dist_info)
        start = merged
    options = engine_options(cfg.rollout.vllm, cfg.model.dtype, cfg.model.autocast, dist_info.device)
    engine = VLLMEngine(start, options, seed=cfg.trainer.seed, device=dist_info.device)
    with gathered(ctx.forward):
        engine.push_weights(ctx.policy)
    return engine
