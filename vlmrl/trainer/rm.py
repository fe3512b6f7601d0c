"""`vlmrl rm train`: fit an outcome reward model on preference pairs with the Bradley-Terry loss, or a process
reward model on step-labelled answers with a per-step cross-entropy (vlmrl.trainer.prm).

    pairs ──► r_c, r_r = RM(prompt, chosen), RM(prompt, rejected) ──► L = -log sigmoid(r_c - r_r) ──► AdamW
    steps ──► p_j = PRM(prompt, answer up to step j)              ──► L = mean_j BCE(p_j, label_j) ──► AdamW

Pairs come from a file in the offline DPO format (rows {image, prompt, chosen, rejected}), a built-in task (chosen =
its label written as `data.target_template`, rejected = a wrong answer, as offline DPO makes them), or a run's own
rollouts (`vlmrl.trainer.rm_pairs`: a right answer preferred to a wrong one to the same prompt). A share of the
prompts is held out; the held-out pairwise accuracy (r_c > r_r; a tie counts as wrong) and its 95% interval (over
prompts: `vlmrl.eval.metrics.accuracy_interval`) are logged and written into the RM's reward_model.json; for a PRM,
its held-out step accuracy and how well it finds wrong steps (precision, recall, F1).

The RM is written as RUN/checkpoint-N by the trainer's `save_checkpoint` (whole or not at all), a model folder plus
the head's files (`vlmrl.models.reward_model`), and is used as `{name: reward_model, path: RUN}` in a recipe.
"""

from __future__ import annotations

import time
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from annotated_types import Ge, Le

from vlmrl.algorithms.losses import bradley_terry_loss, preference_kl
from vlmrl.config import LoraConfig, TinyModelConfig
from vlmrl.configlib import Count, Fraction, Name, NonNegative, Positive, PositiveInt, Rule, load, section
from vlmrl.configlib import validate as _validate
from vlmrl.data import build_dataset, vocabulary_texts
from vlmrl.errors import DataError
from vlmrl.eval.metrics import accuracy_interval
from vlmrl.models import build_tiny_vlm, load_policy
from vlmrl.models.reward_model import RewardModel, answer_ids
from vlmrl.models.trainable import add_lora, merge_lora
from vlmrl.optim import adamw
from vlmrl.progress import Progress
from vlmrl.trainer.checkpoint import begin_checkpoint, save_checkpoint
from vlmrl.trainer.dpo import synthetic_preferences
from vlmrl.trainer.inputs import PromptStream
from vlmrl.trainer.logger import MetricsLogger
from vlmrl.trainer.prm import check_step_rows, evaluate_steps, process_loss, row_logits
from vlmrl.trainer.rm_pairs import pairs_from_rollouts, prompt_key, split_by_prompt
from vlmrl.trainer.rm_teacher import make_teacher, pair_scores, teacher_margins, teacher_step_logits
from vlmrl.trainer.run import claim_run_dir, seed_everything


@section
class RMModelConfig:
    # the VLM under the head: a policy checkpoint (RUN/checkpoint-0 for the policy the RM will score: same tokenizer),
    # a model folder or hub name; "tiny" builds the embedded model (its tokenizer from the built-in tasks' text)
    name_or_path: Name = "tiny"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Name = "cpu"
    autocast: bool = True  # bf16 autocast of forwards on CUDA (weights stay in `dtype`)
    # score = head(h) + a x log p(the scored tokens) under the VLM's own language model (an outcome RM: the answer's
    # tokens; a PRM: the step's), a learned from 1: what the model would not have written is suspect
    logprob_term: bool = False
    # train the head (and the log-prob term's weight) only, the VLM frozen: the model's own knowledge, reweighed,
    # not rewritten by a few thousand noisy labels; also a fraction of the memory and time per step
    freeze: bool = False
    # model.lora.r > 0: train LoRA adapters on the VLM (and the head) instead of every weight: the optimizer holds
    # the adapters' states only; they are merged into the weights when the RM is saved (a plain model folder)
    lora: LoraConfig = field(default_factory=LoraConfig)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@section
