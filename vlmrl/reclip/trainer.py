"""The `vlmrl reclip train` job: data -> student -> InfoNCE warm-start -> eval -> RL (or continued InfoNCE) -> eval.

Writes RUN_DIR/config.yaml, metrics.jsonl (+ TensorBoard), feedback.jsonl (judged retrievals with their words and
rewards), student-start/ and student/ (standalone students; see students.py). Library code never prints: progress
goes through a `Progress` object (the CLI draws bars).

The job is three reusable pieces, so a benchmark can branch several methods from one warm-start:
`prepare` (data, student, cached inputs) -> `warm_start` -> `rl_phase(method)`. Batches are drawn from their own
generator (`Job.batches`), candidates from another (`Job.ctx.generator`), so two methods started from the same
state see the same batches.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmrl.config import ConfigError, save_config
from vlmrl.data import DataError
from vlmrl.deadlines import COLLECTIVE_MIN_S
from vlmrl.optim import adamw
from vlmrl.reclip import checkpoint
from vlmrl.reclip.config import ReclipConfig, validate
from vlmrl.reclip.data import ZeroShotSet, build_items, zero_shot_sets
from vlmrl.reclip.embedded import EmbeddedConfig, EmbeddedStudent
from vlmrl.reclip.evaluate import Encoder, evaluate_student, make_encoders
from vlmrl.reclip.judge import build_judge
from vlmrl.reclip.parallel import Parallel
from vlmrl.reclip.scenes import CaptionItem
from vlmrl.reclip.step import Bank, Scorer, StepContext, infonce_step, reclip_step
from vlmrl.reclip.store import InputStore
from vlmrl.reclip.students import TwoTower, hf_student_from_config, load_hf_student, load_student
from vlmrl.trainer.distributed import NullLogger, broadcast_object, gathered, init_distributed
from vlmrl.trainer.logger import MetricsLogger
from vlmrl.trainer.run import Progress, fresh_run_dir, seed_everything

MAX_LOG_SCALE = math.log(100.0)  # CLIP's clamp of the similarity scale


def build_student(cfg: ReclipConfig, texts: list[str]) -> TwoTower:
    """The student named by `student.name_or_path`: embedded, config (with a tokenizer trained on `texts`), a saved
    student folder, or a CLIP/SigLIP hub name or folder."""
    s = cfg.student
    if s.name_or_path == "embedded":
        ecfg = EmbeddedConfig(s.embed_dim, s.image_size, s.image_trainable_blocks, s.text_trainable_layers,
                              s.image_pool, s.flatten_channels, s.max_text_length, s.init_logit_scale)
        student = EmbeddedStudent.build(ecfg, seed=cfg.trainer.seed)
    elif s.name_or_path == "config":
        if not s.config:
            raise ConfigError("student.name_or_path=config needs student.config "
                              "({model_type: clip, text_config: {...}, vision_config: {...}})")
        student = hf_student_from_config(s.config, texts, cfg.trainer.seed, s.image_size, s.max_text_length)
    elif (Path(s.name_or_path) / "reclip_student.json").exists():
        student = load_student(s.name_or_path)
    else:
        student = load_hf_student(s.name_or_path, s.max_text_length)
    return student.to(s.device)


def load_data(cfg: ReclipConfig) -> tuple[list[CaptionItem], list[CaptionItem], list[ZeroShotSet], list[str]]:
    """Train items, held-out items, zero-shot sets (built-in scenes only) and the problems of skipped rows."""
    d = cfg.data
    train, train_report = build_items(d.train, "train", d.seed, d.on_error)
    held_out, eval_report = build_items(d.eval, "test", d.seed, d.on_error)
    problems = [p for r in (train_report, eval_report) if r is not None for p in r.problems]
    scenes = all(it.description is not None for it in train + held_out)
    if cfg.judge.name == "scene_graph" and not scenes:
        raise DataError("judge.name=scene_graph needs scene descriptions, which only the built-in reclip_scenes data "
                        "has; for your own captions set judge.name=exact (or llm)")
    zs = zero_shot_sets(150, d.seed) if cfg.eval.zero_shot and scenes else []
    return train, held_out, zs, problems


@dataclass
class Job:
    cfg: ReclipConfig
    train: list[CaptionItem]
    held_out: list[CaptionItem]
    zero_shot: list[ZeroShotSet]
    ctx: StepContext
    batches: torch.Generator
    run_dir: Path
    logger: MetricsLogger
    summary: dict = field(default_factory=dict)
    encoders: list[Encoder] | None = None

    @property
    def student(self) -> TwoTower:
        return self.ctx.student

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (rank 0 only under torchrun: the others return {}; under fsdp2 every rank gathers the
        sharded blocks first)."""
        with gathered(self.student):
            if self.ctx.par.rank != 0:
                return {}
            e = self.cfg.eval
            if self.encoders is None:
                self.encoders = make_encoders(self.student, self.held_out, self.zero_shot, e.batch_size)
            return evaluate_student(self.student, self.held_out, self.zero_shot, e.ks, e.templates, e.batch_size,
                                    self.encoders)

    def batch(self, size: int) -> list[int]:
        return torch.randperm(len(self.train), generator=self.batches)[:size].tolist()


