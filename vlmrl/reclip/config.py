"""ReCLIP recipes: one typed config, loaded and validated by the same machinery as `vlmrl train` recipes.

`ReclipConfig()` is the default recipe (recipes/reclip_shapes.yaml spells it out). Every field's comment is its help
text. `load_reclip_config(path, overrides)` = defaults, then the YAML, then dotted `section.key=value` overrides; an
unknown key or a bad value raises ConfigError naming it, before any model or data is built.
"""

from __future__ import annotations

import math
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

from vlmrl.configlib import Count, Name, NonNegative, Positive, PositiveInt, Rule, load, section
from vlmrl.configlib import validate as _validate
from vlmrl.errors import ConfigError  # noqa: F401  (re-exported: vlmrl.reclip.config.ConfigError)
from vlmrl.reclip.feedback import DEFAULT_PENALTIES, DEFAULT_VERDICT_WEIGHTS, VERDICTS


@section
class StudentConfig:
    # "embedded" = EfficientNet-Lite0 + all-MiniLM-L6-v2 (offline); else a CLIPModel/SiglipModel hub name or folder;
    # "config" = a randomly initialised HF model built from student.config (tests, experiments)
    name_or_path: Name = "embedded"
    config: dict = field(default_factory=dict)  # for name_or_path=config: {model_type: clip|siglip, text_config, ...}
    embed_dim: PositiveInt = 256  # embedded student: joint embedding width
    image_size: PositiveInt = 112  # embedded student: input side (px); config students: vision image_size
    image_trainable_blocks: Count = 1  # embedded: last MBConv blocks (+ head conv) trained; 0 = frozen image tower
    text_trainable_layers: Count = 1  # embedded: last MiniLM layers trained; 0 = frozen text tower
    image_pool: Literal["flatten", "mean"] = "flatten"  # embedded: flatten keeps positions (spatial relations)
    flatten_channels: PositiveInt = 64
    max_text_length: PositiveInt = 32  # tokens per caption
    init_logit_scale: float = math.log(1 / 0.07)  # embedded: log of the initial similarity scale
    device: Name = "cpu"


@section
class ReclipDataConfig:
    # each split: {task: reclip_scenes, n: N, ...options} (built-in captioned scenes) or {path: FILE, ...}: JSONL /
    # parquet rows {image, caption} (or a `caption_field`, e.g. solution); see docs/reclip.md
    train: Any = field(default_factory=lambda: {"task": "reclip_scenes", "n": 2000})
    eval: Any = field(default_factory=lambda: {"task": "reclip_scenes", "n": 300})  # held-out (split "test")
    seed: Count = 0  # data generation seed, apart from trainer.seed: every training seed sees the same data
    on_error: Literal["raise", "skip"] = "raise"  # bad rows in user files: stop with the file and line, or skip+count


@section
class WarmupConfig:
    steps: Count = 300  # contrastive (symmetric InfoNCE) warm-start steps before RL; 0 = start RL from the student
    batch_size: PositiveInt = 64
    lr: Positive = 1.0e-3


