"""ReCLIP recipes: one typed config, loaded and validated by the same machinery as `vlmrl train` recipes.

`ReclipConfig()` is the default recipe (recipes/reclip_shapes.yaml spells it out). Every field's comment is its help
text. `load_reclip_config(path, overrides)` = defaults, then the YAML, then dotted `section.key=value` overrides; an
unknown key or a bad value raises ConfigError naming it, before any model or data is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from vlmrl.config import ConfigError, load_config
from vlmrl.reclip.feedback import DEFAULT_PENALTIES, DEFAULT_VERDICT_WEIGHTS, VERDICTS


@dataclass
class StudentConfig:
    # "embedded" = EfficientNet-Lite0 + all-MiniLM-L6-v2 (offline); else a CLIPModel/SiglipModel hub name or folder;
    # "config" = a randomly initialised HF model built from student.config (tests, experiments)
    name_or_path: str = "embedded"
    config: dict = field(default_factory=dict)  # for name_or_path=config: {model_type: clip|siglip, text_config, ...}
    embed_dim: int = 256  # embedded student: joint embedding width
    image_size: int = 112  # embedded student: input side (px); config students: vision image_size
    image_trainable_blocks: int = 1  # embedded: last MBConv blocks (+ head conv) trained; 0 = frozen image tower
    text_trainable_layers: int = 1  # embedded: last MiniLM layers trained; 0 = frozen text tower
    image_pool: Literal["flatten", "mean"] = "flatten"  # embedded: flatten keeps positions (spatial relations)
    flatten_channels: int = 64
    max_text_length: int = 32  # tokens per caption
    init_logit_scale: float = math.log(1 / 0.07)  # embedded: log of the initial similarity scale
    device: str = "cpu"


@dataclass
class ReclipDataConfig:
    # each split: {task: reclip_scenes, n: N, ...options} (built-in captioned scenes) or {path: FILE, ...}: JSONL /
    # parquet rows {image, caption} (or a `caption_field`, e.g. solution); see docs/reclip.md
    train: Any = field(default_factory=lambda: {"task": "reclip_scenes", "n": 2000})
    eval: Any = field(default_factory=lambda: {"task": "reclip_scenes", "n": 300})  # held-out (split "test")
    seed: int = 0  # data generation seed, apart from trainer.seed: every training seed sees the same data
    on_error: Literal["raise", "skip"] = "raise"  # bad rows in user files: stop with the file and line, or skip+count


@dataclass
class WarmupConfig:
    steps: int = 300  # contrastive (symmetric InfoNCE) warm-start steps before RL; 0 = start RL from the student
    batch_size: int = 64
    lr: float = 1.0e-3


@dataclass
class RLConfig:
    # "reclip": REINFORCE on judged retrievals; "infonce": continued InfoNCE only (the baseline), same steps and batch
    method: Literal["reclip", "infonce"] = "reclip"
    steps: int = 300  # optimizer steps after the warm-start
    batch_size: int = 64  # queries per step; the batch is also the candidate pool (plus the memory bank)
    lr: float = 1.0e-3
    directions: list[str] = field(default_factory=lambda: ["t2i", "i2t"])  # text->image and image->text retrieval
    candidates: int = 32  # K candidates judged per query
    selection: Literal["sample", "topk"] = "topk"  # the K most probable, or K drawn from pi without replacement
    include_truth: bool = True  # the ground truth takes the last slot of a group that missed it
    temperature: float = 0.0  # tau of pi = softmax(sim / tau); 0 = the student's own 1 / exp(logit_scale)
    # "mean": A = r - mean over the K (plain REINFORCE); "policy": A = K pi_K (r - E_{pi_K} r), the exact gradient of
    # the expected reward over the K candidates (pi_K: pi renormalised on them); see losses.policy_weighted_advantages
    advantage: Literal["mean", "policy"] = "policy"
    normalize_advantage: bool = False  # divide the advantages by the group's std
    text_negatives: bool = True  # add the batch items' hard-negative captions to the text pool (built-in scenes)
    bank_size: int = 2000  # training items in the memory bank (detached embeddings) added to the pool; 0 = batch only
    bank_refresh: int = 25  # steps between re-embedding the bank (a fresh random subset when bank_size < n)
    anchor_weight: float = 1.0  # + weight * InfoNCE on the batch's texts (hard negatives included when drawn)
    kl_weight: float = 0.0  # + weight * KL(pi_start || pi) on the batch: distillation to the warm-start student
    max_grad_norm: float = 1.0


@dataclass
class JudgeConfig:
    name: Literal["scene_graph", "exact", "llm"] = "scene_graph"  # the GRM; see vlmrl/reclip/judge.py
    verdict_weights: dict = field(default_factory=lambda: dict(DEFAULT_VERDICT_WEIGHTS))  # global weight per verdict
    penalties: dict = field(default_factory=lambda: dict(DEFAULT_PENALTIES))  # attribute-level penalty per reason
    min_reward: float = -1.0
    compress: bool = True  # self-compression: keep only the reasons that bear on the verdict
    options: dict = field(default_factory=dict)  # judge.name=llm: endpoint, model, ... (passed to the client)


@dataclass
class ReclipEvalConfig:
    batch_size: int = 128
    ks: list[int] = field(default_factory=lambda: [1, 5, 10])  # retrieval R@k
    zero_shot: bool = True  # zero-shot colour / shape / count classification on held-out one-group scenes
    # prompt templates averaged per class name ("{}" is the class phrase, e.g. "red shapes")
    templates: list[str] = field(default_factory=lambda: ["{}", "a picture of {}", "an image with {}"])


@dataclass
class ReclipTrainerConfig:
    seed: int = 0  # heads' initialisation, batch order and candidate sampling
    threads: int = 0  # torch CPU threads (0 = torch's default)
    output_dir: str = "runs/reclip"  # an existing non-empty folder gets a numbered sibling, never overwritten
    tensorboard: bool = True
    log_every: int = 10  # steps between metric rows
    eval_every: int = 0  # RL steps between held-out evaluations (0 = only before and after)
    save_students: bool = True  # write RUN_DIR/student-start and RUN_DIR/student (standalone, loadable folders)


@dataclass
class ReclipConfig:
    student: StudentConfig = field(default_factory=StudentConfig)
    data: ReclipDataConfig = field(default_factory=ReclipDataConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    eval: ReclipEvalConfig = field(default_factory=ReclipEvalConfig)
    trainer: ReclipTrainerConfig = field(default_factory=ReclipTrainerConfig)


def load_reclip_config(path: str | Path | None = None, overrides: list[str] = ()) -> ReclipConfig:
    """Defaults, then the recipe YAML, then dotted overrides; checked as a whole (see `check`)."""
    cfg = load_config(path, list(overrides), cls=ReclipConfig)
    check(cfg)
    return cfg


def check(cfg: ReclipConfig) -> None:
    """Cross-field checks that types alone cannot express; errors name the key."""
    for d in cfg.rl.directions:
        if d not in ("t2i", "i2t"):
            raise ConfigError(f"rl.directions: {d!r} is not allowed; use t2i and/or i2t")
    if not cfg.rl.directions:
        raise ConfigError("rl.directions: give at least one of t2i, i2t")
    if not 1 <= cfg.rl.candidates <= cfg.rl.batch_size:
        raise ConfigError(f"rl.candidates must be 1..rl.batch_size ({cfg.rl.batch_size}), got {cfg.rl.candidates}")
    for name, value in (("warmup.steps", cfg.warmup.steps), ("rl.steps", cfg.rl.steps),
                        ("rl.bank_size", cfg.rl.bank_size)):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
    if cfg.rl.bank_refresh < 1:
        raise ConfigError(f"rl.bank_refresh must be >= 1, got {cfg.rl.bank_refresh}")
    unknown = set(cfg.judge.verdict_weights) - set(VERDICTS)
    if unknown or set(VERDICTS) - set(cfg.judge.verdict_weights):
        raise ConfigError(f"judge.verdict_weights needs exactly the keys {list(VERDICTS)}, got "
                          f"{sorted(cfg.judge.verdict_weights)}")
    for key, value in {**cfg.judge.verdict_weights, **cfg.judge.penalties}.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"judge: the weight of {key!r} must be a number, got {value!r}")
    if cfg.rl.temperature < 0:
        raise ConfigError(f"rl.temperature must be >= 0 (0 = the student's scale), got {cfg.rl.temperature}")
    if any(k < 1 for k in cfg.eval.ks):
        raise ConfigError(f"eval.ks must be positive, got {cfg.eval.ks}")