def _optimizer(student: TwoTower, lr: float) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; under fsdp2 the sharded ones in a group of their own (a foreach step
    takes whole tensors or sharded ones, not both)."""
    trainable = [p for p in student.parameters() if p.requires_grad]
    sharded = [p for p in trainable if hasattr(p, "to_local")]
    whole = [p for p in trainable if not hasattr(p, "to_local")]
    return adamw([{"params": group} for group in (whole, sharded) if group], lr, weight_decay=0.0)


def prepare(cfg: ReclipConfig, progress: Progress) -> Job:
    """Data (bad input stops here, before a run directory exists), run directory, student, cached frozen inputs."""
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    par = join(cfg)
    seed_everything(cfg.trainer.seed)
    judge = build_judge(cfg.judge.name, cfg.judge.options)
    train, held_out, zs, problems = load_data(cfg)
    main = par.rank == 0
    run_dir = Path(broadcast_object(str(fresh_run_dir(cfg.trainer.output_dir)) if main else None, par.info))
    if main:
        save_config(cfg, run_dir / "config.yaml")
    logger = MetricsLogger(run_dir, cfg.trainer.tensorboard) if main else NullLogger()
    logger.log({"train_items": len(train), "eval_items": len(held_out), "skipped_rows": len(problems)}, 0, "data")
    for problem in problems[:20]:
        progress.message(f"skipped: {problem}")
    negatives = [n.caption for it in train for n in it.negatives]
    student = build_student(cfg, [it.caption for it in train + held_out] + negatives)
    par.broadcast_parameters(student)  # every rank starts from rank 0's weights, as DDP does
    par.shard(student)  # fsdp2: the trainable blocks sharded over the ranks
    store = InputStore(student, [it.image for it in train])
    progress.message("caching the frozen tower inputs of the training data")
    store.warm([it.caption for it in train] + (negatives if cfg.rl.text_negatives else []))
    ctx = StepContext(student, store, train, cfg.rl, Scorer(judge, cfg.judge), _optimizer(student, cfg.warmup.lr),
                      torch.Generator().manual_seed(cfg.trainer.seed + 1), par=par, precision=cfg.trainer.precision)
    job = Job(cfg, train, held_out, zs, ctx, torch.Generator().manual_seed(cfg.trainer.seed), run_dir, logger)
    job.summary.update(run_dir=str(run_dir), skipped_rows=len(problems))
    return job


def join(cfg: ReclipConfig) -> Parallel:
    """This process's place under torchrun (trainer.distributed=ddp; one process: rank 0 of 1). Every batch must
    split evenly, so each rank's share of a mean weighs the same."""
    info = init_distributed(cfg.trainer.distributed, cfg.student.device,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_MIN_S))
    for key, size in (("warmup.batch_size", cfg.warmup.batch_size), ("rl.batch_size", cfg.rl.batch_size)):
        if size % info.world:
            raise ConfigError(f"{key}={size} must be a multiple of the number of processes ({info.world}) under "
                              f"trainer.distributed={cfg.trainer.distributed}")
    return Parallel(info)


def _log(job: Job, metrics: dict, step: int, phase: str, total: int) -> None:
    every = job.cfg.trainer.log_every
    if every and (step % every == 0 or step == total):
        job.logger.log(metrics, step, phase)


def warm_start(job: Job, progress: Progress) -> dict[str, float]:
    """`warmup.steps` of symmetric InfoNCE; returns (and logs) the held-out metrics after it."""
    w = job.cfg.warmup
    job.ctx.optimizer = _optimizer(job.student, w.lr)
    progress.start("warm-start (InfoNCE)", w.steps)
    for step in range(1, w.steps + 1):
        metrics = infonce_step(job.ctx, job.batch(w.batch_size))
        _clamp_scale(job.student)
        _log(job, metrics, step, "warmup", w.steps)
        progress.advance(loss=f"{metrics['loss']:.3f}")
    progress.end()
    result = job.evaluate()
    job.logger.log(result, 0, "eval")
    return result


def refresh_bank(ctx: StepContext, size: int, batch_size: int = 256) -> None:
    """Re-embed a random subset of `size` training items (all when size >= their number) without gradients."""
    n, student, store = len(ctx.items), ctx.student, ctx.store
    chosen = torch.randperm(n, generator=ctx.generator)[:size].tolist() if size < n else list(range(n))

    def images(rows: list[int]) -> torch.Tensor:
        return torch.cat([student.embed_images(store.images(rows[i:i + batch_size]))
                          for i in range(0, len(rows), batch_size)])

    def texts(rows: list[int]) -> torch.Tensor:
        return torch.cat([student.embed_texts(store.texts([ctx.items[j].caption for j in rows[i:i + batch_size]]))
                          for i in range(0, len(rows), batch_size)])

    with torch.no_grad():  # under torchrun each rank embeds its share of the bank, then all hold all of it
        ctx.bank = Bank(chosen, ctx.par.embed(images, chosen, grad=False), ctx.par.embed(texts, chosen, grad=False))


