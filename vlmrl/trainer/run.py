"""The `vlmrl train` job: data -> model -> SFT warm-start -> evaluation -> RL steps -> evaluation -> checkpoints.

Progress reaches the caller through a `Progress` object (the CLI draws bars with it); library code never prints.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vlmrl.config import Config, save_config, to_dict
from vlmrl.data import build_dataset, vocabulary_texts
from vlmrl.eval.generative import evaluate
from vlmrl.models import build_tiny_vlm, load_policy
from vlmrl.models.policy import Policy
from vlmrl.models.reference import Reference
from vlmrl.models.trainable import configure_training, disable_dropout, start_lora
from vlmrl.rewards import RewardSpec, resolve_reward
from vlmrl.trainer.checkpoint import load_state, restore_rng, rng_state, save_checkpoint
from vlmrl.trainer.critic import Critic
from vlmrl.trainer.distributed import (
    NullLogger,
    barrier,
    broadcast_object,
    full_state_dict,
    gathered,
    init_distributed,
    load_sharded_optimizer,
    reduce_metrics,
    save_sharded_optimizer,
    shard,
    wrap,
)
from vlmrl.trainer.dpo import OfflineDPO, synthetic_preferences
from vlmrl.trainer.logger import MetricsLogger
from vlmrl.trainer.rl import StepContext, rl_step
from vlmrl.trainer.sft import sft_step


class Progress:
    """No-op progress hooks; the CLI subclasses this with progress bars."""

    def start(self, phase: str, total: int) -> None: ...
    def advance(self, n: int = 1, **postfix) -> None: ...
    def end(self) -> None: ...
    def message(self, text: str) -> None: ...


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fresh_run_dir(path: str | Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... if it exists and is not empty: earlier runs are never overwritten."""
    path = Path(path)
    candidate, k = path, 1
    while candidate.exists() and any(candidate.iterdir()):
        k += 1
        candidate = path.with_name(f"{path.name}-{k}")
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate


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


def build_policy(cfg: Config, run_dir: Path, dist_info=None) -> Policy:
    m = cfg.model
    name = m.name_or_path
    if name == "tiny":  # built once, by rank 0; the other ranks load the saved folder
        name = run_dir / "base_model"
        if dist_info is None or dist_info.is_main:
            build_tiny_vlm(name, vocabulary_texts(cfg.data.seed), m.tiny, seed=cfg.trainer.seed)
        if dist_info is not None:
            barrier(dist_info)
    device = m.device if dist_info is None else dist_info.device  # cuda:LOCAL_RANK under torchrun
    return configure_training(load_policy(name, m.dtype, device, m.min_pixels, m.max_pixels, m.autocast), m)


class PromptStream:
    """Shuffled passes over the RL prompts, driven by one generator so data order is part of the resumable state."""

    def __init__(self, n: int, generator: torch.Generator):
        self.n, self.generator = n, generator
        self.order, self.pos, self.epoch = torch.randperm(n, generator=generator).tolist(), 0, 0

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.order, self.pos, self.epoch = torch.randperm(self.n, generator=self.generator).tolist(), 0, \
                    self.epoch + 1
            take = min(k - len(out), self.n - self.pos)
            out += self.order[self.pos:self.pos + take]
            self.pos += take
        return out

    def state(self) -> dict:
        return {"order": self.order, "pos": self.pos, "epoch": self.epoch}

    def load(self, state: dict) -> None:
        self.order, self.pos, self.epoch = state["order"], state["pos"], state["epoch"]


def run_eval(policy: Policy, cfg: Config, samples: list[dict], rewards, progress: Progress, label: str) -> dict:
    out = {}
    for mode, temperature in (("greedy", 0.0), ("sampled", cfg.eval.sampled_temperature)):
        progress.start(f"eval {label} ({mode})", len(samples))
        res = evaluate(policy, samples, temperature=temperature, max_new_tokens=cfg.eval.max_new_tokens,
                       batch_size=cfg.eval.batch_size, template=cfg.data.prompt_template,
                       max_prompt_length=cfg.data.max_prompt_length, rewards=rewards, seed=cfg.trainer.seed,
                       progress=progress.advance, n=cfg.eval.samples, ks=cfg.eval.pass_k,
                       reflection_words=cfg.eval.reflection_words)
        progress.end()
        out.update({f"{mode}/{k}": v for k, v in res["metrics"].items()})
    return out