@section
class RLConfig:
    # "reclip": REINFORCE on judged retrievals; "infonce": continued InfoNCE only (the baseline), same steps and batch
    method: Literal["reclip", "infonce"] = "reclip"
    steps: Count = 300  # optimizer steps after the warm-start
    batch_size: PositiveInt = 64  # queries per step; the batch is also the candidate pool (plus the memory bank)
    lr: Positive = 1.0e-3
    directions: list[Literal["t2i", "i2t"]] = field(default_factory=lambda: ["t2i", "i2t"])  # text->image and image->text retrieval
    candidates: PositiveInt = 32  # K candidates judged per query
    selection: Literal["sample", "topk"] = "topk"  # the K most probable, or K drawn from pi without replacement
    include_truth: bool = True  # the ground truth takes the last slot of a group that missed it
    temperature: NonNegative = 0.0  # tau of pi = softmax(sim / tau); 0 = the student's own 1 / exp(logit_scale)
    # "mean": A = r - mean over the K (plain REINFORCE); "policy": A = K pi_K (r - E_{pi_K} r), the exact gradient of
    # the expected reward over the K candidates (pi_K: pi renormalised on them); see losses.policy_weighted_advantages
    # "log": A = pi_K (r - E r) / (E r - min r), the gradient of log(E_{pi_K} r - min r): cross-entropy-like, a
    # confused query keeps its full gradient (losses.log_policy_advantages)
    advantage: Literal["mean", "policy", "log"] = "log"
    normalize_advantage: bool = False  # divide the advantages by the group's std
    text_negatives: bool = True  # add the batch items' hard-negative captions to the text pool (built-in scenes)
    bank_size: Count = 0  # training items in the memory bank (detached embeddings) added to the pool; 0 = batch only
    # the directions whose pool the bank joins: its images as t2i candidates, its captions as i2t candidates (the
    # latter include other items' paraphrases, "B to the right of A", which pull a nearly order-blind text tower
    # towards the relation swap; docs/reclip.md)
    bank_directions: list[Literal["t2i", "i2t"]] = field(default_factory=lambda: ["t2i", "i2t"])
    bank_refresh: PositiveInt = 25  # steps between re-embedding the bank (a fresh random subset when bank_size < n)
    anchor_weight: NonNegative = 1.0  # + weight * InfoNCE on the batch's texts (hard negatives included when drawn)
    # the words as a dense signal: per truth, up to this many counterfactual captions (its caption edited by the
    # reasons of its likeliest judged misses) join the anchor as its own negatives; 0 = reasons reach only the reward
    counterfactuals: Count = 4
    # per truth, up to this many of its counterfactual captions also drawn as new scenes (built-in scene captions; a
    # caption outside their grammar is counted, not drawn): extra image columns of its caption's text-to-image term
    counterfactual_images: Count = 0
    # the weight (times anchor_weight) of a term that teaches each drawn scene with its own caption as a pair against
    # the truth's, both ways: the scene must match its caption over the truth's, the caption its scene over the
    # truth's image (the student's confusion, drawn and named); 0 = the scenes are only negatives
    counterfactual_pairs: NonNegative = 0.0
    kl_weight: NonNegative = 0.0  # + weight * KL(pi_start || pi) on the batch: distillation to the warm-start student
    max_grad_norm: Positive = 1.0


@section
class JudgeConfig:
    name: Literal["scene_graph", "exact", "llm"] = "scene_graph"  # the GRM; see vlmrl/reclip/judge.py
    verdict_weights: dict = field(default_factory=lambda: dict(DEFAULT_VERDICT_WEIGHTS))  # global weight per verdict
    # attribute-level penalty per reason; 0 by default: a graded reward makes a near miss score above its group's
    # mean, and RL pulls it towards the query (measured in BENCHMARKS.md); the reasons teach as counterfactuals
    penalties: dict = field(default_factory=lambda: dict.fromkeys(DEFAULT_PENALTIES, 0.0))
    min_reward: float = -1.0
    compress: bool = True  # self-compression: keep only the reasons that bear on the verdict
    options: dict = field(default_factory=dict)  # judge.name=llm: endpoint, model, ... (passed to the client)


@section
class ReclipEvalConfig:
    batch_size: PositiveInt = 128
    ks: list[PositiveInt] = field(default_factory=lambda: [1, 5, 10])  # retrieval R@k
    zero_shot: bool = True  # zero-shot colour / shape / count classification on held-out one-group scenes
    # prompt templates averaged per class name ("{}" is the class phrase, e.g. "red shapes")
    templates: list[str] = field(default_factory=lambda: ["{}", "a picture of {}", "an image with {}"])


@section
class ReclipTrainerConfig:
    seed: Count = 0  # heads' initialisation, batch order and candidate sampling
    threads: Count = 0  # torch CPU threads (0 = torch's default)
    output_dir: Name = "runs/reclip"  # an existing non-empty folder gets a numbered sibling, never overwritten
    tensorboard: bool = True
    log_every: PositiveInt = 10  # steps between metric rows
    eval_every: Count = 0  # RL steps between held-out evaluations (0 = only before and after)
    save_students: bool = True  # write RUN_DIR/student-start and RUN_DIR/student (standalone, loadable folders)
    # under torchrun: "ddp" = each rank embeds, judges and backpropagates its share of every batch, the pool is the
    # global batch (embeddings gathered with their gradients) and gradients are summed (vlmrl/reclip/parallel.py);
    # "fsdp2" = the same, with the towers' trainable blocks sharded over the ranks (FSDP2's fully_shard)
    distributed: Literal["none", "ddp", "fsdp2"] = "none"
    save_every: Count = 0  # RL steps between checkpoints (RUN_DIR/checkpoint-STEP); 0 = none
    resume: str = ""  # a RUN_DIR/checkpoint-STEP folder: continue its RL phase exactly (the warm-start is skipped)
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: the towers under torch.autocast (GPUs; on a CPU it is slower)