class RMDataConfig:
    # {path: FILE}: rows {image, prompt, chosen, rejected} (the offline DPO format); {task: NAME, n: N}: a built-in
    # task's labels (chosen = the label, rejected = a wrong answer); a list of either
    pairs: Any = None
    rollouts: str | None = None  # a run directory: pairs from its rollouts.jsonl (a right answer over a wrong one)
    # {path: FILE}: step-labelled answers for a process RM, rows {image, problem, solution, completion, labels}
    # (labels: one number in [0, 1] per reasoning step; `vlmrl rm label` writes them from a policy's own samples)
    steps: Any = None
    max_pairs_per_prompt: Count = 4  # rollouts: (right, wrong) pairs drawn per logged prompt; 0 = all
    heldout: Fraction = 0.2  # share of the prompts (with all their pairs) held out for pairwise accuracy
    prompt_template: str | None = None  # None: the rollouts' run's data.prompt_template, else "{problem}"
    target_template: Name = "<answer>{solution}</answer>"  # built-in task pairs: a label written as an answer
    max_prompt_length: PositiveInt = 512  # tokens, images included; the RM refuses longer prompts when scoring
    max_answer_tokens: PositiveInt = 256  # the longest answer it trains on and scores (longer: refused)
    seed: Count = 0  # pair drawing and the held-out split
    on_error: Literal["raise", "skip"] = "raise"  # bad rows in a pair file


@section
class RMProcessConfig:
    # a process RM (data.steps): how answers split into steps, and how an answer's step scores become its reward
    split: Literal["lines", "sentences", "paragraphs"] = "lines"
    think_tag: Name = "think"
    aggregate: Literal["min", "product", "last", "mean"] = "min"


@section
class RMDistillConfig:
    # reward-model distillation: a trained RM of the same kind (a run directory or checkpoint; any tokenizer: it
    # scores the same texts with its own) teaches this one. An outcome RM learns its preference on every training
    # pair, a process RM its probability of every step being right, through the KL between the two Bernoulli
    # distributions (algorithms.losses.preference_kl); null = labels only
    teacher: str | None = None
    # or an LLM judge teaches an outcome RM: JudgeClient's options ({base_url, model, graded, api_key_env, ...}); each
    # answer graded once, a pair's margin the difference of the two scores' log-odds (vlmrl.trainer.rm_teacher)
    judge: dict | None = None
    coef: Annotated[float, Ge(0), Le(1)] = 1.0  # L = (1 - coef) x the labels' loss + coef x KL(teacher || student)
    temperature: Positive = 1.0  # > 1 softens the teacher (its margin or step logit divided by it)


@section
class RMTrainerConfig:
    steps: PositiveInt = 200  # optimizer steps
    batch_size: PositiveInt = 16  # pairs per step (and per scoring chunk when evaluating)
    lr: Positive = 1.0e-4
    weight_decay: NonNegative = 0.0
    max_grad_norm: Positive = 1.0
    eval_every: Count = 50  # steps between held-out evaluations (and one at the end); 0 = at the end only
    seed: Count = 0
    threads: Count = 0  # torch CPU threads; 0 = torch's default
    tensorboard: bool = True
    output_dir: Name = "runs/rm"  # a new folder (an existing non-empty one gets -2, -3, ...)


@section
class RMConfig:
    model: RMModelConfig = field(default_factory=RMModelConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    process: RMProcessConfig = field(default_factory=RMProcessConfig)
    distill: RMDistillConfig = field(default_factory=RMDistillConfig)
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)


def _one_source(c: RMConfig) -> str | None:
    if sum(x is not None for x in (c.data.pairs, c.data.rollouts, c.data.steps)) != 1:
        return ("give exactly one source: preference pairs for an outcome RM, data.pairs ({path: FILE} or {task: "
                "NAME, n: N}) or data.rollouts (a run directory), or step-labelled answers for a process RM, "
                "data.steps ({path: FILE})")
    return None


