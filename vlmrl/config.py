"""Recipes: one typed config, YAML files, dotted command-line overrides, validated before anything is built.

Defaults are the quickstart: `Config()` is what `vlmrl train` runs with no arguments. Every field's help text is its
comment; `vlmrl train --help` points here and to docs/recipes.md.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from vlmrl.errors import ConfigError  # noqa: F401  (re-exported: vlmrl.config.ConfigError)


@dataclass
class TinyModelConfig:
    hidden_size: int = 96  # text width of the embedded Qwen2-VL
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vision_depth: int = 2
    vision_dim: int = 96
    vision_heads: int = 4
    vocab_size: int = 512  # BPE vocabulary trained on the built-in tasks' text
    initializer_range: float = 0.1  # 0.02 leaves the tiny model blind to the image (docs/concepts.md)
    # the saved image processor's pixel budget (model.min_pixels/max_pixels override it at load): 56-84 px scenes
    # are upscaled to 112 px = 16 image tokens; at their native size (4-9 tokens) the quickstart gained ~11 points
    min_pixels: int = 112 * 112
    max_pixels: int = 168 * 168


@dataclass
class LoraConfig:
    r: int = 0  # LoRA rank; 0 = full fine-tuning. LoRA needs `pip install 'vlmrl[lora]'`; see docs/models.md
    alpha: float | None = None  # adapter scale is alpha / r; null = 2 * r
    dropout: float = 0.0
    target_modules: list[str] | None = None  # names of linear layers to adapt (e.g. [q_proj, v_proj]); null = all
    include_vision: bool = False  # also adapt the vision tower (default: the language model only)


@dataclass
class ModelConfig:
    name_or_path: str = "tiny"  # "tiny" builds the embedded model; else a hub name or a folder (a checkpoint too)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    min_pixels: int | None = None  # pixel budget per image, the same for generation and training
    max_pixels: int | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # RL through adapters; the reference = adapters disabled
    freeze_vision: bool = False  # full fine-tuning: keep the vision tower's weights fixed
    freeze_projector: bool = False  # full fine-tuning: keep the vision-to-text projector fixed
    gradient_checkpointing: bool = False  # recompute decoder activations in backward: less memory, ~30% slower
    autocast: bool = True  # bf16 autocast of forwards on CUDA (weights stay in `dtype`); CPU always runs `dtype`


@dataclass
class DataConfig:
    # each split: {task: NAME, n: N, ...task options} for a built-in task, {path: FILE} for user data, or a list
    train: Any = field(default_factory=lambda: {"task": "shapes_count", "n": 4000})
    sft: Any = field(default_factory=lambda: {"task": "shapes_count", "n": 300})  # labelled warm-start subset
    eval: Any = field(default_factory=lambda: {"task": "shapes_count", "n": 300})  # held-out (split "test")
    preferences: Any = None  # offline DPO instead of RL: rows {image, prompt, chosen, rejected}, or a built-in task
    seed: int = 0  # data generation seed; kept apart from trainer.seed so every training seed sees the same data
    on_error: Literal["raise", "skip"] = "raise"  # bad rows in user files: stop with the file and line, or skip+count
    prompt_template: str = "{problem}"  # the problem as shown to the model; may add format instructions
    max_prompt_length: int = 512  # tokens, images included; longer prompts are an error naming the sample


@dataclass
class SFTConfig:
    steps: int = 600  # supervised warm-start steps on data.sft before RL (0 to skip)
    batch_size: int = 16
    lr: float = 1e-3
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"  # decaying to 0 ends SFT on a stable policy
    target_template: str = "<answer>{solution}</answer>"  # the labelled answer; the end-of-turn token is appended


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16
    group_size: int = 8  # G answers per prompt
    max_new_tokens: int = 12
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # "hf": the built-in KV-cached sampler (CPU and GPU); "vllm": a colocated vLLM engine per process (GPU, pip install
    # 'vlmrl[vllm]'), weights pushed after every update; see vlmrl/rollout/vllm_engine.py
    engine: Literal["hf", "vllm"] = "hf"
    vllm: dict = field(default_factory=dict)  # engine=vllm: gpu_memory_utilization, max_model_len, enforce_eager, sleep


@dataclass
class AlgorithmConfig:
    # -- advantages (stage III); docs/algorithms.md has the formulas
    advantage: Literal["grpo", "rloo", "reinforce_pp", "remax", "gae"] = "grpo"
    advantage_scale: Literal["group", "batch", "none"] = "group"  # grpo: "none" is Dr.GRPO
    reinforce_pp_baseline: Literal["none", "group"] = "none"  # "group": REINFORCE++-baseline (G > 1)
    gamma: float = 1.0  # discount (reinforce_pp, gae)
    lam: float = 0.95  # GAE lambda
    # -- policy loss (stage IV)
    policy_loss: Literal["ppo_clip", "gspo", "reinforce", "dpo"] = "ppo_clip"  # dpo: online, best vs worst of a group
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # > epsilon_low is DAPO's clip-higher
    dual_clip: float | None = None  # dual-clip PPO's c (e.g. 3.0) bounds negative-advantage losses
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * entropy
    # -- KL to a frozen reference (loaded only when beta > 0, or for DPO)
    beta: float = 0.0  # KL coefficient; 0 loads no reference model
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_in: Literal["loss", "reward"] = "loss"  # "reward": -beta * KL per token folded into the reward
    # -- DAPO extras
    dynamic_sampling: bool = False  # drop zero-variance groups and sample more prompts to refill the batch
    max_resample_rounds: int = 3  # extra generation rounds per step for dynamic sampling
    overlong_filter: bool = False  # truncated answers get no gradient (DAPO's overlong filtering)
    # -- critic (advantage: gae)
    critic: Literal["head", "separate"] = "head"  # value head on the policy, or a separate copy of it
    critic_lr: float = 1e-3
    vf_coef: float = 0.5  # weight of the value loss in "head" mode
    value_clip: float | None = 0.2
    critic_warmup_steps: int = 0  # steps that train only the critic
    # -- DPO (policy_loss: dpo, or data.preferences for offline DPO)
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0


@dataclass
class RewardConfig:
    name: str = "accuracy"  # a registered reward, or "path/to/file.py:function"
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)  # options of the reward function (e.g. strict: false)
    label: str | None = None  # metric name, to use one reward twice with different options
    fn: str | None = None  # another spelling of `name` ({fn: "my_rewards.py:score", weight: 0.5})
    timeout: float | None = None  # seconds per call when the reward runs in a worker process (default 60)
    isolate: bool | None = None  # run in a worker process: true/false; null = user rewards yes, built-ins no

    def __post_init__(self):
        if self.fn is not None:
            if self.name not in ("accuracy", self.fn):
                raise ConfigError(f"reward: name {self.name!r} and fn {self.fn!r} disagree; give one of them")
            self.name = self.fn


@dataclass
class TrainerConfig:
    steps: int = 900  # RL generation steps
    lr: float = 3e-4
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch: int = 0  # trajectories per forward/backward chunk (0 = the whole minibatch); never changes the math
    # padded tokens per chunk (rows x (longest prompt + longest completion)), longest rows first; 0 = no budget. With
    # micro_batch, both caps apply. Like micro_batch, a memory knob only: the gradient does not depend on it
    micro_batch_tokens: int = 0
    ppo_epochs: int = 1
    minibatches: int = 1
    seed: int = 0
    eval_every: int = 150  # RL steps between held-out evaluations (0 = only before and after)
    save_every: int = 0  # RL steps between checkpoints (0 = only the SFT start and the end)
    log_rollouts_every: int = 25  # steps between rollout-gallery entries in rollouts.jsonl
    output_dir: str = "runs/quickstart"  # an existing non-empty folder gets a numbered sibling, never overwritten
    tensorboard: bool = True
    threads: int = 0  # torch CPU threads (0 = torch's default)
    distributed: Literal["none", "ddp", "fsdp2"] = "none"  # data parallel under torchrun (gloo on CPU, NCCL on GPU)
    # RL forwards without dropout (LoRA's adapter dropout included), so old, reference and training log-probs of the
    # same weights agree and the first PPO/GSPO ratio is 1 (TRL's disable_dropout)
    disable_dropout: bool = True
    wandb_project: str | None = None  # also log to this Weights & Biases project (pip install 'vlmrl[wandb]')


@dataclass
class EvalConfig:
    batch_size: int = 64
    max_new_tokens: int = 12
    sampled_temperature: float = 1.0  # accuracy is reported greedy and sampled at this temperature
    samples: int = 1  # answers per prompt in the sampled evaluations of `vlmrl train` (pass@k, maj@n when > 1)
    pass_k: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # pass@k reported for each k <= samples
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.6, 1.0])  # `vlmrl eval`'s temperatures
    reflection_words: list[str] | None = None  # words marking a reflective answer (null = MAYE's list)
    # OOD sets evaluated by --control/--seeds: "auto" (the ood split of data.eval's tasks), a data spec, {name: spec}
    # (a task spec may set split: test), or null; see docs/evaluation.md
    ood: Any = "auto"  # "auto" = the ood split of data.eval's built-in tasks; a spec; {name: spec}; null = none


@dataclass
class ControlConfig:
    # `vlmrl train --control sft`: continued SFT from the RL run's SFT start, on data.sft, for the RL phase's wall time
    lr: float = 3.0e-4  # constant learning rate of the continued SFT (the RL phase's trainer.lr by default)
    batch_size: int = 16  # labelled samples per control SFT step
    steps: int = 0  # 0 = train for the RL phase's wall time; N = exactly N steps (reproducible, machine-independent)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig("accuracy", 1.0)])
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    control: ControlConfig = field(default_factory=ControlConfig)


# ---------------------------------------------------------------------------------------------------------------
# building a typed config from plain data, with errors that name the key


def _describe(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value, tp, key: str):
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed values: {_describe(tp)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {sorted(f.name for f in dataclasses.fields(tp))}, "
                              f"got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from `data`; an unknown key or a badly typed value raises ConfigError naming it."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"unknown key '{prefix}{unknown[0]}'; allowed keys under {prefix.rstrip('.') or 'the top'}:"
                          f" {', '.join(names)}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=1e-5` -> (["trainer", "lr"], 1e-5); the value is read as YAML (numbers, lists, true/false)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. trainer.lr=1e-5)")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    if isinstance(value, str) and _looks_numeric(value):
        value = float(value)  # YAML 1.1 reads "1e-5" as a string
    return key.strip().split("."), value


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _set_dotted(data: dict, path: list[str], value, cls=None) -> None:
    """Apply one command-line override. Keys of typed sections are checked here; inside a free-form value (a data
    spec, reward kwargs) the key is set as given and checked by whatever reads it, still before any model is built."""
    node = data
    for i, part in enumerate(path):
        dotted = ".".join(path[:i])
        if (i == 0 or _is_section(dotted, cls)) and part not in node:
            raise ConfigError(f"command line: unknown key {'.'.join(path[:i + 1])!r}; allowed keys under "
                              f"{dotted or 'the top'}: {', '.join(node)}")
        if i == len(path) - 1:
            node[part] = value
        elif isinstance(node.get(part), dict):
            node = node[part]
        elif node.get(part) is None and not _is_section(".".join(path[:i + 1]), cls):
            node[part] = {}
            node = node[part]
        else:
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[:i + 1])} is not a section")


def load_config(path: str | Path | None = None, overrides: list[str] = (), cls=None):
    """Defaults, then the recipe YAML (if any), then `key=value` overrides; validated as a whole. `cls` is the
    top-level config dataclass (default `Config`; the ReCLIP track passes its own)."""
    cls = cls or Config
    data = to_dict(cls())
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"recipe {path} not found")
        recipe = yaml.safe_load(path.read_text()) or {}
        if not isinstance(recipe, dict):
            raise ConfigError(f"recipe {path}: the top level must be a mapping of sections")
        _merge(data, recipe, path, cls=cls)
    for text in overrides:
        keys, value = parse_override(text)
        _set_dotted(data, keys, value, cls)
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        where = f"recipe {path}" if path else "config"
        raise ConfigError(f"{where}: {e}") from None


def _merge(base: dict, new: dict, source, prefix: str = "", cls=None) -> None:
    """Recursively merge `new` into `base`. Dataclass sections merge key by key; free-form values are replaced."""
    for key, value in new.items():
        if key not in base:
            section = prefix.rstrip(".") or "the top"
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'; allowed keys under {section}: "
                              f"{', '.join(base)}")
        if isinstance(value, dict) and isinstance(base[key], dict) and _is_section(prefix + key, cls):
            _merge(base[key], value, source, prefix + key + ".", cls)
        else:
            base[key] = value


def _is_section(dotted: str, cls=None) -> bool:
    """True where the key is a typed config section (so its keys are validated), not a free-form mapping."""
    cls = cls or Config
    for part in dotted.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return False
        cls = hints[part]
    return True


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
