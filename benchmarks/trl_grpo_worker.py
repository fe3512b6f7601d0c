"""One TRL `GRPOTrainer` run from a vlmrl checkpoint, matched to vlmrl's quickstart RL phase (a worker of
benchmarks/trl_side_by_side.py; run it through that script).

    python benchmarks/trl_grpo_worker.py --checkpoint RUN/checkpoint-0 --steps 300 --threads 1 --seed 0 --out DIR \
        [--set KEY=VALUE ...]

What is matched to `vlmrl train model.name_or_path=CKPT sft.steps=0 ...` (the checkpoint's config.yaml): the RL
prompts (data.train), the prompt text (data.prompt_template inside the same Qwen chat scaffold), prompts per step,
G, max new tokens, temperature / top-p / top-k, the reward (vlmrl's strict `accuracy`, with truncation taken from
the completion ids), GRPO advantages with the group std, the clipped token-level loss averaged over all tokens of the
batch ("token-mean" = TRL's "dapo"), beta, learning rate (constant, no warmup), weight decay, gradient clipping, one
update per generation, float32, no gradient checkpointing, the number of steps and the torch thread count. What
TRL lacks (dynamic sampling, a curriculum, rewards besides accuracy: `unmatched`) is refused; the side-by-side turns
it off in vlmrl too, with the same `--set` overrides on both sides.

Writes DIR/result.json (per-step seconds, rewards, vision-tower image counts) and DIR/final (a `save_pretrained`
folder with the vlmrl processor files and config.yaml, so `vlmrl eval DIR/final` evaluates it like a vlmrl run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def unmatched(cfg) -> list[str]:
    """What the vlmrl recipe `cfg` does that TRL's GRPOTrainer cannot (an empty list: the two can be matched)."""
    a, t = cfg.algorithm, cfg.trainer
    lacking = []
    if (a.advantage, a.policy_loss, a.loss_aggregation, a.kl_estimator) != ("grpo", "ppo_clip", "token-mean", "k3"):
        lacking.append("an algorithm other than GRPO + ppo_clip + token-mean (+ k3 KL)")
    if t.ppo_epochs * t.minibatches != 1 or t.lr_schedule != "constant":
        lacking.append("more than one update per generation, or a non-constant lr")
    if a.dynamic_sampling:
        lacking.append("algorithm.dynamic_sampling")
    if cfg.curriculum.filter_solved or cfg.curriculum.filter_unsolved or cfg.curriculum.order != "random":
        lacking.append("curriculum (filter_solved / filter_unsolved / order)")
    if [(w.name, w.weight) for w in cfg.rewards] != [("accuracy", 1.0)]:
        lacking.append(f"rewards other than accuracy alone ({[w.name for w in cfg.rewards]})")
    return lacking


def make_processor(checkpoint: Path):
    """A transformers `ProcessorMixin` for the Qwen2-VL tokenizer + image processor, without the video slot.

    TRL treats a model as a VLM only when its processing class is a `ProcessorMixin`; transformers'
    `Qwen2VLProcessor` cannot be built without torchvision (its video processor), so this subclass keeps
    Qwen2VLProcessor's image behaviour (placeholder expansion, mm_token_type_ids) and drops the video slot.
    """
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def make_dataset(cfg):
    """vlmrl's RL prompts as a TRL conversational dataset: prompt messages + `images` + the reward's columns."""
    from datasets import Dataset

    from vlmrl.data import build_dataset

    samples, _ = build_dataset(cfg.data.train, "train", cfg.data.seed, cfg.data.on_error)
    rows = [{"prompt": [{"role": "user", "content": cfg.data.prompt_template.format(**s)}], "images": s["images"],
             "solution": s["solution"], "answer_type": s["answer_type"], "sample_id": s["id"]} for s in samples]
    return Dataset.from_list(rows)


def make_reward(eos_ids: set[int]):
    """vlmrl's strict accuracy reward in TRL's signature; an answer is truncated when its ids do not end in an end
    token (TRL keeps the end token in `completion_ids`), as vlmrl's `completion_truncated` column says."""
    from vlmrl.rewards import REWARDS

    def accuracy(completions, completion_ids, solution, answer_type, **_):
        truncated = [not ids or ids[-1] not in eos_ids for ids in completion_ids]
        return REWARDS["accuracy"](completions, solution=solution, answer_type=answer_type,
                                   completion_truncated=truncated)

    return accuracy