def _distill_source(c: RMConfig) -> str | None:
    if c.distill.teacher is not None and c.distill.judge is not None:
        return "distill.teacher (an RM) and distill.judge (an LLM judge) are two teachers: give one"
    if c.distill.judge is not None and c.data.steps is not None:
        return ("distill.judge teaches an outcome RM on pairs; for a process RM, label its steps with the judge: "
                "vlmrl rm label --judge URL --judge-model NAME")
    return None


RULES = [Rule(("data.pairs", "data.rollouts", "data.steps"), "exactly one of them", _one_source),
         Rule(("distill.teacher", "distill.judge"), "one teacher; a judge for outcome RMs", _distill_source),
         Rule(("model.freeze", "model.lora.r"), "not both", lambda c: (
             "model.freeze=true trains the head alone and model.lora.r > 0 trains adapters on the VLM: choose one")
             if c.model.freeze and c.model.lora.r else None)]


def load_rm_config(path: str | Path | None = None, overrides: list[str] = ()) -> RMConfig:
    """Defaults, then the recipe YAML, then dotted overrides; every field against its declaration, then `RULES`."""
    return load(RMConfig, path, list(overrides), RULES)


def load_pairs(cfg: RMConfig) -> tuple[list[dict], str, list[str]]:
    """(pairs, the prompt template, notes on what was read)."""
    d = cfg.data
    template = d.prompt_template
    if d.rollouts is not None:
        pairs, report = pairs_from_rollouts(d.rollouts, d.max_pairs_per_prompt, d.seed)
        if template is None:
            run_config = Path(d.rollouts) / "config.yaml"
            if run_config.is_file():
                import yaml

                template = (yaml.safe_load(run_config.read_text()).get("data") or {}).get("prompt_template")
        notes = [f"{d.rollouts}: {report.entries} logged prompts, {report.with_pairs} with a right and a wrong answer "
                 f"({report.all_right} all right, {report.all_wrong} all wrong, {report.no_verdicts} without "
                 f"verdicts): {len(pairs)} pairs"]
    else:
        pairs, file_report = build_dataset(d.pairs, "train", d.seed, d.on_error)
        if file_report is None:  # a built-in task: pairs from its labels
            pairs = synthetic_preferences(pairs, d.target_template, d.seed)
        notes = [f"data.pairs: {len(pairs)} pairs" + (f" ({file_report.skipped} rows skipped)"
                                                      if file_report is not None and file_report.skipped else "")]
        for p in pairs:
            if not isinstance(p.get("chosen"), str) or not isinstance(p.get("rejected"), str):
                raise DataError(f"preference sample {p.get('id')!r}: needs string 'chosen' and 'rejected' answers")
    if not pairs:
        raise DataError("no preference pairs: " + notes[0])
    return pairs, template or "{problem}", notes


def load_steps(cfg: RMConfig) -> tuple[list[dict], str, list[str]]:
    """(step-labelled rows, the prompt template, notes): data.steps read and every row's labels checked against its
    steps as the PRM splits them (`vlmrl.trainer.prm.check_step_rows`)."""
    d, p = cfg.data, cfg.process
    if not (isinstance(d.steps, dict) and "path" in d.steps):
        raise DataError(f"data.steps must be {{path: FILE}} (a JSONL of step-labelled answers), got {d.steps!r}")
    rows, file_report = build_dataset(d.steps, "train", d.seed, d.on_error)
    rows, bad = check_step_rows(rows, p.split, p.think_tag, skip=d.on_error == "skip")
    skipped = bad + (file_report.skipped if file_report is not None else 0)
    notes = [f"data.steps: {len(rows)} step-labelled answers, {sum(len(r['labels']) for r in rows)} steps"
             + (f" ({skipped} rows skipped)" if skipped else "")]
    if not rows:
        raise DataError("no step-labelled answers: " + notes[0])
    return rows, d.prompt_template or "{problem}", notes


