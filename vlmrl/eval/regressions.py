"""Which tasks fell during RL: each task's held-out accuracy after RL against its accuracy before RL.

A run whose held-out set holds several tasks (the `task` column) logs each task's accuracy and 95% interval
(`greedy/task/<task>/accuracy`, `..._ci_low`, `..._ci_high`, `.../n`; vlmrl.eval.generative). A task *fell* when its
greedy accuracy after RL is below its start by more than the after-RL interval: the interval's upper bound is below
the before-RL accuracy, so the start is not among the accuracies the final evaluation is consistent with. With
200 prompts of a task at 50%, that is a fall of about 7 points; at 5%, any fall to 0 (upper bound 1.9%).
"""

from __future__ import annotations

from vlmrl.eval.metrics import format_interval

MODE = "greedy"  # the evaluation the check reads: greedy answers have no sampling noise of their own


def task_accuracies(metrics: dict, mode: str = MODE) -> dict[str, dict]:
    """{task: {"accuracy", "low", "high", "n"}} from a run's flat evaluation metrics (`MODE/task/<task>/...`),
    in the order the metrics list them; empty for a held-out set of one task (no per-task keys are logged)."""
    prefix, suffix = f"{mode}/task/", "/accuracy_ci_high"  # only an accuracy has an interval
    tasks = [k[len(prefix):-len(suffix)] for k in metrics if k.startswith(prefix) and k.endswith(suffix)]
    return {t: {"accuracy": metrics.get(f"{prefix}{t}/accuracy"), "low": metrics.get(f"{prefix}{t}/accuracy_ci_low"),
                "high": metrics.get(f"{prefix}{t}/accuracy_ci_high"), "n": metrics.get(f"{prefix}{t}/n")}
            for t in tasks}


def fallen_tasks(start: dict, final: dict, mode: str = MODE) -> list[str]:
    """The tasks whose accuracy after RL (`final`) has a 95% interval whose upper bound is below their accuracy
    before RL (`start`), in the order of `final`'s metrics. A task missing from either evaluation is not judged."""
    before, after = task_accuracies(start, mode), task_accuracies(final, mode)
    return [t for t, a in after.items() if t in before and before[t]["accuracy"] is not None
            and a["high"] is not None and a["high"] < before[t]["accuracy"]]


def fallen_warning(start: dict, final: dict, mode: str = MODE) -> str | None:
    """The warning naming every fallen task with its accuracy before and after RL, or None when none fell."""
    fallen = fallen_tasks(start, final, mode)
    if not fallen:
        return None
    before, after = task_accuracies(start, mode), task_accuracies(final, mode)
    cell = lambda m: format_interval(m["accuracy"], m["low"], m["high"])  # noqa: E731
    which = "; ".join(f"{t} {cell(before[t])} -> {cell(after[t])}" for t in fallen)
    return (f"{'task' if len(fallen) == 1 else 'tasks'} {', '.join(fallen)} fell during RL (held-out {mode} "
            f"accuracy after SFT -> after RL, below the start by more than the after-RL 95% interval): {which}. "
            f"Every answer is in the run's eval_samples.jsonl; docs/evaluation.md, 'Tasks that fell', says where to look")