def rl_phase(job: Job, progress: Progress, method: str | None = None, phase: str = "train",
             resume: dict | None = None) -> dict[str, float]:
    """`rl.steps` optimizer steps of `method` (default rl.method): "reclip" or "infonce" (continued InfoNCE, the
    baseline); returns (and logs) the held-out metrics after them. Judged retrievals go to feedback.jsonl. With
    `resume` (a checkpoint's state, vlmrl.reclip.checkpoint), the steps after the checkpoint's; with
    trainer.save_every, checkpoints on the way."""
    rl, ctx = job.cfg.rl, job.ctx
    method = method or rl.method
    ctx.optimizer = _optimizer(job.student, rl.lr)
    ctx.bank = None
    ctx.reference = None
    if method == "reclip" and rl.kl_weight > 0:
        ctx.reference = copy.deepcopy(job.student).requires_grad_(False)
    done = checkpoint.restore(ctx, job.batches, resume) if resume is not None else 0
    every = job.cfg.trainer.save_every
    progress.start(f"rl ({method})", rl.steps - done)
    with open(job.run_dir / "feedback.jsonl", "a") if ctx.par.rank == 0 else open(os.devnull, "w") as gallery:
        for step in range(done + 1, rl.steps + 1):
            idx = job.batch(rl.batch_size)
            if method == "infonce":
                metrics = infonce_step(ctx, idx)
            else:
                if rl.bank_size and (step - 1) % rl.bank_refresh == 0:
                    refresh_bank(ctx, rl.bank_size)
                metrics = reclip_step(ctx, idx)
                for entry in ctx.scorer.gallery:
                    gallery.write(json.dumps({"step": step, **entry}) + "\n")
                ctx.scorer.gallery = []
            _clamp_scale(job.student)
            _log(job, metrics, step, phase, rl.steps)
            progress.advance(loss=f"{metrics['loss']:.3f}")
            if job.cfg.trainer.eval_every and step % job.cfg.trainer.eval_every == 0 and step != rl.steps:
                job.logger.log(job.evaluate(), step, "eval")
            if every and step % every == 0 and step != rl.steps:  # every rank calls; rank 0 writes
                checkpoint.save(ctx, job.batches, step, job.run_dir, job.summary.get("start", {}))
    progress.end()
    result = job.evaluate()
    job.logger.log(result, rl.steps, "eval")
    return result


def train_reclip(cfg: ReclipConfig, progress: Progress | None = None) -> dict:
    """Run the whole job; returns a summary: run_dir, held-out metrics after the warm-start ("start") and at the end
    ("final"), the saved students, wall time."""
    progress = progress or Progress()
    t0 = time.perf_counter()
    validate(cfg)  # a config built or changed in code is checked as a recipe is
    resume = checkpoint.load(cfg.trainer.resume) if cfg.trainer.resume else None  # a bad path stops here
    job = prepare(cfg, progress)
    if resume is None:
        job.summary["start"] = warm_start(job, progress)
        if cfg.trainer.save_students:
            job.summary["student_start"] = _save_student(job, "student-start")
    else:  # the warm-start is in the checkpoint's weights; its held-out metrics come with them
        job.summary.update(start=resume["start"], resumed_from=str(cfg.trainer.resume))
    job.summary["final"] = rl_phase(job, progress, resume=resume)
    if cfg.trainer.save_students:
        job.summary["student"] = _save_student(job, "student")
    job.summary["wall_seconds"] = time.perf_counter() - t0
    job.summary["rank"] = job.ctx.par.rank
    sharded = sum(p.numel() for p in job.student.parameters() if hasattr(p, "to_local"))  # fsdp2's share
    job.logger.log({"wall_seconds": job.summary["wall_seconds"], "sharded_parameters": sharded}, cfg.rl.steps,
                   "summary")
    job.logger.close()
    job.ctx.par.finish()
    return job.summary


def _save_student(job: Job, name: str) -> str | None:
    """Rank 0 saves the student to RUN_DIR/`name` (every rank calls: fsdp2 gathers the sharded blocks first)."""
    weights = job.ctx.par.full_state_dict(job.student)
    if job.ctx.par.rank == 0:
        return str(job.student.save_pretrained(job.run_dir / name, weights))
    return None


def _clamp_scale(student: TwoTower) -> None:
    with torch.no_grad():
        student.logit_scale.clamp_(0.0, MAX_LOG_SCALE)