@dataclass
class Datasets:
    """The job's samples: RL prompts, held-out evaluation, SFT labels, and what loading skipped (data.on_error)."""

    train: list[dict]
    eval: list[dict]
    sft: list[dict]
    reports: list

    @property
    def skipped(self) -> int:
        return sum(r.skipped for r in self.reports)


def load_datasets(cfg: Config) -> Datasets:
    d = cfg.data
    train_set, report = build_dataset(d.train, "train", d.seed, d.on_error)
    eval_set, eval_report = build_dataset(d.eval, "test", d.seed, d.on_error)
    reports = [r for r in (report, eval_report) if r is not None]
    sft_set = []
    if cfg.sft.steps > 0:
        sft_set, sft_report = build_dataset(d.sft, "train", d.seed + 1, d.on_error)
        reports += [sft_report] if sft_report is not None else []
    return Datasets(train_set, eval_set, sft_set, reports)


def warm_start(cfg: Config, run_dir: Path, data: Datasets, rewards: list[RewardSpec], generator: torch.Generator,
               logger, progress: Progress, dist_info) -> tuple[Policy, dict]:
    """Build the policy, run the SFT warm-start, evaluate the start; returns the policy (with LoRA adapters when
    configured) and the start's evaluation."""
    policy = build_policy(cfg, run_dir, dist_info)
    if cfg.sft.steps > 0:
        sft_opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=cfg.sft.lr)
        sft_sched = torch.optim.lr_scheduler.LambdaLR(sft_opt, lr_lambda(cfg.sft.lr_schedule, 0, cfg.sft.steps))
        progress.start("sft", cfg.sft.steps)
        policy.model.train()
        for step in range(1, cfg.sft.steps + 1):
            idx = torch.randint(len(data.sft), (cfg.sft.batch_size,), generator=generator).tolist()
            loss = sft_step(policy, sft_opt, [data.sft[i] for i in idx], cfg.sft.target_template,
                            cfg.data.prompt_template, cfg.trainer.max_grad_norm, cfg.data.max_prompt_length)
            sft_sched.step()
            logger.log({"loss": loss, "lr": sft_sched.get_last_lr()[0]}, step, "sft")
            progress.advance(loss=f"{loss:.3f}")
        progress.end()
    start_eval = run_eval(policy, cfg, data.eval, rewards, progress, "after SFT")
    logger.log(start_eval, 0, "eval")
    # LoRA: adapters for RL on the SFT result (saved first, so adapter checkpoints name the weights they adapt)
    policy = start_lora(policy, cfg.model, run_dir / "lora_base" if cfg.sft.steps > 0 else None,
                        save=dist_info.is_main)
    return policy, start_eval


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
    shard: tuple[int, int] = (0, 0)

    def checkpoint(self, step: int) -> Path:
        """RUN_DIR/checkpoint-STEP: the weights (loadable with from_pretrained) and the resumable state. Under FSDP2
        every rank joins the gather and writes its optimizer shard."""
        ctx, dist_info = self.ctx, self.ctx.dist
        path = self.run_dir / f"checkpoint-{step}"
        sharded = dist_info.mode == "fsdp2" and dist_info.active
        full = full_state_dict(ctx.forward, dist_info)
        if sharded and ctx.optimizer.state:  # (an empty state needs no file; torch would "initialise" it with a step)
            save_sharded_optimizer(ctx.forward, ctx.optimizer, path / "sharded")
        if dist_info.is_main:
            state = {"step": step, "optimizer": None if sharded else ctx.optimizer.state_dict(),
                     "scheduler": ctx.scheduler.state_dict(), "data": self.stream.state(),
                     "rng": rng_state(ctx.generator), "start_eval": self.start_eval,
                     "critic": ctx.critic.state_dict() if ctx.critic is not None else None}
            save_checkpoint(path, ctx.policy, self.cfg, state, state_dict=full)
        barrier(dist_info)
        return path

    def step(self, step: int) -> tuple[dict[str, float], dict | None]:
        """One RL (or offline DPO) step on the next prompts; this rank's shard of them under torchrun."""
        ctx, rollout = self.ctx, self.cfg.rollout
        ctx.step = step
        if self.dpo is not None:
            metrics = self.dpo.step(self.stream.next(rollout.prompts_per_step), ctx.optimizer, ctx.scheduler)
            metrics.setdefault("reward/total/mean", metrics["dpo/accuracy"])
            metrics.setdefault("accuracy", metrics["dpo/accuracy"])
            return metrics, None
        start, stop = self.shard
        samples = [self.train_set[i] for i in self.stream.next(rollout.prompts_per_step)[start:stop]]
        metrics, gallery = rl_step(ctx, samples, draw=lambda k: [self.train_set[i] for i in self.stream.next(k)])
        return reduce_metrics(metrics, ctx.dist), gallery


