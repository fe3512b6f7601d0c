"""Reasoning and compute metrics of a batch of answers, shared by `evaluate` and the RL step's logs. No torch.

- reasoning/length: tokens inside the reasoning block (`<think>...</think>`), averaged over the answers that have
  one (None when none has); reasoning/block_share: the share of answers that have one
- tokens_per_correct (token efficiency): generated tokens of all answers / correct answers (None when none is right)
- compute/seconds_per_1k_rollouts = 1000 * wall seconds / answers; on GPUs also
  compute/gpu_seconds_per_1k_rollouts = 1000 * wall seconds * GPUs in use / answers

The reasoning block is what `vlmrl.rewards.parsing.strip_think` removes before an answer is parsed, so the chain
measured here is exactly the part no reward reads as the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vlmrl.eval.metrics import ReflectionCounts
from vlmrl.rewards.parsing import split_reasoning

TokenCounter = Callable[[list[str]], list[int]]


def token_counter(tokenizer) -> TokenCounter:
    """Token counts of texts under a Hugging Face tokenizer (no special tokens added)."""
    def count(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    return count


def reasoning_tokens(texts: Sequence[str], count: TokenCounter, think_tag: str = "think") -> list[int | None]:
    """Per answer: the tokens of its reasoning (stripped of surrounding whitespace), None without a reasoning block."""
    parts = [split_reasoning(t, think_tag)[0] for t in texts]
    present = [p for p in parts if p]
    counts = iter(count(present))
    return [None if p is None else (next(counts) if p else 0) for p in parts]


def chain_counts(reasoning: Sequence[int | None], lengths: Sequence[int], correct: Sequence[bool]) -> dict[str, int]:
    """The counts the chain metrics are ratios of: answers, correct answers, generated tokens (end token included),
    answers with a reasoning block (`reasoning[i]` not None) and their reasoning tokens."""
    if not (len(reasoning) == len(lengths) == len(correct)):
        raise ValueError(f"chain metrics: {len(reasoning)} reasoning counts, {len(lengths)} lengths, "
                         f"{len(correct)} correctness flags; give one of each per answer")
    chains = [r for r in reasoning if r is not None]
    return {"answers": len(reasoning), "correct": sum(map(bool, correct)), "tokens": int(sum(lengths)),
            "chains": len(chains), "chain_tokens": sum(chains)}


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def chain_ratios(counts: dict[str, float]) -> dict[str, float | None]:
    """reasoning/length = chain_tokens / chains, reasoning/block_share = chains / answers, tokens_per_correct =
    tokens / correct; None where the denominator is 0 (undefined, not 0)."""
    return {"reasoning/length": _ratio(counts["chain_tokens"], counts["chains"]),
            "reasoning/block_share": _ratio(counts["chains"], counts["answers"]),
            "tokens_per_correct": _ratio(counts["tokens"], counts["correct"])}


def chain_metrics(reasoning: Sequence[int | None], lengths: Sequence[int], correct: Sequence[bool]
                  ) -> dict[str, float | None]:
    """The chain metrics of answers with these reasoning token counts (None: no block), lengths and correctness."""
    return chain_ratios(chain_counts(reasoning, lengths, correct))


def compute_metrics(seconds: float, rollouts: int, gpus: int = 0) -> dict[str, float]:
    """Wall (and, with gpus > 0, GPU) seconds per 1,000 rollouts; GPU-seconds = wall seconds x GPUs in use."""
    if rollouts <= 0:
        return {}
    out = {"compute/seconds_per_1k_rollouts": 1000.0 * seconds / rollouts}
    if gpus > 0:
        out["compute/gpu_seconds_per_1k_rollouts"] = 1000.0 * seconds * gpus / rollouts
    return out


def rollout_metrics(texts: Sequence[str], correct: Sequence[bool], lengths: Sequence[int], count: TokenCounter,
                    markers: dict[str, Sequence[str]], seconds: float, gpus: int = 0,
                    reduce: Callable[[list[float]], list[float]] | None = None) -> dict[str, float | None]:
    """What an RL step logs about its sampled answers: the chain metrics, `<marker set>/share` for each word list
    (reflection, backtracking) and the compute per 1,000 rollouts.

    Computed from counts, so that data-parallel ranks can pool them first: `reduce` sums a list of counts over the
    ranks (None in one process), and every rank then holds the same ratios (the same undefined ones too). `gpus`:
    GPUs in use by the whole step (the world size on CUDA, else 0); `seconds`: this rank's wall time."""
    counts: dict[str, float] = chain_counts(reasoning_tokens(texts, count), lengths, correct)
    for name, words in markers.items():
        marked = ReflectionCounts(tuple(words))
        marked.add(texts, correct)
        counts[name] = marked.reflective
    if reduce is not None:
        counts = dict(zip(counts, reduce([float(v) for v in counts.values()]), strict=True))
    out = chain_ratios(counts)
    out.update({f"{name}/share": _ratio(counts[name], counts["answers"]) for name in markers})
    return {**out, **compute_metrics(seconds, int(counts["answers"]), gpus)}