def count_vision_images(model, counts: dict) -> None:
    """Count images encoded by the vision tower, split into generation ("rollout") and everything else ("train")."""
    phase = {"now": "train"}

    def pre_hook(_module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        counts[phase["now"]] += 0 if grid is None else int(grid.shape[0])

    model.model.visual.register_forward_pre_hook(pre_hook, with_kwargs=True)
    generate = model.generate

    def generate_counted(*args, **kwargs):
        phase["now"] = "rollout"
        try:
            return generate(*args, **kwargs)
        finally:
            phase["now"] = "train"

    model.generate = generate_counted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="vlmrl checkpoint folder (the SFT start)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="overrides on the checkpoint's config.yaml, the ones the vlmrl side runs with")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import trl
    from transformers import Qwen2VLForConditionalGeneration, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from vlmrl.config import load_config

    ckpt, out = Path(args.checkpoint), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(ckpt / "config.yaml", args.set)
    r, a, t = cfg.rollout, cfg.algorithm, cfg.trainer
    lacking = unmatched(cfg)
    if lacking:
        raise SystemExit(f"{ckpt}/config.yaml with {args.set}: TRL's GRPOTrainer has no match for {'; '.join(lacking)}"
                         "; turn these off on both sides (trl_side_by_side.py's MATCHED overrides do)")
    model = Qwen2VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    processor = make_processor(ckpt)
    eos_ids = {processor.tokenizer.convert_tokens_to_ids("<|im_end|>"), processor.tokenizer.eos_token_id}
    model.generation_config.eos_token_id = sorted(eos_ids)
    counts = {"rollout": 0, "train": 0}
    count_vision_images(model, counts)

    config = GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=args.steps, seed=args.seed, use_cpu=True, bf16=False,
        gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_train_batch_size=r.prompts_per_step * r.group_size, gradient_accumulation_steps=1,
        num_generations=r.group_size, num_iterations=t.ppo_epochs, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=t.warmup_steps, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        beta=a.beta, epsilon=a.epsilon_low, epsilon_high=a.epsilon_high, loss_type="dapo",
        scale_rewards=a.advantage_scale, mask_truncated_completions=a.overlong_filter,
    )

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps: list[dict] = []
            self.t0 = self.c0 = 0.0

        def on_step_begin(self, *_args, **_kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            self.before = dict(counts)

        def on_step_end(self, *_args, **_kw):
            self.steps.append({"seconds": time.perf_counter() - self.t0, "cpu_seconds": time.process_time() - self.c0,
                               **{f"vision_images_{k}": counts[k] - self.before[k] for k in counts}})

        def on_log(self, _args, state, _control, logs=None, **_kw):
            if logs and "reward" in logs and self.steps:
                self.steps[-1].update({k: logs[k] for k in ("reward", "rewards/accuracy/mean",
                                                            "completions/mean_length") if k in logs})

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=make_reward(eos_ids), args=config,
                          train_dataset=make_dataset(cfg), processing_class=processor, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - t0

    final = out / "final"
    trainer.model.save_pretrained(final)
    for f in ckpt.iterdir():  # tokenizer, image processor, vlmrl processor marker and config.yaml of the start
        if f.is_file() and not f.name.startswith(("model", "trainer_state", "optimizer", "generation_config")) \
                and f.name != "config.json":
            shutil.copy(f, final / f.name)
    rollouts = len(timer.steps) * r.prompts_per_step * r.group_size
    step_seconds = sum(s["seconds"] for s in timer.steps)
    result = {"steps": timer.steps, "train_seconds": train_seconds, "step_seconds": step_seconds,
              "step_cpu_seconds": sum(s["cpu_seconds"] for s in timer.steps),
              "rollouts": rollouts, "rollouts_per_second": rollouts / step_seconds, "final": str(final),
              "threads": torch.get_num_threads(), "trl": trl.__version__}
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
