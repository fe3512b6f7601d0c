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
from vlmrl.data import TASKS, zoom
from vlmrl.errors import ConfigError
from vlmrl.models.batch import PromptTooLongError
from vlmrl.rewards.specs import CACHE_SHARE


def _label(template: str, sample: dict) -> str:
    try:
        return template.format(**sample)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"sft.target_template={template!r} cannot be filled from sample {sample.get('id')!r}: "
                          f"{type(e).__name__}: {e}") from None


def uses_tools(cfg: Config, *splits: list[dict]) -> bool:
    """An agentic run, or data with demonstrations of tool use (the no-tool arm of the same task counts, so both arms
    get the same tokenizer)."""
    return cfg.agent.enabled or any("demonstration" in s for samples in splits for s in samples[:1])


def user_texts(cfg: Config, *splits: list[dict]) -> list[str]:
    """Prompt and labelled-answer texts of the samples that come from user files (built-in tasks' text is already
    in the tiny tokenizer's corpus), demonstrations of tool use, and with `agent` on the tool-call scaffolding."""
    texts = []
    if uses_tools(cfg, *splits):
        texts += zoom.vocabulary()  # the tool-response wrapper, the zoom task's question and tool calls
    for samples in splits:
        for s in samples:
            texts += s.get("demonstration") or []
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
    # a `length` reward that follows rollout.max_new_tokens penalises its last third: the budget that keeps every
    # label clear of it (the advice to raise max_new_tokens must not turn into a penalty on right answers)
    train_need = clear_budget(need) if follows_budget(cfg) else need
    for key, value, wanted in (("rollout.max_new_tokens", cfg.rollout.max_new_tokens, train_need),
                               ("eval.max_new_tokens", cfg.eval.max_new_tokens, need)):
        if wanted > value:
            cut = need > value
            limit = value if cut else value - max(1, value // CACHE_SHARE)  # the longest answer that goes whole
            over = sum(n > limit for n in lengths)
            why = ("answers that cannot end are cut and score 0" if cut else
                   f"the length reward, which follows {key}, penalises answers longer than {limit} tokens, right "
                   f"ones included")
            raise ConfigError(
                f"{key}={value} is too short for the labelled answers: {over} of {len(samples)} "
                f"{'do not fit' if cut else 'fall in the length penalty'}, the longest (sample "
                f"{samples[longest].get('id')!r}: {labels[longest]!r}) takes {need} tokens with the end-of-turn "
                f"token; set {key}={wanted} or more ({why})")
    return need


def follows_budget(cfg: Config) -> bool:
    """A single-turn run with a `length` reward whose max_length follows rollout.max_new_tokens (not set)."""
    return not cfg.agent.enabled and any(r.name == "length" and r.weight and "max_length" not in r.kwargs
                                         for r in cfg.rewards)


def clear_budget(tokens: int) -> int:
    """The smallest generation budget B whose `length` penalty (from B - B // 3 tokens on; rewards/specs.py) leaves
    an answer of `tokens` unpenalised."""
    budget = tokens
    while tokens > budget - max(1, budget // CACHE_SHARE):
        budget += 1
    return budget


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


def check_demonstration_lengths(policy, cfg: Config, *splits: list[dict]) -> int:
    """With `agent` on: ConfigError naming the longest demonstration message when it does not fit in
    agent.turn_tokens (a turn that cannot end ends its episode); returns its length in tokens."""
    if not cfg.agent.enabled:
        return 0
    messages = [(s, m) for split in splits for s in split for m in s.get("demonstration") or []]
    if not messages:
        return 0
    lengths = [len(ids) + 1 for ids in policy.processor.tokenizer([m for _, m in messages],
                                                                   add_special_tokens=False)["input_ids"]]
    longest = max(range(len(messages)), key=lengths.__getitem__)
    if lengths[longest] > cfg.agent.turn_tokens:
        sample, message = messages[longest]
        raise ConfigError(f"agent.turn_tokens={cfg.agent.turn_tokens} is too short for the demonstrations: sample "
                          f"{sample.get('id')!r}'s message {message!r} takes {lengths[longest]} tokens with the "
                          f"end-of-turn token; set agent.turn_tokens={lengths[longest]} or more")
    return lengths[longest]


def check_data_fits(policy, cfg: Config, data) -> None:
    """The length checks on every split of the job's `Datasets`, before the first training step."""
    splits = (data.train, data.sft, data.eval, data.replay)
    check_label_lengths(policy, cfg, *splits)
    check_demonstration_lengths(policy, cfg, *splits)
    check_prompt_lengths(policy, cfg, *splits)