def prepare_rl(cfg: Config, policy: Policy, run_dir: Path, data: Datasets, rewards: list[RewardSpec],
               generator: torch.Generator, dist_info, start_eval: dict, resume: Path | None,
               resume_state: dict | None) -> RLJob:
    """Reference, offline DPO pairs, the distributed wrapper, optimizer, scheduler, prompt stream and critic; from a
    checkpoint's state when resuming."""
    d, m, algo, t = cfg.data, cfg.model, cfg.algorithm, cfg.trainer
    offline_dpo = d.preferences is not None
    if t.disable_dropout:
        disable_dropout(policy.model)
    reference = None
    if algo.beta > 0 or algo.policy_loss == "dpo" or offline_dpo:
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
    if dist_info.active and (algo.advantage == "gae" or offline_dpo or algo.dynamic_sampling):
        raise ValueError("trainer.distributed supports the GRPO family, RLOO, REINFORCE++, ReMax and online DPO so "
                         "far; run critics, offline DPO and dynamic sampling in one process")
    forward = wrap(policy, dist_info)  # before the optimizer: FSDP2 replaces parameters with shards
    params = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.lr_schedule, t.warmup_steps, t.steps))
    stream = PromptStream(len(train_set), generator)
    if resume_state is not None:
        if resume_state["optimizer"] is not None:  # None under FSDP2: each rank loads its shard below
            optimizer.load_state_dict(resume_state["optimizer"])
        scheduler.load_state_dict(resume_state["scheduler"])
        stream.load(resume_state["data"])
        restore_rng(resume_state["rng"], generator)
    critic = None
    if algo.advantage == "gae":
        critic = Critic(policy, algo.critic, algo.critic_lr)
        if resume_state is not None:
            critic.load_state_dict(resume_state["critic"])
    shard_start, shard_stop = shard(cfg.rollout.prompts_per_step, dist_info)
    ctx = StepContext(policy, optimizer, scheduler, rewards, cfg.rollout, algo, t, d.prompt_template,
                      d.max_prompt_length, reference, critic, generator, prompt_offset=shard_start, dist=dist_info,
                      forward=forward)
    if resume_state is not None and dist_info.mode == "fsdp2" and dist_info.active:
        if (Path(resume) / "sharded").exists():
            load_sharded_optimizer(forward, optimizer, Path(resume) / "sharded")
    return RLJob(cfg, ctx, stream, train_set, run_dir, start_eval, dpo, (shard_start, shard_stop))


def start_vllm(cfg: Config, ctx: StepContext, run_dir: Path, dist_info):
    """A colocated vLLM engine started from checkpoint-0 (under LoRA a merged copy of it), then given the current
    weights (a resumed run's)."""
    from vlmrl.models.trainable import merge_checkpoint
    from vlmrl.rollout.vllm_engine import VLLMEngine

    start = run_dir / "checkpoint-0"
    if ctx.policy.has_adapters:
        merged = run_dir / "vllm_start"
        if dist_info.is_main and not merged.exists():
            merge_checkpoint(start, merged, dtype=cfg.model.dtype)  # the precision training runs in
        barrier(dist_info)
        start = merged
    engine = VLLMEngine(start, cfg.rollout.vllm, seed=cfg.trainer.seed, device=dist_info.device)
    with gathered(ctx.forward):
        engine.push_weights(ctx.policy)
    return engine


