"""The `vlmrl train` job: data -> model -> SFT warm-start -> evaluation -> RL steps -> evaluation -> checkpoints.

Progress reaches the caller through a `Progress` object (the CLI draws bars with it); library code never prints.
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch

from vlmrl.agent import AgentSpec
from vlmrl.agent.tools import TOOL_TOKENS
from vlmrl.algorithms.choices import check_algorithm
from vlmrl.config import Config, distilling_alone, save_config, to_dict, validate
from vlmrl.data import vocabulary_texts
from vlmrl.deadlines import collective_timeout
from vlmrl.errors import VlmrlError
from vlmrl.eval.generative import Solved, evaluate
from vlmrl.eval.regressions import fallen_tasks, fallen_warning, task_accuracies
from vlmrl.eval.samples import EVAL_SAMPLES, write_samples
from vlmrl.models import build_tiny_vlm, embedded_family, load_policy
from vlmrl.models.policy import Policy
from vlmrl.models.preflight import check_device, resolve_model
from vlmrl.models.trainable import configure_training, start_lora
from vlmrl.optim import adamw
from vlmrl.progress import Progress  # re-exported: `from vlmrl.trainer.run import Progress` keeps working
from vlmrl.rewards import RewardSpec
from vlmrl.rewards.coverage import check_coverage
from vlmrl.rewards.registry import check_specs
from vlmrl.rewards.reward_model import bind_reward_models
from vlmrl.rewards.specs import budget_warnings, reward_specs
from vlmrl.trainer.asynchronous import check_pending
from vlmrl.trainer.checkpoint import load_rank_rng, load_state, restore_rng
from vlmrl.trainer.curriculum import difficulties
from vlmrl.trainer.distill import load_teacher
from vlmrl.trainer.distributed import NullLogger, barrier, broadcast_object, gathered, init_distributed, rank_max
from vlmrl.trainer.inputs import Datasets, load_datasets
from vlmrl.trainer.job import RLJob, check_distributed, lr_lambda, prepare_rl, start_vllm
from vlmrl.trainer.limits import check_data_fits, user_texts, uses_tools
from vlmrl.trainer.logger import MetricsLogger, rewind_logs
from vlmrl.trainer.peers import peers_named
from vlmrl.trainer.preempt import SaveClock, StopRequest, agreed_stop, step_decisions
from vlmrl.trainer.resume import check_resume, find_resume_point, rewind_checkpoints
from vlmrl.trainer.reward_guards import GuardStop, KLBudget
from vlmrl.trainer.rollout_ranks import serve_rollouts, split_ranks
from vlmrl.trainer.sft import sft_step
from vlmrl.trainer.watch import (
    MismatchWatch,
    OverOptimisationWatch,
    RewardFailureWatch,
    SignalWatch,
    SparseSignalWatch,
    TruncationWatch,
    UngradedWatch,
    task_graders,
    truncation_warning,
)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def claim_run_dir(path: str | Path) -> tuple[Path, Path | None]:
    """(`path`, or `path-2`, `path-3`, ... if it exists and is not empty; the outermost folder this call created, or
    None when the folder existed, empty): earlier runs are never overwritten."""
    path = Path(path)
    candidate, k = path, 1
    while candidate.exists() and any(candidate.iterdir()):
        k += 1
        candidate = path.with_name(f"{path.name}-{k}")
    top = next((p for p in [*reversed(candidate.parents), candidate] if not p.exists()), None)
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate, top


def fresh_run_dir(path: str | Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... if it exists and is not empty: earlier runs are never overwritten."""
    return claim_run_dir(path)[0]


