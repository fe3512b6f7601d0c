"""What an RL step logs about the batch it trained, beside the update's own metrics (vlmrl/trainer/rl.py `learn`):
the pass-rate histogram of its groups and, per task, how many answers a grading reward scored."""

from __future__ import annotations

from vlmrl.trainer.curriculum import PASS_RATE_BINS, pass_rate_bin


def task_of(sample: dict) -> str:
    """The name a sample's per-task metrics (`task/<task>/...`) go under: its `task`, or "data" without one."""
    return sample.get("task") or "data"


def pass_rate_histogram(correct: list[bool], group_size: int) -> dict[str, float]:
    """The share of the trained groups in each pass-rate bin (`trained_pass_rate/0`, `/0-25`, ..., `/100`): how much
    of the batch could carry a signal (the two ends cannot under a 0/1 reward)."""
    groups = [correct[i:i + group_size] for i in range(0, len(correct), group_size)]
    counts = dict.fromkeys(PASS_RATE_BINS, 0)
    for group in groups:
        counts[pass_rate_bin(sum(group), len(group))] += 1
    return {f"trained_pass_rate/{k}": v / max(len(groups), 1) for k, v in counts.items()}


def task_reward_counts(batch) -> dict[str, float]:
    """Per task of the batch: `task/<task>/graded_answers`, the answers a weighted reward that grades answers gave a
    value, and `task/<task>/ungraded_answers`, those only shaping rewards (format, length) or none scored: nothing
    paid a right answer there (vlmrl.rewards.coverage; under torchrun, the mean over the processes)."""
    graded = batch.rewards.graded
    if graded is None:
        return {}
    out: dict[str, float] = {}
    for row, ok in zip(batch.rollout.prompt_index.tolist(), graded, strict=True):
        task = task_of(batch.samples[row])
        for kind in ("graded", "ungraded"):
            out.setdefault(f"task/{task}/{kind}_answers", 0.0)
        out[f"task/{task}/{'graded' if ok else 'ungraded'}_answers"] += 1.0
    return out


def task_signal_counts(samples: list[dict], signal: list[bool], correct: list[bool], group_size: int
                       ) -> dict[str, float]:
    """Per task, over one generation round's groups (`signal`: whether each group's rewards differed): how many
    groups it generated (`task/<task>/groups`), how many carried a signal (`.../signal_groups`), and how many every
    answer solved (`.../solved_groups`) or none did (`.../unsolved_groups`). The RL step sums them over its
    dynamic-sampling rounds, so a task whose groups teach nothing is seen even when the rounds drop every one of its
    groups (`vlmrl.trainer.watch.SparseSignalWatch`)."""
    out: dict[str, float] = {}
    for i, (sample, ok) in enumerate(zip(samples, signal, strict=True)):
        task = task_of(sample)
        solved = sum(correct[i * group_size:(i + 1) * group_size])
        for key, value in (("groups", 1.0), ("signal_groups", float(ok)), ("solved_groups", solved == group_size),
                           ("unsolved_groups", solved == 0)):
            out[f"task/{task}/{key}"] = out.get(f"task/{task}/{key}", 0.0) + float(value)
    return out


def add_counts(total: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    for key, value in more.items():
        total[key] = total.get(key, 0.0) + value
    return total