@section
class ReclipConfig:
    student: StudentConfig = field(default_factory=StudentConfig)
    data: ReclipDataConfig = field(default_factory=ReclipDataConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    eval: ReclipEvalConfig = field(default_factory=ReclipEvalConfig)
    trainer: ReclipTrainerConfig = field(default_factory=ReclipTrainerConfig)


def _judge_weights(cfg: ReclipConfig) -> str | None:
    unknown = set(cfg.judge.verdict_weights) - set(VERDICTS)
    if unknown or set(VERDICTS) - set(cfg.judge.verdict_weights):
        return (f"judge.verdict_weights needs exactly the keys {list(VERDICTS)}, got "
                f"{sorted(cfg.judge.verdict_weights)}")
    for key, value in {**cfg.judge.verdict_weights, **cfg.judge.penalties}.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"judge: the weight of {key!r} must be a finite number, got {value!r}"
    return None


RULES: tuple[Rule, ...] = (
    Rule(("rl.directions",), "`rl.directions` holds at least one of `t2i`, `i2t`", lambda c: (
        "rl.directions: give at least one of t2i, i2t") if not c.rl.directions else None),
    Rule(("rl.candidates", "rl.batch_size"), "`rl.candidates` <= `rl.batch_size`", lambda c: (
        f"rl.candidates={c.rl.candidates} > rl.batch_size={c.rl.batch_size}: the batch is the candidate pool; "
        f"lower rl.candidates or raise rl.batch_size") if c.rl.candidates > c.rl.batch_size else None),
    Rule(("rl.counterfactual_images", "rl.counterfactuals"), "`rl.counterfactual_images` needs counterfactuals",
         lambda c: ("rl.counterfactual_images draws counterfactual captions as scenes; set rl.counterfactuals >= "
                    "rl.counterfactual_images or rl.counterfactual_images=0")
         if c.rl.counterfactual_images > c.rl.counterfactuals else None),
    Rule(("rl.counterfactual_pairs", "rl.counterfactual_images"), "`rl.counterfactual_pairs` needs drawn scenes",
         lambda c: ("rl.counterfactual_pairs teaches the drawn counterfactual scenes as pairs; set "
                    "rl.counterfactual_images >= 1 or rl.counterfactual_pairs=0")
         if c.rl.counterfactual_pairs and not c.rl.counterfactual_images else None),
    Rule(("rl.counterfactuals", "rl.anchor_weight"), "`rl.counterfactuals` needs `rl.anchor_weight` > 0", lambda c: (
        "rl.counterfactuals: the counterfactual captions join the anchor's InfoNCE; set rl.anchor_weight > 0 or "
        "rl.counterfactuals=0") if c.rl.counterfactuals and not c.rl.anchor_weight else None),
    Rule(("judge.verdict_weights", "judge.penalties"), "`judge.verdict_weights` has exactly the verdicts as keys; "
         "weights and penalties are finite numbers", _judge_weights),
    Rule(("trainer.distributed", "rl.kl_weight"), "`rl.kl_weight` > 0 under `ddp` or in one process, not `fsdp2`",
         lambda c: ("rl.kl_weight > 0 keeps a copy of the warm-start student as its reference, which is not built "
                    "for sharded towers: use trainer.distributed=ddp, or rl.kl_weight=0")
         if c.trainer.distributed == "fsdp2" and c.rl.kl_weight > 0 else None),
    Rule(("trainer.distributed", "rl.counterfactual_images"), "`rl.counterfactual_images` under `ddp` or in one "
         "process, not `fsdp2`", lambda c: (
             "rl.counterfactual_images under trainer.distributed=fsdp2: each rank draws the scenes of its own queries' confusions, as many as they "
             "give (none, some steps), and a sharded image tower needs every rank in each of its forwards: use "
             "trainer.distributed=ddp, or rl.counterfactual_images=0")
         if c.trainer.distributed == "fsdp2" and c.rl.counterfactual_images else None),
)


def load_reclip_config(path: str | Path | None = None, overrides: list[str] = ()) -> ReclipConfig:
    """Defaults, then the recipe YAML, then dotted overrides; every field against its declaration, then `RULES`."""
    return load(ReclipConfig, path, list(overrides), RULES)


def validate(cfg: ReclipConfig) -> ReclipConfig:
    """Check a config built or changed in code exactly as a recipe is checked (fields, then `RULES`)."""
    return _validate(cfg, RULES)