def discard_run_dir(run_dir: Path, created: Path | None) -> None:
    """Remove what a refused run wrote: the folders it created (`claim_run_dir`), else (an empty folder the user
    made) the run directory's contents."""
    if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        return
    for child in run_dir.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def build_policy(cfg: Config, run_dir: Path, dist_info=None, data: Datasets | None = None) -> Policy:
    """The policy to train; "tiny" builds the embedded model, its tokenizer trained on the built-in tasks' text and
    the user data's own text (so a user dataset's words are tokens, not bytes)."""
    m = cfg.model
    name = m.name_or_path
    if name == "tiny":  # built once, by rank 0; the other ranks load the saved folder
        name = run_dir / "base_model"
        if dist_info is None or dist_info.is_main:
            texts = vocabulary_texts(cfg.data.seed)
            texts += user_texts(cfg, data.train, data.sft, data.eval) if data is not None else []
            tools = data is not None and uses_tools(cfg, data.train, data.sft, data.eval)
            family = embedded_family(m.tiny, *((data.train, data.sft, data.eval) if data is not None else ()))
            if m.tiny.family == "auto" and family != "qwen2_vl":
                print(f"the embedded model: {family} (model.tiny.family auto: the data holds box answers, and the "
                      "embedded Qwen2-VL does not learn where things are; docs/concepts.md)", flush=True)
            build_tiny_vlm(name, texts, m.tiny, seed=cfg.trainer.seed, extra_tokens=TOOL_TOKENS if tools else (),
                           family=family)
        if dist_info is not None:
            barrier(dist_info)
    device = m.device if dist_info is None else dist_info.device  # cuda:LOCAL_RANK under torchrun
    return configure_training(load_policy(name, m.dtype, device, m.min_pixels, m.max_pixels, m.autocast), m)


def run_eval(policy: Policy, cfg: Config, samples: list[dict], rewards, progress: Progress, label: str,
             samples_out: Path | None = None, step: int | None = None) -> dict:
    """Greedy and sampled evaluation of `samples`, metrics prefixed greedy/ and sampled/. `samples_out`: also write
    every sample's answers there (vlmrl.eval.samples), with `step` on each line."""
    out, evaluations = {}, []
    for mode, temperature in (("greedy", 0.0), ("sampled", cfg.eval.sampled_temperature)):
        progress.start(f"eval {label} ({mode})", len(samples))
        res = evaluate(policy, samples, agent=AgentSpec.from_config(cfg.agent, policy.processor),
                       temperature=temperature, max_new_tokens=cfg.eval.max_new_tokens,
                       batch_size=cfg.eval.batch_size, template=cfg.data.prompt_template,
                       max_prompt_length=cfg.data.max_prompt_length, rewards=rewards, seed=cfg.trainer.seed,
                       progress=progress.advance, n=cfg.eval.samples, ks=cfg.eval.pass_k,
                       reflection_words=cfg.eval.reflection_words, backtracking_words=cfg.eval.backtracking_words,
                       solved=Solved.from_config(cfg))
        progress.end()
        key, budget = ("agent.turn_tokens", cfg.agent.turn_tokens) if cfg.agent.enabled else \
            ("eval.max_new_tokens", cfg.eval.max_new_tokens)
        warning = truncation_warning(res["metrics"].get("truncated_share", 0.0), key, budget,
                                     f"eval {label} ({mode})")
        if warning:
            progress.message(f"warning: {warning}")
        out.update({f"{mode}/{k}": v for k, v in res["metrics"].items()})
        evaluations.append((temperature, res))
    if samples_out is not None:
        write_samples(samples_out, evaluations, samples, step=step)
    return out


def run_dir_message(run_dir: Path, output_dir: str | Path, resumed_at: int | None = None) -> str:
    """The line a run starts with: where it writes, and why when that is not `trainer.output_dir` itself."""
    if resumed_at is not None:
        return f"run directory: {run_dir} (resumed from checkpoint-{resumed_at})"
    if Path(run_dir) != Path(output_dir):
        return (f"run directory: {run_dir} ({output_dir} exists and is not empty, and runs are never overwritten; "
                f"set trainer.output_dir to choose another)")
    return f"run directory: {run_dir}"