@torch.no_grad()
def evaluate_pairs(rm: RewardModel, pairs: list[dict], batch_size: int = 16,
                   teacher: torch.Tensor | None = None) -> dict[str, float]:
    """Pairwise accuracy (r_c > r_r) on `pairs`, its 95% interval over prompts (a prompt's pairs resampled
    together), the mean margin and loss; with `teacher` (its margins on the same pairs, NaN where it gave none), how
    often the two rank a pair the same way (`teacher_agreement`) and the teacher's own pairwise accuracy."""
    rm.train(False)
    right: dict[str, list[bool]] = {}
    margins, losses = [], []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        loss, margin = bradley_terry_loss(*pair_scores(rm, chunk))
        margins += margin.tolist()
        losses += loss.tolist()
        for p, m in zip(chunk, margin.tolist(), strict=True):
            right.setdefault(prompt_key(p), []).append(m > 0)
    low, high = accuracy_interval(list(right.values()))
    out = {"pairwise_accuracy": sum(m > 0 for m in margins) / len(margins), "ci_low": low, "ci_high": high,
           "margin": sum(margins) / len(margins), "loss": sum(losses) / len(losses), "pairs": float(len(pairs)),
           "prompts": float(len(right))}
    if teacher is not None:  # a judge teacher's unscored pairs (NaN) count in neither
        scored = [(m, t) for m, t in zip(margins, teacher.tolist(), strict=True) if t == t]
        out["teacher_unscored"] = float(len(margins) - len(scored))
        if scored:
            out["teacher_agreement"] = sum((m > 0) == (t > 0) for m, t in scored) / len(scored)
            out["teacher_pairwise_accuracy"] = sum(t > 0 for _, t in scored) / len(scored)
    return out


def build_model(cfg: RMConfig, run_dir: Path, template: str) -> RewardModel:
    m, d = cfg.model, cfg.data
    name = m.name_or_path
    if name == "tiny":
        name = build_tiny_vlm(run_dir / "base_model", vocabulary_texts(d.seed), m.tiny, seed=cfg.trainer.seed)
    policy = load_policy(name, m.dtype, m.device, autocast=m.autocast)
    process = vars(cfg.process) if d.steps is not None else None
    if m.freeze:
        for p in policy.model.parameters():
            p.requires_grad_(False)
    if m.lora.r:
        policy = add_lora(policy, m.lora, name)
    return RewardModel.on(policy, template, d.max_prompt_length, d.max_answer_tokens, process, m.logprob_term)


def check_answer_lengths(rm: RewardModel, pairs: list[dict]) -> None:
    """DataError naming the first pair (or step-labelled row) with an answer past max_answer_tokens (the RM would
    refuse it when scoring)."""
    limit = rm.info["max_answer_tokens"]
    for p in pairs:
        for side in ("chosen", "rejected", "completion"):
            if side not in p:
                continue
            length = int(answer_ids(rm.policy, [p[side]])[1].sum())
            if length > limit:
                what = "step-labelled row" if side == "completion" else "pair"
                raise DataError(f"{what} {p.get('id')!r}: its {side} answer is {length} tokens, past "
                                f"data.max_answer_tokens={limit}; raise it or drop the {what.split()[-1]}")


