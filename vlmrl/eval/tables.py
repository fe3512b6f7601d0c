"""Plain-text tables of evaluation results for the console (the CLI prints them; nothing here prints)."""

from __future__ import annotations

from vlmrl.eval.metrics import format_interval
from vlmrl.eval.regressions import MODE, fallen_tasks, task_accuracies
from vlmrl.eval.report import ARM_NAMES, MARKER_SETS, REFLECTION_RATIOS, is_rate

TRAIN_TABLE_KEYS = ("greedy/accuracy", "sampled/accuracy", "greedy/mean_reward", "greedy/mean_length")


def _cell(v, pct: bool = True) -> str:
    if v is None:
        return "undefined"
    if isinstance(v, float) and pct:
        return f"{100 * v:.1f}%"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _is_count(key: str) -> bool:
    """Metrics that count samples or failures: printed as integers, not as 3.00."""
    return key.endswith(("/failures", "failed_samples")) or key in ("n", "samples_per_prompt") \
        or "tool/failures" in key or "agent/ended" in key


def _metric_cell(key: str, v, metrics: dict | None = None) -> str:
    if _is_count(key) and isinstance(v, (int, float)) and float(v).is_integer():
        return str(int(v))
    if metrics is not None and f"{key}_ci_low" in metrics:  # an accuracy, with its 95% interval
        return format_interval(v, metrics[f"{key}_ci_low"], metrics[f"{key}_ci_high"])
    return _cell(v, is_rate(key))


def _is_interval(key: str) -> bool:
    return key.endswith(("_ci_low", "_ci_high"))  # shown inside the accuracy cell


def _grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def eval_table(results: dict[str, dict]) -> str:
    """`vlmrl eval` results ({"T=0.6": evaluate(...) output}) as tables: accuracy, reward, length, reasoning and
    compute metrics per temperature, then the per-task breakdown and the reflection and backtracking ratios."""
    labels = list(results)
    keys = list(dict.fromkeys(k for res in results.values() for k in res["metrics"]
                              if not k.startswith(("task/", *(f"{m}/" for m in MARKER_SETS))) and not _is_interval(k)))
    rows = [[k, *[_metric_cell(k, results[t]["metrics"][k], results[t]["metrics"]) if k in results[t]["metrics"]
                  else "-" for t in labels]] for k in keys]
    out = [_grid(["metric", *labels], rows)]
    tasks = list(dict.fromkeys(t for res in results.values() for t in res.get("per_task", {})))
    if len(tasks) > 1:
        rows = [[t, *[_metric_cell("accuracy", results[label]["per_task"].get(t, {}).get("accuracy"),
                                   results[label]["per_task"].get(t)) for label in labels]] for t in tasks]
        out += ["", _grid(["accuracy per task", *labels], rows)]
    for name in MARKER_SETS:
        rows = [[r, *[_cell(results[t][name]["ratios"][r]) for t in labels]] for r in REFLECTION_RATIOS]
        out += ["", _grid([f"{name} (pooled)", *labels], rows)]
    return "\n".join(out)


def train_table(start: dict, final: dict) -> str:
    """What `vlmrl train` prints after training: held-out accuracy (with its 95% interval), reward and length after
    SFT and after RL; with several tasks in the held-out set, each task's greedy accuracy too, a task that fell by
    more than its interval marked `fell` (vlmrl.eval.regressions)."""
    tasks = task_accuracies(final)
    keys = [k for k in TRAIN_TABLE_KEYS if k in final]
    per_task = [(f"{MODE}/task/{t}/accuracy", t) for t in tasks]
    width = max([22, *(len(k) + 2 for k, _ in per_task)])
    fell = set(fallen_tasks(start, final))
    lines = [f"{'held-out':<{width}}{'after SFT':>22}{'after RL':>22}"]
    for key in keys:
        cells = [_train_cell(run, key) for run in (start, final)]
        lines.append(f"{key:<{width}}{cells[0]:>22}{cells[1]:>22}")
    for key, task in per_task:
        cells = [_train_cell(run, key) for run in (start, final)]
        lines.append(f"{key:<{width}}{cells[0]:>22}{cells[1]:>22}" + ("  fell" if task in fell else ""))
    n = final.get("greedy/n")
    if n:
        each = ", ".join(f"{t} {int(m['n'])}" for t, m in tasks.items() if m["n"] is not None)
        lines.append(f"(accuracy on {int(n)} held-out samples{f' ({each})' if each else ''}, with its 95% interval)")
    return "\n".join(lines)


def _train_cell(metrics: dict, key: str) -> str:
    if "accuracy" in key:
        return format_interval(metrics.get(key), metrics.get(f"{key}_ci_low"), metrics.get(f"{key}_ci_high"))
    return f"{metrics.get(key, float('nan')):6.2f}"


def baselines_table_text(baselines: dict, key: str = "greedy/accuracy") -> str:
    """One run's baselines.json as arms x splits of `key`."""
    splits = {"in-distribution": baselines["in_distribution"], **baselines.get("ood", {})}
    arms = list(dict.fromkeys(a for per in splits.values() for a in per))
    rows = [[ARM_NAMES.get(a, a), *[_metric_cell(key, per.get(a, {}).get(key), per.get(a, {}))
                                    for per in splits.values()]] for a in arms]
    return _grid([key, *splits], rows)


def seeds_table_text(seeds: dict, key: str = "greedy/accuracy") -> str:
    """seeds.json: mean ± std (max) of `key` for each split and arm (or start/final without baselines)."""
    m = seeds["metrics"]
    rows = []
    for name, stats in m.items():
        if name.endswith("/" + key) and stats["mean"] is not None:
            std = f" ± {100 * stats['std']:.1f}" if stats["std"] is not None else ""
            low, high = m.get(f"{name}_ci_low", {}).get("mean"), m.get(f"{name}_ci_high", {}).get("mean")
            ci = f"±{50 * (high - low):.1f}" if low is not None and high is not None else "-"
            rows.append([name[: -len(key) - 1], f"{100 * stats['mean']:.1f}{std}", ci, f"{100 * stats['max']:.1f}"])
    return _grid([f"{key} over seeds {seeds['seeds']}", "mean ± std", "95% CI per run", "max"], rows)