def warm_start(cfg: Config, run_dir: Path, data: Datasets, rewards: list[RewardSpec], generator: torch.Generator,
               logger, progress: Progress, dist_info, policy: Policy | None = None) -> tuple[Policy, dict]:
    """Build the policy (unless given, its data checked), run the SFT warm-start, evaluate the start; returns the
    policy (with LoRA adapters when configured) and the start's evaluation."""
    if policy is None:
        policy = build_policy(cfg, run_dir, dist_info, data)
        check_data_fits(policy, cfg, data)  # every label and prompt fits its budget, before any training step
    agent = AgentSpec.from_config(cfg.agent, policy.processor)  # multi-turn: demonstrations replay their tool calls
    if cfg.sft.steps > 0:
        sft_opt = adamw([p for p in policy.model.parameters() if p.requires_grad], cfg.sft.lr)
        sft_sched = torch.optim.lr_scheduler.LambdaLR(sft_opt, lr_lambda(cfg.sft.lr_schedule, 0, cfg.sft.steps))
        progress.start("sft", cfg.sft.steps)
        policy.model.train()
        for step in range(1, cfg.sft.steps + 1):
            t0 = time.perf_counter()
            idx = torch.randint(len(data.sft), (cfg.sft.batch_size,), generator=generator).tolist()
            loss = sft_step(policy, sft_opt, [data.sft[i] for i in idx], cfg.sft.target_template,
                            cfg.data.prompt_template, cfg.trainer.max_grad_norm, cfg.data.max_prompt_length, agent)
            sft_sched.step()
            logger.log({"loss": loss, "lr": sft_sched.get_last_lr()[0], "time/update": time.perf_counter() - t0},
                       step, "sft")
            progress.advance(loss=f"{loss:.3f}")
        progress.end()
    start_eval = run_eval(policy, cfg, data.eval, rewards, progress, "after SFT")
    logger.log(start_eval, 0, "eval")
    # LoRA: adapters for RL on the SFT result (saved first, so adapter checkpoints name the weights they adapt)
    policy = start_lora(policy, cfg.model, run_dir / "lora_base" if cfg.sft.steps > 0 else None,
                        save=dist_info.is_main)
    return policy, start_eval


def train(cfg: Config, progress: Progress | None = None, resume: str | Path | None = None) -> dict:
    """Run the whole job; returns a summary with held-out accuracy after SFT and after RL and the run directory.

    Phases: data (bad input is reported before a run directory exists) -> run directory and logger -> warm start
    (SFT and the start's evaluation), or the checkpoint being resumed -> RL state -> the RL loop (evaluations and
    checkpoints on schedule) -> the final evaluation and checkpoint.

    `resume`: a run directory (its newest complete checkpoint) or RUN_DIR/checkpoint-N; the run directory is
    rewound to that step (vlmrl.trainer.resume). SIGTERM/SIGINT during the RL phase stop it after the current step
    with a checkpoint; the summary then has `preempted` (the signal), `stopped_at` and `resume` (the command).
    Under torchrun a rank whose collective fails because another rank stopped names that rank (vlmrl.trainer.peers).
    """
    with peers_named():
        return run_job(cfg, progress, resume)