def train_reward_model(cfg: RMConfig, progress: Progress | None = None) -> dict:
    """Train an RM as `cfg` says; returns {run_dir, checkpoint, pairs, heldout, final, wall_seconds, notes}."""
    _validate(cfg, RULES)
    progress = progress or Progress()
    t0 = time.perf_counter()
    t = cfg.trainer
    if t.threads:
        torch.set_num_threads(t.threads)
    seed_everything(t.seed)
    process = cfg.data.steps is not None
    # bad data stops here, before a run directory or a model exists
    pairs, template, notes = load_steps(cfg) if process else load_pairs(cfg)
    train_pairs, held = split_by_prompt(pairs, cfg.data.heldout, cfg.data.seed)
    for note in notes:
        progress.message(note)
    teacher = make_teacher(cfg.distill.teacher, cfg.distill.judge, vars(cfg.process) if process else None)
    run_dir, _ = claim_run_dir(t.output_dir)
    rm = build_model(cfg, run_dir, template)
    check_answer_lengths(rm, pairs)
    logger = MetricsLogger(run_dir, t.tensorboard)
    logger.log({"pairs": len(pairs), "train_pairs": len(train_pairs), "heldout_pairs": len(held)}, 0, "data")
    held_teacher = None
    if teacher is not None and held:
        held_teacher = (teacher_step_logits if process else teacher_margins)(teacher, held, t.batch_size)
    optimizer = adamw(rm.parameters(), t.lr, t.weight_decay)
    stream = PromptStream(len(train_pairs), torch.Generator().manual_seed(t.seed))
    final: dict[str, float] = {}
    progress.start("rm train", t.steps)
    try:
        for step in range(1, t.steps + 1):
            rm.train(True)
            batch = [train_pairs[i] for i in stream.next(t.batch_size)]
            optimizer.zero_grad(set_to_none=True)
            if process:
                logits = row_logits(rm, batch)
                loss = process_loss(logits, [r["labels"] for r in batch])
                metrics = {}
                if teacher is not None:  # every step's Bernoulli: the teacher's probability, the student's
                    z, taught = torch.cat(logits), teacher_step_logits(teacher, batch, t.batch_size)
                    kl = preference_kl(z, taught, cfg.distill.temperature)
                    loss = (1 - cfg.distill.coef) * loss + cfg.distill.coef * kl.mean()
                    metrics.update(distill_kl=kl.mean().item(),
                                   teacher_agreement=((z > 0) == (taught > 0)).float().mean().item())
                metrics["loss"] = loss.item()
            else:
                chosen, rejected = pair_scores(rm, batch)
                losses, margin = bradley_terry_loss(chosen, rejected)
                metrics = {"margin": margin.mean().item(), "accuracy": (margin > 0).float().mean().item()}
                loss = losses.mean()
                if teacher is not None:  # the pairs the teacher gave a margin (a judge may not have)
                    taught = teacher_margins(teacher, batch, t.batch_size)
                    scored = ~torch.isnan(taught)
                    kl = preference_kl((chosen - rejected)[scored], taught[scored], cfg.distill.temperature)
                    loss = (1 - cfg.distill.coef) * loss + cfg.distill.coef * (kl.mean() if len(kl) else 0.0 * loss)
                    metrics.update(teacher_unscored=float((~scored).sum()))
                    if len(kl):
                        metrics.update(distill_kl=kl.mean().item(), teacher_agreement=(
                            (margin[scored] > 0) == (taught[scored] > 0)).float().mean().item())
                metrics["loss"] = loss.item()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(rm.parameters(), t.max_grad_norm)
            optimizer.step()
            logger.log({**metrics, "grad_norm": norm.item()}, step, "rm")
            progress.advance()
            if held and (step == t.steps or (t.eval_every and step % t.eval_every == 0)):
                final = evaluate_steps(rm, held, t.batch_size, held_teacher) if process else \
                    evaluate_pairs(rm, held, t.batch_size, held_teacher)
                logger.log(final, step, "rm_eval")
    finally:
        progress.end()
        logger.close()
    checkpoint = run_dir / f"checkpoint-{t.steps}"
    staging = begin_checkpoint(checkpoint)
    rm.policy = merge_lora(rm.policy)  # adapters (if any) into the weights: the RM folder stands alone
    kept = (("loss", "step_accuracy", "error_precision", "error_recall", "error_f1", "steps") if process else
            ("pairwise_accuracy", "ci_low", "ci_high", "pairs", "prompts"))
    rm.save_head(staging, {"trained": {"steps": t.steps, "train_rows" if process else "train_pairs": len(train_pairs),
                                       "heldout": {k: final[k] for k in kept} if final else None}})
    save_checkpoint(checkpoint, rm.policy, cfg, {"step": t.steps, "kind": "reward_model"}, staged=True)
    return {"run_dir": str(run_dir), "checkpoint": str(checkpoint), "pairs": len(pairs),
            "train_pairs": len(train_pairs), "heldout_pairs": len(held), "final": final, "notes": notes,
            "wall_seconds": time.perf_counter() - t0}
