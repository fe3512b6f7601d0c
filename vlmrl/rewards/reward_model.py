"""The `reward_model` reward: a learned outcome reward model's score of each answer (`vlmrl rm train` makes one).

    rewards:
      - {name: reward_model, path: runs/rm}          # a run of `vlmrl rm train`, or its checkpoint-N folder

The RM is loaded once per process and scores a batch in chunks of `batch_size` answers in the trainer's process, on
the trainer's device (`vlmrl train` binds it, `bind_reward_models`; elsewhere the current CUDA device when one is
set up, else the CPU). Each prompt is rendered with the template the RM was trained with, its images included.

Refusals, said once and plainly:
- `vlmrl train` refuses, before any training step, an RM whose tokenizer's vocabulary is not the policy's: it would
  score the policy's answers split into pieces it never learned from (`same_tokenizer: false` scores them anyway);
- an answer longer than the RM's `max_answer_tokens`, or a prompt longer than its `max_prompt_length` (both in its
  reward_model.json), is a `RewardFailure` naming the lengths: the sample is counted in reward/reward_model/failures
  and trains nothing (advantage 0), never scored on a cut text.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmrl.errors import ConfigError
from vlmrl.models.preflight import resolve_model
from vlmrl.rewards.columns import per_sample
from vlmrl.rewards.registry import RewardBatch, RewardFailure, RewardSpec, register_reward
from vlmrl.rewards.verifiable import ANSWER_TYPES

if TYPE_CHECKING:
    from vlmrl.models.reward_model import RewardModel

# torch and the model code load on first use: importing the rewards (every command does) stays light

NAME = "reward_model"
_MODELS: dict[tuple[str, str, str], RewardModel] = {}
_LOCK = threading.Lock()


def default_device() -> str:
    """The trainer's device where none is bound: the current CUDA device once CUDA is set up, else the CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def get_reward_model(path: str | Path, device: str | None = None, dtype: str = "float32") -> RewardModel:
    """The process-wide RM at `path` (a model folder, or a run directory: its newest complete checkpoint), loaded
    once per (folder, device, dtype), in eval mode, its weights frozen."""
    from vlmrl.models.reward_model import RewardModel

    folder = str(Path(resolve_model(path, f"reward {NAME} path")).resolve())
    key = (folder, device or default_device(), dtype)
    with _LOCK:
        if key not in _MODELS:
            rm = RewardModel.from_pretrained(folder, dtype, key[1])
            rm.train(False)
            for p in [*rm.policy.model.parameters(), *rm.head.parameters()]:
                p.requires_grad_(False)
            _MODELS[key] = rm
        return _MODELS[key]


def check_vocabulary(rm: RewardModel, tokenizer, where: str) -> None:
    """ConfigError when the RM's tokenizer (its reward_model.json fingerprint) is not `tokenizer`'s."""
    from vlmrl.models.reward_model import vocabulary_fingerprint

    mine, theirs = rm.info["vocabulary"], vocabulary_fingerprint(tokenizer)
    if mine != theirs:
        raise ConfigError(
            f"{where}: the reward model's tokenizer is not the policy's (vocabulary of {mine['size']} tokens, "
            f"sha256 {mine['sha256'][:12]}, against the policy's {theirs['size']}, {theirs['sha256'][:12]}): it would "
            "score the policy's answers split into tokens it never learned from. Train the RM from the policy's "
            "checkpoint (vlmrl rm train model.name_or_path=RUN/checkpoint-0), or set same_tokenizer: false in the "
            "reward's kwargs to score the text with the RM's own tokenizer anyway")