def run_job(cfg: Config, progress: Progress | None, resume: str | Path | None) -> dict:
    progress = progress or Progress()
    t_start = time.perf_counter()
    validate(cfg)  # a config built or changed in code is checked as a recipe is
    check_device(cfg.model.device)
    if cfg.model.name_or_path != "tiny" and not resume:
        resolve_model(cfg.model.name_or_path, "model.name_or_path")  # a missing folder or unreachable hub name
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    seed_everything(cfg.trainer.seed)
    if cfg.rollout.rollout_ranks:  # the last ranks generate, the others train (vlmrl.trainer.rollout_ranks)
        dist_info = split_ranks(cfg.trainer.distributed, cfg.model.device, cfg.rollout.rollout_ranks,
                                timeout=collective_timeout(cfg.rollout))
    else:
        dist_info = init_distributed(cfg.trainer.distributed, cfg.model.device, timeout=collective_timeout(cfg.rollout))
    check_distributed(cfg, dist_info)
    rewards = reward_specs(cfg)  # the length penalty's limits follow the generation budget unless set
    check_specs(rewards)  # an unknown reward or option fails here, before data or model are built
    if dist_info.role == "rollout":  # generates what training rank 0 asks for, until it says stop
        return serve_rollouts(cfg, dist_info, rewards)
    if not dist_info.is_main:
        progress = Progress()  # one progress bar and one log: rank 0's
    check_algorithm(cfg.algorithm)  # so does a user's estimator or loss that breaks its contract
    Solved.from_config(cfg)  # solved.reward names a component or a registered reward
    warnings = budget_warnings(cfg)
    for warning in warnings:
        progress.message(f"warning: {warning}")
    point = find_resume_point(resume) if resume else None
    resume_state = load_state(point.checkpoint) if point else None
    notes = [*point.notes, *check_resume(cfg, point, resume_state, dist_info.mode == "fsdp2" and dist_info.active)] \
        if point else []
    if point and cfg.rollout.asynchronous:  # its pending steps continue exactly on these processes, or it is refused
        check_pending(point.checkpoint, dist_info.world)

    data = load_datasets(cfg)
    check_specs(rewards, {k for split in (data.train, data.eval) for s in split[:1] for k in s})  # kwargs vs columns
    if cfg.data.preferences is None and not distilling_alone(cfg):  # every answer type of the RL prompts has a
        check_coverage(rewards, data.train)  # weighted reward that grades it (distilling alone: the teacher does)
    if cfg.curriculum.order == "easy_to_hard":
        difficulties(data.train)  # a missing difficulty is refused now, not after the SFT warm-start
    run_dir, created = (point.run_dir, None) if point else (None, None)
    if run_dir is None and dist_info.is_main:
        run_dir, created = claim_run_dir(cfg.trainer.output_dir)
    run_dir = broadcast_object(run_dir, dist_info)
    progress.message(run_dir_message(run_dir, cfg.trainer.output_dir, point.step if point else None))
    # a refusal before the first training step (the data does not fit the model's budgets, say) removes what this
    # run wrote, so the corrected rerun writes to the same place instead of a numbered sibling
    fresh = point is None and dist_info.is_main
    logger = NullLogger()
    try:
        # a stop's pending evaluation, or the final one (a finished run resumed at its last step) is run again
        rerun_eval = point is not None and (bool(resume_state.get("eval_pending")) or point.step == cfg.trainer.steps)
        if dist_info.is_main:
            if point:
                notes += rewind_checkpoints(point) + rewind_logs(run_dir, point.step, rerun_eval)
            save_config(cfg, run_dir / "config.yaml")
            logger = MetricsLogger(run_dir, cfg.trainer.tensorboard, cfg.trainer.wandb_project, to_dict(cfg))
        barrier(dist_info)  # the run directory is rewound before any rank reads it
        for note in notes:
            progress.message(note)
        for r in data.reports:
            if r.skipped:
                progress.message(f"{r.path}: skipped {r.skipped} bad rows (data.on_error=skip); first: "
                                 f"{r.problems[0]}")
        if point is None:  # (a resumed run keeps the first process's row)
            logger.log({"train_prompts": len(data.train), "eval_samples": len(data.eval),
                        "sft_samples": len(data.sft), "skipped_rows": data.skipped}, 0, "data")
        policy = None
        if resume_state is None:
            policy = build_policy(cfg, run_dir, dist_info, data)
            check_data_fits(policy, cfg, data)  # every label and prompt fits its budget, before any training step
            bind_reward_models(rewards, policy)  # a learned reward: on this device, its tokenizer the policy's
            teacher = load_teacher(cfg, policy, dist_info.device)  # on-policy distillation: the same vocabulary
    except VlmrlError:
        if fresh:
            logger.close()
            discard_run_dir(run_dir, created)
        raise
    summary: dict = {"run_dir": str(run_dir), "skipped_rows": data.skipped, "notes": notes,
                     "skipped_problems": [p for r in data.reports for p in r.problems]}

    generator = torch.Generator().manual_seed(cfg.trainer.seed)
    if resume_state is None:
        policy, summary["start"] = warm_start(cfg, run_dir, data, rewards, generator, logger, progress, dist_info,
                                              policy)
    else:
        m = cfg.model
        policy = configure_training(load_policy(point.checkpoint, m.dtype, dist_info.device, m.min_pixels,
                                                m.max_pixels, m.autocast), m)
        check_data_fits(policy, cfg, data)
        bind_reward_models(rewards, policy)
        teacher = load_teacher(cfg, policy, dist_info.device)
        summary["start"] = resume_state.get("start_eval", {})
    job = prepare_rl(cfg, policy, run_dir, data, rewards, generator, dist_info, summary["start"],
                     point.checkpoint if point else None, resume_state, teacher)
    job.t_start, job.wall_before = t_start, resume_state.get("wall_seconds", 0.0) if resume_state else 0.0
    if resume_state is None:
        job.checkpoint(0)  # the SFT start: the baseline every RL number is compared with
    if cfg.rollout.engine == "vllm" and not cfg.rollout.rollout_ranks:  # (else the rollout ranks run it)
        job.ctx.engine = start_vllm(cfg, job.ctx, run_dir, dist_info)
    if resume_state is not None:  # last, so that nothing built since (critic, engine) draws from the restored streams
        restore_rng(load_rank_rng(point.checkpoint, dist_info.rank, resume_state), generator)
        if rerun_eval and point.step < cfg.trainer.steps:
            with gathered(job.ctx.forward):
                logger.log(run_eval(policy, cfg, data.eval, rewards, Progress(), f"step {point.step}"), point.step,
                           "eval")
    if cfg.rollout.asynchronous and job.dpo is None:
        job.start_rollouts(point.checkpoint if point else None, point.step if point else 0)
    failed = True  # (an error on the way out: the producer is left as it is, not waited for)
    try:  # (asynchronous rollouts: the producer stops after the final checkpoint saved what it made)
        with StopRequest(progress.message) as stop:  # also through the final evaluation and checkpoint
            stopped_at = rl_loop(job, data, rewards, logger, progress, point.step + 1 if point else 1, stop)
            if job.guard_stop is not None:  # a guard ended the run: that step's checkpoint and evaluation are its end
                summary.update(final=job.guard_stop.held_out, guard_stop=job.guard_stop.reason, stopped_at=stopped_at,
                               checkpoint=str(run_dir / f"checkpoint-{stopped_at}"))
                stopped_at = None
            elif stopped_at is not None:
                summary.update(preempted=signal.Signals(stop.signum).name, stopped_at=stopped_at,
                               checkpoint=str(run_dir / f"checkpoint-{stopped_at}"),
                               resume=f"vlmrl train --resume {run_dir}")
            elif cfg.trainer.steps == 0 and point is None:  # no RL: the start is the end (checkpoint-0, evaluated)
                summary.update(final=summary["start"], checkpoint=str(run_dir / "checkpoint-0"))
            else:
                with gathered(job.ctx.forward):
                    summary["final"] = run_eval(policy, cfg, data.eval, rewards, progress, "after RL",  # + answers
                                                run_dir / EVAL_SAMPLES if dist_info.is_main else None,
                                                cfg.trainer.steps)
                logger.log(summary["final"], cfg.trainer.steps, "eval")
                summary["checkpoint"] = str(job.checkpoint(cfg.trainer.steps))
        failed = False
    finally:
        job.close(failed)
    summary["notes"] += warnings + job.notes
    summary["wall_seconds"] = job.wall_before + time.perf_counter() - t_start
    if stopped_at is None:
        row = {"wall_seconds": summary["wall_seconds"]}
        if task_accuracies(summary["final"]):  # several tasks: which fell during RL (the CLI ends with the warning)
            summary["fallen_tasks"] = row["fallen_tasks"] = fallen_tasks(summary["start"], summary["final"])
            summary["fallen_warning"] = fallen_warning(summary["start"], summary["final"])
        logger.log(row, summary.get("stopped_at", cfg.trainer.steps), "summary")
    logger.close()
    return summary


