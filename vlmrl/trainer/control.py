"""Honest baselines for an RL run: the SFT start, a matched-compute SFT control, and out-of-distribution splits.

`vlmrl train --control sft` runs the recipe (`train`), then:

1. **control**: continued SFT from the run's SFT start (`checkpoint-0`) on the same labelled set (`data.sft`), with
   `control.lr` and `control.batch_size`, for the same training wall time as the RL phase (the sum of the RL steps'
   `time/*`, evaluations excluded; `control.steps` > 0 fixes the step count instead, for reproducible runs). It is
   evaluated at the same points of its budget as RL (every `trainer.eval_every` RL-step equivalents), with the same
   `run_eval` as RL, so its curve can be drawn on RL's generation-step axis.
2. **OOD**: the start, the RL checkpoint and the control are evaluated on each out-of-distribution split
   (`eval.ood`; by default the `ood` split of the built-in eval tasks: counts or sizes outside the training range).

Everything lands in `RUN_DIR/baselines.json`, with the control's own logs in `RUN_DIR/control-sft/`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vlmrl.agent import AgentSpec
from vlmrl.config import Config
from vlmrl.data import build_dataset
from vlmrl.errors import ConfigError, PathError, TrainingError
from vlmrl.models import load_policy
from vlmrl.models.policy import Policy
from vlmrl.optim import adamw
from vlmrl.rewards.specs import reward_specs
from vlmrl.trainer.checkpoint import checkpoint_problem, save_checkpoint, step_checkpoints
from vlmrl.trainer.logger import MetricsLogger
from vlmrl.trainer.run import Progress, run_eval, seed_everything, train
from vlmrl.trainer.sft import sft_step

CONTROLS = ("sft",)


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl; is it a vlmrl run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rl_phase_seconds(run_dir: str | Path) -> float:
    """Training wall time of the RL phase: the sum over `train` rows of their stage timings `time/<stage>` (e.g.
    time/collect_score + time/update). Nested timings (`time/reward/<name>`) lie inside a stage and are not added
    again; held-out evaluations and checkpoints are not training compute and are left out."""
    rows = [r for r in read_metrics(run_dir) if r["phase"] == "train"]
    if not rows:
        raise PathError(f"{run_dir}/metrics.jsonl has no train rows: the RL phase did not run")
    return sum(v for r in rows for k, v in r.items()
               if k.startswith("time/") and k.count("/") == 1 and isinstance(v, (int, float)))


def ood_specs(cfg: Config) -> dict[str, tuple[Any, str]]:
    """The OOD splits to evaluate, name -> (data spec, split), from `eval.ood`:

    - "auto": {"ood": the `ood` split of data.eval's built-in tasks} ({} when data.eval reads files)
    - null: {}
    - one data spec ({task: ...}, {path: ...} or {hub: ...}): {"ood": (spec, "ood")}
    - a mapping of names to specs: one split each. A task spec may carry `split` (default "ood"), e.g.
      {task: shapes_count, n: 300, size: [112, 140], split: test} for in-range counts on larger canvases.
    """
    ood = cfg.eval.ood
    if ood is None:
        return {}
    if ood == "auto":
        specs = cfg.data.eval if isinstance(cfg.data.eval, list) else [cfg.data.eval]
        tasks = [s for s in specs if isinstance(s, Mapping) and "task" in s]
        return {"ood": (tasks if len(tasks) > 1 else tasks[0], "ood")} if tasks else {}
    if isinstance(ood, Mapping) and ("task" in ood or "path" in ood or "hub" in ood):
        ood = {"ood": ood}
    if not isinstance(ood, Mapping):
        raise ConfigError(f"eval.ood: expected 'auto', null, a data spec or a mapping of names to specs, got {ood!r}")
    out = {}
    for name, spec in ood.items():
        if not isinstance(spec, Mapping):
            raise ConfigError(f"eval.ood.{name}: expected a data spec ({{task: ...}} or {{path: ...}}), got {spec!r}")
        if "hub" in spec:  # (a hub spec's `split` names the dataset's own split: it stays in the spec)
            out[str(name)] = (dict(spec), "ood")
            continue
        split = spec.get("split", "ood")
        out[str(name)] = ({k: v for k, v in spec.items() if k != "split"}, split)
    return out


def load_ood_sets(cfg: Config) -> dict[str, list[dict]]:
    """Samples of every OOD split (loaded before any training starts, so a bad spec fails early)."""
    return {name: build_dataset(spec, split, cfg.data.seed, cfg.data.on_error)[0]
            for name, (spec, split) in ood_specs(cfg).items()}


def load_checkpoint_policy(cfg: Config, path: str | Path) -> Policy:
    m = cfg.model
    return load_policy(path, m.dtype, m.device, m.min_pixels, m.max_pixels)


def sft_control(cfg: Config, start: str | Path, seconds: float, out_dir: Path, eval_set: list[dict],
                ood_sets: dict[str, list[dict]], start_eval: dict, progress: Progress) -> dict:
    """Continued SFT from `start` for `seconds` of training time (or `control.steps` steps), evaluated like RL.

    Returns {"steps", "seconds", "in_distribution": metrics, "ood": {split: metrics}, "checkpoint"}."""
    seed_everything(cfg.trainer.seed)
    d, c, t = cfg.data, cfg.control, cfg.trainer
    policy = load_checkpoint_policy(cfg, start)
    agent = AgentSpec.from_config(cfg.agent, policy.processor)
    sft_set, _ = build_dataset(d.sft, "train", d.seed + 1, d.on_error)  # the labelled set the SFT start saw
    if not sft_set:
        raise ConfigError("control sft: data.sft is empty; the control needs the labelled set")
    rewards = reward_specs(cfg)
    optimizer = adamw([p for p in policy.model.parameters() if p.requires_grad], c.lr)
    generator = torch.Generator().manual_seed(t.seed)
    logger = MetricsLogger(out_dir, t.tensorboard)
    logger.log(start_eval, 0, "eval")  # the control starts where RL started: the same checkpoint-0 numbers
    # evaluate at RL's eval steps, mapped to fractions of the budget, so both curves share the generation-step axis
    points = [s for s in range(t.eval_every, t.steps, t.eval_every)] if t.eval_every else []
    budget = c.steps if c.steps > 0 else seconds
    progress.start("control sft", c.steps if c.steps > 0 else int(seconds))
    spent, step = 0.0, 0
    policy.model.train()
    while (step if c.steps > 0 else spent) < budget:
        t0 = time.perf_counter()
        idx = torch.randint(len(sft_set), (c.batch_size,), generator=generator).tolist()
        loss = sft_step(policy, optimizer, [sft_set[i] for i in idx], cfg.sft.target_template, d.prompt_template,
                        t.max_grad_norm, d.max_prompt_length, agent)
        dt = time.perf_counter() - t0
        spent, step = spent + dt, step + 1
        logger.log({"loss": loss, "time/update": dt}, step, "sft")
        progress.advance(1 if c.steps > 0 else int(spent) - int(spent - dt), loss=f"{loss:.3f}")  # whole seconds
        done = (step if c.steps > 0 else spent) / budget
        while points and done >= points[0] / t.steps:
            logger.log({**run_eval(policy, cfg, eval_set, rewards, Progress(), "control"), "sft_steps": step},
                       points.pop(0), "eval")
    progress.end()
    final = run_eval(policy, cfg, eval_set, rewards, progress, "control (end)")
    logger.log({**final, "sft_steps": step, "train_seconds": spent}, t.steps, "eval")
    ood = {name: run_eval(policy, cfg, samples, rewards, progress, f"control ({name})")
           for name, samples in ood_sets.items()}
    ckpt = save_checkpoint(out_dir / "checkpoint-final", policy, cfg, {"sft_steps": step, "seconds": spent})
    logger.close()
    return {"steps": step, "seconds": spent, "in_distribution": final, "ood": ood, "checkpoint": str(ckpt)}


def train_with_baselines(cfg: Config, control: str | None = None, progress: Progress | None = None) -> dict:
    """`train(cfg)`, then `run_baselines` on the finished run. Returns train's summary plus "baselines"."""
    if control is not None and control not in CONTROLS:
        raise ConfigError(f"--control {control!r}: known controls: {', '.join(CONTROLS)}")
    progress = progress or Progress()
    ood_sets = load_ood_sets(cfg)  # fail on a bad OOD spec before hours of training
    summary = train(cfg, progress)
    if summary.get("preempted"):  # stopped by a signal: the baselines need the finished run
        raise TrainingError(f"{summary['preempted']} stopped the run after step {summary['stopped_at']} "
                            f"(checkpoint {summary['checkpoint']}); finish it with `{summary['resume']}`, then add "
                            f"the baselines to the finished run")
    return {**summary, "baselines": run_baselines(cfg, summary, control, progress, ood_sets)}


def summary_of_run(run_dir: str | Path) -> dict:
    """What `train` returns, read back from a finished run's files: its first and last eval rows and its last
    checkpoint (to add baselines to a run trained earlier, or one whose baselines were interrupted)."""
    run_dir = Path(run_dir)
    evals = {r["step"]: r for r in read_metrics(run_dir) if r["phase"] == "eval"}
    ckpts = [c for c in step_checkpoints(run_dir).values() if checkpoint_problem(c) is None]  # complete ones
    if not evals or len(ckpts) < 2:
        raise PathError(f"{run_dir}: not a finished run (needs eval rows, checkpoint-0 and a final checkpoint)")
    strip = lambda row: {k: v for k, v in row.items() if k not in ("phase", "step")}  # noqa: E731
    return {"run_dir": str(run_dir), "start": strip(evals[min(evals)]), "final": strip(evals[max(evals)]),
            "checkpoint": str(ckpts[-1])}


def run_baselines(cfg: Config, summary: dict, control: str | None = None, progress: Progress | None = None,
                  ood_sets: dict[str, list[dict]] | None = None) -> dict:
    """The start and the RL checkpoint on the OOD splits, then the control (if any), for a finished run.

    Returns {"in_distribution": {arm: metrics}, "ood": {split: {arm: metrics}}, "rl_seconds", "control": {"steps",
    "seconds", "checkpoint"}}, also written to RUN_DIR/baselines.json. Arms: "start" (checkpoint-0, the SFT start),
    "rl" (the final checkpoint), "control_sft"."""
    progress = progress or Progress()
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)  # as in the RL phase, so the control's time buys the same CPU
    ood_sets = load_ood_sets(cfg) if ood_sets is None else ood_sets
    run_dir = Path(summary["run_dir"])
    control_dir = run_dir / "control-sft"
    if control == "sft" and control_dir.exists() and any(control_dir.iterdir()):
        raise FileExistsError(f"{control_dir} exists (an earlier control?); move it away to run the control again")
    rewards = reward_specs(cfg)
    eval_set, _ = build_dataset(cfg.data.eval, "test", cfg.data.seed, cfg.data.on_error)
    out: dict = {"in_distribution": {"start": summary["start"], "rl": summary["final"]},
                 "ood": {name: {} for name in ood_sets}, "rl_seconds": rl_phase_seconds(run_dir),
                 "ood_sizes": {name: len(s) for name, s in ood_sets.items()}}
    for arm, path in (("start", run_dir / "checkpoint-0"), ("rl", Path(summary["checkpoint"]))):
        if ood_sets:
            policy = load_checkpoint_policy(cfg, path)
            for name, samples in ood_sets.items():
                out["ood"][name][arm] = run_eval(policy, cfg, samples, rewards, progress, f"{arm} ({name})")
    if control == "sft":
        res = sft_control(cfg, run_dir / "checkpoint-0", out["rl_seconds"], control_dir, eval_set, ood_sets,
                          summary["start"], progress)
        out["in_distribution"]["control_sft"] = res["in_distribution"]
        for name, metrics in res["ood"].items():
            out["ood"][name]["control_sft"] = metrics
        out["control"] = {"kind": "sft", "steps": res["steps"], "seconds": res["seconds"],
                          "checkpoint": res["checkpoint"], "lr": cfg.control.lr, "batch_size": cfg.control.batch_size}
    (run_dir / "baselines.json").write_text(json.dumps(out, indent=1))
    return out