def train(cfg: Config, progress: Progress | None = None, resume: str | Path | None = None) -> dict:
    """Run the whole job; returns a summary with held-out accuracy after SFT and after RL and the run directory.

    Phases: data (bad input is reported before a run directory exists) -> run directory and logger -> warm start
    (SFT and the start's evaluation), or the checkpoint being resumed -> RL state -> the RL loop (evaluations and
    checkpoints on schedule) -> the final evaluation and checkpoint.
    """
    progress = progress or Progress()
    t_start = time.perf_counter()
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    seed_everything(cfg.trainer.seed)
    dist_info = init_distributed(cfg.trainer.distributed, cfg.model.device)
    if not dist_info.is_main:
        progress = Progress()  # one progress bar and one log: rank 0's
    rewards = [RewardSpec.from_config(r) for r in cfg.rewards]
    for spec in rewards:
        resolve_reward(spec.name)  # an unknown reward fails here, before data or model are built
    resume_state = load_state(resume) if resume else None

    data = load_datasets(cfg)
    run_dir = Path(resume).parent if resume else None
    if run_dir is None and dist_info.is_main:
        run_dir = fresh_run_dir(cfg.trainer.output_dir)
    run_dir = broadcast_object(run_dir, dist_info)
    if dist_info.is_main:
        save_config(cfg, run_dir / "config.yaml")
        logger = MetricsLogger(run_dir, cfg.trainer.tensorboard, cfg.trainer.wandb_project, to_dict(cfg))
    else:
        logger = NullLogger()
    for r in data.reports:
        if r.skipped:
            progress.message(f"{r.path}: skipped {r.skipped} bad rows (data.on_error=skip); first: {r.problems[0]}")
    logger.log({"train_prompts": len(data.train), "eval_samples": len(data.eval), "sft_samples": len(data.sft),
                "skipped_rows": data.skipped}, 0, "data")
    summary: dict = {"run_dir": str(run_dir), "skipped_rows": data.skipped,
                     "skipped_problems": [p for r in data.reports for p in r.problems]}

    generator = torch.Generator().manual_seed(cfg.trainer.seed)
    if resume_state is None:
        policy, summary["start"] = warm_start(cfg, run_dir, data, rewards, generator, logger, progress, dist_info)
    else:
        m = cfg.model
        policy = configure_training(load_policy(resume, m.dtype, dist_info.device, m.min_pixels, m.max_pixels,
                                                m.autocast), m)
        summary["start"] = resume_state.get("start_eval", {})
    job = prepare_rl(cfg, policy, run_dir, data, rewards, generator, dist_info, summary["start"], resume,
                     resume_state)

    t, forward = cfg.trainer, job.ctx.forward
    first_step = 1 if resume_state is None else resume_state["step"] + 1
    if resume_state is None:
        job.checkpoint(0)  # the SFT start: the baseline every RL number is compared with
    if cfg.rollout.engine == "vllm":
        job.ctx.engine = start_vllm(cfg, job.ctx, run_dir, dist_info)
    progress.start("rl", t.steps - first_step + 1)
    for step in range(first_step, t.steps + 1):
        metrics, gallery = job.step(step)
        logger.log(metrics, step, "train")
        if gallery and t.log_rollouts_every and (step % t.log_rollouts_every == 0 or step == 1):
            logger.log_rollouts([{"step": step, **gallery}])
        progress.advance(reward=f"{metrics['reward/total/mean']:.2f}", acc=f"{metrics['accuracy']:.2f}")
        if t.eval_every and step % t.eval_every == 0 and step != t.steps:
            with gathered(forward):
                logger.log(run_eval(policy, cfg, data.eval, rewards, Progress(), f"step {step}"), step, "eval")
        if t.save_every and step % t.save_every == 0 and step != t.steps:
            job.checkpoint(step)
    progress.end()
    with gathered(forward):
        summary["final"] = run_eval(policy, cfg, data.eval, rewards, progress, "after RL")
    logger.log(summary["final"], t.steps, "eval")
    summary["checkpoint"] = str(job.checkpoint(t.steps))
    summary["wall_seconds"] = time.perf_counter() - t_start
    logger.log({"wall_seconds": summary["wall_seconds"]}, t.steps, "summary")
    logger.close()
    return summary
