"""Held-out evaluation of a generative policy: n answers per prompt at one temperature, scored with MAYE's metrics.

`evaluate` returns flat summary metrics (what the trainer logs) and, beside them, a per-task breakdown, the marker
counts (reflection, backtracking) and per-prompt records. The formulas live in `vlmrl.eval.metrics` and
`vlmrl.eval.reasoning`:

- accuracy = mean@n: the share of all answers that are right (equal to the mean of pass@1), with its 95% interval
  over prompts (accuracy_ci_low/high: Wilson's with one answer per prompt, else a bootstrap over prompts)
- pass@k: the unbiased estimator 1 - C(n-c, k) / C(n, k) per prompt, averaged over prompts (k <= n)
- maj@n: the share of prompts whose most frequent well-formed answer is right
- mean_length (tokens) and truncated_share (answers that hit max_new_tokens without an end token)
- mean_reward (the total) and reward/<component>: means over the answers that have a value (a failed reward is left
  out, and counted in reward_failed_samples and reward/<component>/failures)
- reasoning/length, reasoning/block_share, tokens_per_correct: the reasoning chain and token efficiency
- reflection/* and backtracking/*: the five ratios over pooled counts, None where the denominator is empty
- compute/seconds_per_1k_rollouts (and compute/gpu_seconds_per_1k_rollouts on a GPU): the evaluation's cost
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vlmrl.agent.rollout import agent_metrics
from vlmrl.errors import ConfigError
from vlmrl.eval.metrics import (
    ReflectionCounts,
    accuracy_interval,
    answer_key,
    majority_vote,
    marker_sets,
    mean_pass_at_k,
)
from vlmrl.eval.reasoning import chain_counts, chain_ratios, compute_metrics, reasoning_tokens, token_counter
from vlmrl.models.policy import Policy
from vlmrl.rewards import REWARDS, RewardOutput, RewardSpec, compute_rewards
from vlmrl.rewards.specs import reward_specs
from vlmrl.rollout.batch import make_prompts, reward_columns
from vlmrl.rollout.generate import generate


@dataclass(frozen=True)
class Solved:
    """What counts as a solved answer (the recipe's `solved` section): the value of the reward component `spec`
    >= `threshold`. The default is the built-in `accuracy` at 1.0: a right number, text, math or choice answer, and
    a box with IoU >= 0.5."""

    spec: RewardSpec = field(default_factory=lambda: RewardSpec("accuracy"))
    threshold: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> Solved:
        """`cfg.solved.reward` as the recipe's component of that key (with its options), else a registered reward
        with its defaults; an unknown name is a ConfigError listing the recipe's components."""
        name = cfg.solved.reward
        spec = next((s for s in reward_specs(cfg) if s.key == name), None)
        if spec is None:
            if name not in REWARDS:
                keys = ", ".join(s.key for s in reward_specs(cfg))
                raise ConfigError(f"solved.reward={name!r} is neither a component of rewards ({keys}) nor a "
                                  f"registered reward; name the component whose value says an answer is solved")
            spec = RewardSpec(name)
        return cls(spec, cfg.solved.threshold)


def correctness(completions: list[str], columns: dict[str, list], solved: Solved | None = None,
                scores: RewardOutput | None = None) -> list[bool]:
    """Whether each answer is solved (`Solved`: the named component's value >= its threshold; a None or failed value
    is not). `scores`: the batch's rewards, when already computed with the component in them (it is not scored
    again)."""
    solved = solved or Solved()
    key = solved.spec.key
    if scores is None or key not in scores.components:
        scores = compute_rewards([solved.spec], completions, columns)
    return [v is not None and v >= solved.threshold for v in scores.components[key]]


def summarize(records: list[dict], ks: Sequence[int]) -> dict[str, float | None]:
    """Accuracy, reward, length and reasoning metrics of per-prompt records (each with `answers_correct`, `lengths`,
    `truncated`, `vote`, `reasoning_tokens`, and `rewards` / `components` when rewards were computed)."""
    correct = [r["answers_correct"] for r in records]
    n = len(correct[0])
    answers = sum(len(c) for c in correct)
    out: dict[str, float | None] = {"accuracy": sum(map(sum, correct)) / answers}
    out["accuracy_ci_low"], out["accuracy_ci_high"] = accuracy_interval(correct)  # 95%, over prompts
    for k in sorted({1, *ks}):
        if k <= n:
            out[f"pass@{k}"] = mean_pass_at_k(correct, k)
    if n > 1:
        out[f"mean@{n}"] = out["accuracy"]
        out[f"maj@{n}"] = sum(r["vote"] for r in records) / len(records)
    out["mean_length"] = sum(sum(r["lengths"]) for r in records) / answers
    out["truncated_share"] = sum(sum(r["truncated"]) for r in records) / answers
    if records[0].get("rewards") is not None:
        out["mean_reward"] = _mean(v for r in records for v in r["rewards"])
        for key in records[0]["components"]:
            out[f"reward/{key}"] = _mean(v for r in records for v in r["components"][key])
    flat = lambda key: [v for r in records for v in r[key]]  # noqa: E731
    out.update(chain_ratios(chain_counts(flat("reasoning_tokens"), flat("lengths"), flat("answers_correct"))))
    out["n"] = len(records)
    return out


def _mean(values) -> float | None:
    """Mean of the values that are not None (a failed or not applicable reward); None when there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


@torch.no_grad()
def evaluate(policy: Policy, samples: list[dict], *, temperature: float = 0.0, max_new_tokens: int = 12,
             batch_size: int = 64, template: str = "{problem}", max_prompt_length: int | None = None,
             rewards: list[RewardSpec] | None = None, seed: int = 0,
             progress: Callable[..., None] | None = None, n: int = 1, ks: Sequence[int] = (),
             reflection_words: Sequence[str] | None = None, backtracking_words: Sequence[str] | None = None,
             agent=None, solved: Solved | None = None) -> dict:
    """`n` answers per held-out sample at `temperature` (0 = greedy, which always takes n = 1: its answers are equal).

    `batch_size` counts answers per generation call (prompts per call = batch_size // n). `ks`: the pass@k values to
    report (pass@1 always; k > n is skipped). `reflection_words` / `backtracking_words`: the marker word lists (None:
    the defaults in vlmrl.eval.metrics). With `agent` (vlmrl.agent.AgentSpec) each answer is a multi-turn episode
    with tools; the metrics then add its tool use (tool/call_rate, tool/invalid_rate, agent/turns_per_episode, ...)
    and each record its turns. `solved` says which answers are right (default: `accuracy`, a box by IoU >= 0.5),
    as in training. Returns {"metrics": flat scalars, "per_task": {task: metrics},
    "reflection" and "backtracking": {"ratios", "counts", "words"}, "records": one per sample, in sample order}.
    """
    if not samples:
        raise ValueError("evaluate: no samples; check the eval data spec (data.eval or --data)")
    n = 1 if temperature <= 0 else n
    if n < 1:
        raise ValueError(f"evaluate: n={n} answers per prompt; use n >= 1")
    was_training = policy.model.training
    policy.model.eval()
    t0 = time.perf_counter()
    generator = torch.Generator(device=policy.model.device).manual_seed(seed)
    markers = {name: ReflectionCounts(words) for name, words in marker_sets(reflection_words,
                                                                            backtracking_words).items()}
    count_tokens = token_counter(policy.processor.tokenizer)
    records, failed, component_failures, episodes = [], 0, {}, []
    step = max(1, batch_size // n)
    for start in range(0, len(samples), step):
        chunk = samples[start:start + step]
        prompts = make_prompts(policy, chunk, template, max_prompt_length)
        if agent is None:
            rollout = generate(policy, prompts, n, max_new_tokens, temperature, generator=generator)
        else:  # each prompt's own stream (from the seed and its position): the same answers in any batch layout
            seeds = [(seed * 1_000_003 + start + i) % (2**63 - 1) for i in range(len(chunk))]
            rollout = agent.rollout(policy, prompts, chunk, n, temperature, prompt_seeds=seeds).rollout
            episodes += rollout.columns["turns"]
        columns = reward_columns(chunk, rollout.prompt_index)
        columns["completion_truncated"] = rollout.truncated.tolist()
        columns["completion_lengths"] = rollout.lengths.tolist()
        columns.update(rollout.columns)
        scores = compute_rewards(rewards, rollout.texts, columns) if rewards else None
        ok = correctness(rollout.texts, columns, solved, scores)
        flags = {name: counts.add(rollout.texts, ok) for name, counts in markers.items()}
        totals, components = None, {}
        if scores is not None:
            scored = scores.scored().tolist()
            failed += scored.count(False)  # a failed reward is not a score: left out, counted
            totals = [t if s else None for t, s in zip(scores.total.tolist(), scored, strict=True)]
            components = scores.components
            for key, lost in scores.failures.items():
                component_failures[key] = component_failures.get(key, 0) + lost
        lengths, truncated = rollout.lengths.tolist(), rollout.truncated.tolist()
        chains = reasoning_tokens(rollout.texts, count_tokens)
        for i, s in enumerate(chunk):
            rows = slice(i * n, (i + 1) * n)  # the answers of prompt i are contiguous
            texts, good = rollout.texts[rows], ok[rows]
            keys = [answer_key(t, tr, s.get("answer_type")) for t, tr in zip(texts, truncated[rows], strict=True)]
            records.append({"id": s["id"], "task": s.get("task", ""), "problem": s.get("problem", ""),
                            "solution": s["solution"], "answer": texts[0], "correct": good[0], "answers": texts,
                            "answers_correct": good, "lengths": lengths[rows], "truncated": truncated[rows],
                            "markers": {name: f[rows] for name, f in flags.items()},
                            "reasoning_tokens": chains[rows], "vote": majority_vote(keys, good),
                            "rewards": None if totals is None else totals[rows],
                            "components": {k: v[rows] for k, v in components.items()}})
            if agent is not None:  # the turns of the first answer, images as counts (records are JSON)
                records[-1]["turns"] = [{k: (len(v) if k == "images" else v) for k, v in t.items()}
                                        for t in rollout.columns["turns"][i * n]]
        if progress:
            done = sum(sum(r["answers_correct"]) for r in records) / (len(records) * n)
            progress(len(chunk), acc=f"{done:.2f}")  # live accuracy for a progress bar
    policy.model.train(was_training)
    metrics = summarize(records, ks)
    metrics["samples_per_prompt"] = n
    if agent is not None:
        metrics.update(agent_metrics({"turns": episodes}))
    if rewards:
        metrics["reward_failed_samples"] = float(failed)
        metrics.update({f"reward/{k}/failures": float(v) for k, v in component_failures.items()})
    for name, counts in markers.items():
        metrics.update({f"{name}/{k}": v for k, v in counts.ratios().items()})
    gpus = 1 if torch.device(policy.model.device).type == "cuda" else 0
    metrics.update(compute_metrics(time.perf_counter() - t0, len(records) * n, gpus))
    tasks = sorted({r["task"] for r in records})
    per_task = {t: summarize([r for r in records if r["task"] == t], ks) for t in tasks}
    if len(tasks) > 1:
        metrics.update({f"task/{t}/{k}": v for t, m in per_task.items() for k, v in m.items()})
    return {"metrics": metrics, "per_task": per_task, "records": records,
            **{name: {"ratios": c.ratios(), "counts": c.counts(), "words": c.frequencies()}
               for name, c in markers.items()}}