def rl_loop(job: RLJob, data: Datasets, rewards, logger, progress: Progress, first_step: int,
            stop: StopRequest) -> int | None:
    """RL steps `first_step`..trainer.steps with their evaluations, rollout gallery and checkpoints. Returns None
    when done, or the step after which a signal or a guard (`job.guard_stop`, vlmrl.trainer.reward_guards) stopped
    the run (its checkpoint written; a guard's held-out evaluation of that step too)."""
    cfg, t, ctx = job.cfg, job.cfg.trainer, job.ctx
    clock, watches = SaveClock(t), (TruncationWatch(cfg), RewardFailureWatch(cfg), MismatchWatch(cfg))
    if not distilling_alone(cfg):  # (distilling alone, the teacher grades every answer and no reward differs)
        watches += (SignalWatch(cfg), SparseSignalWatch(cfg, task_graders(rewards, data.train)), UngradedWatch())
    overoptimised, kl_budget = OverOptimisationWatch(cfg), KLBudget(cfg)
    if job.start_eval:  # the start is the first evaluation the watch compares with (a fall from it counts)
        overoptimised.update(0, job.start_eval)

    def say(warning: str | None) -> None:  # a watch's warning: said once, kept in the run's notes
        if warning:
            progress.message(f"warning: {warning}")
            job.notes.append(warning)

    progress.start("rl", t.steps - first_step + 1)
    try:
        for step in range(first_step, t.steps + 1):
            metrics, gallery = job.step(step)
            for w in watches:
                say(w.update(step, metrics))
            guard = kl_budget.update(step, metrics)
            logger.log(metrics, step, "train")
            if gallery and t.log_rollouts_every and (step % t.log_rollouts_every == 0 or step == 1):
                logger.log_rollouts([{"step": step, **entry} for entry in gallery])
            progress.advance(reward=f"{metrics['reward/total/mean']:.2f}", acc=f"{metrics['accuracy']:.2f}")
            # every branch below turns on values all ranks agree on, so they run the same collectives
            eval_due = bool(t.eval_every) and step % t.eval_every == 0 and step != t.steps
            stopping, saving = step_decisions(stop, clock, step, ctx.dist)
            # (a collective only when a budget is set: every rank has the same config)
            guarded = kl_budget.budget is not None and bool(rank_max([int(guard is not None)], ctx.dist)[0])
            guarded = guarded and not stopping
            evaluated = (eval_due or guarded) and not stopping  # a stop leaves the evaluation to the resumed run
            if evaluated:
                with gathered(ctx.forward):
                    held_out = run_eval(ctx.policy, cfg, data.eval, rewards, Progress(), f"step {step}")
                logger.log(held_out, step, "eval")
                warning = overoptimised.update(step, held_out)  # a learned reward rising while accuracy falls
                say(warning)
                if warning and t.stop_on_overoptimisation and not guarded:
                    guard, guarded = warning, True
                stopping = agreed_stop(stop, ctx.dist)  # a signal during the evaluation
            if guarded and not stopping:  # a guard ends the run here: this step's checkpoint and evaluation
                job.guard_stop = GuardStop(step, guard or "another rank's guard tripped", held_out)
                progress.message(f"stopped by a guard: {job.guard_stop.reason}")
                job.notes.append(f"stopped by a guard: {job.guard_stop.reason}")
            if saving or stopping or guarded:
                job.checkpoint(step, eval_pending=eval_due and not evaluated)
                clock.saved()
                if not stopping and not guarded:
                    stopping = agreed_stop(stop, ctx.dist)  # a signal during the save
            if stopping or guarded:
                return step
    finally:
        progress.end()
    return None