def bind_reward_models(specs: list[RewardSpec], policy) -> None:
    """For each `reward_model` component: load the RM on the policy's device (set as its `device` unless the recipe
    gives one) and refuse it, with a ConfigError, when its tokenizer is not the policy's (unless same_tokenizer is
    false). `vlmrl train` calls this once the policy is loaded, before any training step."""
    for i, spec in enumerate(specs):
        if spec.name != NAME:
            continue
        if "path" not in spec.kwargs:
            raise ConfigError(f"rewards[{i}] ({spec.key}): reward_model needs kwargs.path, the folder of an RM "
                              "trained by `vlmrl rm train` (or its run directory)")
        spec.kwargs.setdefault("device", str(policy.family.device))
        rm = get_reward_model(spec.kwargs["path"], spec.kwargs["device"], spec.kwargs.get("dtype", "float32"))
        if spec.kwargs.get("same_tokenizer", True):
            check_vocabulary(rm, policy.processor.tokenizer, f"rewards[{i}] ({spec.key}) {spec.kwargs['path']}")


@register_reward(NAME, inline=True, grades=ANSWER_TYPES)
def reward_model_reward(completions: list[str], *, path: str, batch_size: int = 16, device: str | None = None,
                        dtype: str = "float32", same_tokenizer: bool = True, images: list[Any] | None = None,
                        completion_truncated: list[bool] | None = None, **columns: Any) -> list[Any]:
    """The RM's scalar score of each answer (unbounded; Bradley-Terry gives it meaning only as a difference between
    answers to one prompt, which is what group advantages use), from the RM at `path`.

    A finished answer is scored with its end-of-turn token after it, as the RM was trained; a truncated one without.
    An answer past the RM's `max_answer_tokens` or a prompt past its `max_prompt_length` is a RewardFailure naming
    both numbers (counted, trains nothing). `same_tokenizer` is checked by `vlmrl train` (`bind_reward_models`).
    Logged per step: reward/reward_model/too_long (answers or prompts refused for their length)."""
    import torch

    from vlmrl.models.reward_model import answer_ids

    rm = get_reward_model(path, device, dtype)
    n = len(completions)
    truncated = per_sample(completion_truncated, n, False)
    image_lists = per_sample(images, n, None)
    samples = [{**{k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == n},
                "images": image_lists[i] or []} for i in range(n)]
    ids, mask = answer_ids(rm.policy, [str(c) for c in completions], [not t for t in truncated])
    lengths = mask.sum(-1).tolist()
    limit = rm.info["max_answer_tokens"]
    values: list[Any] = [None] * n
    for i, length in enumerate(lengths):
        if length > limit:
            values[i] = RewardFailure(f"answer of {length} tokens; this reward model scores at most {limit} "
                                      f"(max_answer_tokens in {path}/reward_model.json)")
    todo = [i for i in range(n) if values[i] is None]
    for start in range(0, len(todo), batch_size):
        rows = todo[start:start + batch_size]
        scorable, prompts = _prompts(rm, [samples[i] for i in rows])
        for j, reason in enumerate(scorable):
            if reason is not None:
                values[rows[j]] = RewardFailure(reason)
        keep = [j for j, reason in enumerate(scorable) if reason is None]
        if not keep:
            continue
        pick = torch.tensor([rows[j] for j in keep])
        width = max(1, int(mask[pick].sum(-1).max()))
        with torch.no_grad():
            scores = rm.score(prompts, torch.arange(len(keep)), ids[pick, :width], mask[pick, :width])
        for j, value in zip(keep, scores.tolist(), strict=True):
            values[rows[j]] = value
    too_long = sum(isinstance(v, RewardFailure) for v in values)
    return RewardBatch(values, {"too_long": float(too_long)})


def _prompts(rm: RewardModel, samples: list[dict]):
    """(per sample: None or why its prompt cannot be scored, the scorable samples' PromptBatch)."""
    from vlmrl.models.batch import PromptTooLongError

    try:
        return [None] * len(samples), rm.prompts(samples)
    except PromptTooLongError:
        pass
    reasons: list[str | None] = []
    for s in samples:  # find which: each prompt alone
        try:
            rm.prompts([s])
            reasons.append(None)
        except PromptTooLongError as e:
            reasons.append(f"prompt longer than this reward model's max_prompt_length "
                           f"({rm.info['max_prompt_length']} tokens): {e}")
    ok = [s for s, r in zip(samples, reasons, strict=True) if r is None]
    return reasons, rm.prompts(ok) if ok else None
