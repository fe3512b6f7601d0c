"""Checks that the data fits the configured lengths, made once the tokenizer exists and before any training step.

- Every labelled answer (`sft.target_template` around the solution, plus the end-of-turn token) must fit in
  `rollout.max_new_tokens` and `eval.max_new_tokens`: a label that cannot be generated whole is always cut and
  scores 0, and RL then learns from a reward that can never be earned.
- Every prompt (chat template and image placeholders included) must fit in `data.max_prompt_length`, checked at
  load for every sample instead of at the step that first draws it.
- The embedded tiny model's tokenizer is trained on the user's own data text too (`user_texts`), so the words of a
  user dataset are tokens, not bytes.
"""

from __future__ import annotations

from vlmrl.config import Config
from vlmrl.data import TASKS
from vlmrl.errors import ConfigError
from vlmrl.models.batch import PromptTooLongError


def _label(template: str, sample: dict) -> str:
    try:
        return template.format(**sample)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"sft.target_template={template!r} cannot be filled from sample {sample.get('id')!r}: "
                          f"{type(e).__name__}: {e}") from None


def user_texts(cfg: Config, *splits: list[dict]) -> list[str]:
    """Prompt and labelled-answer texts of the samples that come from user files (built-in tasks' text is already
    in the tiny tokenizer's corpus)."""
    texts = []
    for samples in splits:
        for s in samples:
            if s.get("task") in TASKS:
                continue
            texts.append(cfg.data.prompt_template.format(**s))
            if s.get("solution") is not None:
                texts.append(_label(cfg.sft.target_template, s))
    return texts


def check_label_lengths(policy, cfg: Config, *splits: list[dict]) -> int:
    """ConfigError naming the longest labelled answer when it does not fit in rollout.max_new_tokens or
    eval.max_new_tokens; returns its length in tokens (end-of-turn included)."""
    samples = [s for split in splits for s in split if s.get("solution") is not None]
    if not samples:
        return 0
    labels = [_label(cfg.sft.target_template, s) for s in samples]
    lengths = [len(ids) + 1 for ids in policy.processor.tokenizer(labels, add_special_tokens=False)["input_ids"]]
    longest = max(range(len(samples)), key=lengths.__getitem__)
    need = lengths[longest]
    for key, value in (("rollout.max_new_tokens", cfg.rollout.max_new_tokens),
                       ("eval.max_new_tokens", cfg.eval.max_new_tokens)):
        if need > value:
            over = sum(n > value for n in lengths)
            raise ConfigError(
                f"{key}={value} is too short for the labelled answers: {over} of {len(samples)} do not fit, the "
                f"longest (sample {samples[longest].get('id')!r}: {labels[longest]!r}) takes {need} tokens with the "
                f"end-of-turn token; set {key}={need} or more (answers that cannot end are cut and score 0)")
    return need


def check_prompt_lengths(policy, cfg: Config, *splits: list[dict], batch_size: int = 256) -> int:
    """PromptTooLongError naming the first sample whose prompt exceeds data.max_prompt_length; returns the longest
    prompt's length. Image placeholder counts depend only on image sizes, so each size is processed once."""
    longest = 0
    processor = policy.processor
    for split in splits:
        for start in range(0, len(split), batch_size):
            chunk = split[start:start + batch_size]
            problems = [cfg.data.prompt_template.format(**s) for s in chunk]
            lengths = processor.prompt_lengths(problems, [s["images"] for s in chunk], [s["id"] for s in chunk])
            for s, n in zip(chunk, lengths, strict=True):
                if n > cfg.data.max_prompt_length:
                    raise PromptTooLongError(
                        f"sample {s['id']!r}: prompt is {n} tokens (images included), over data.max_prompt_length="
                        f"{cfg.data.max_prompt_length}; raise data.max_prompt_length or lower the pixel budget "
                        f"(model.max_pixels)")
                longest = max(longest, n)
    return longest


def check_data_fits(policy, cfg: Config, data) -> None:
    """Both length checks on every split of the job's `Datasets`, before the first training step."""
    splits = (data.train, data.sft, data.eval, data.replay)
    check_label_lengths(policy, cfg, *splits)
    check_prompt_lengths(policy, cfg, *splits)
