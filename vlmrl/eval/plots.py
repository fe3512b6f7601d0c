"""PNG plots for the report (matplotlib, Agg backend): learning curves with seed bands, pass@k, baselines."""

from __future__ import annotations

from pathlib import Path

from vlmrl.eval.runs import Run, band, mean_std, smooth


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("vlmrl report needs matplotlib: pip install 'vlmrl[report]' (or pip install matplotlib)") \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLORS = {"rl": "#1f77b4", "start": "#7f7f7f", "control_sft": "#d62728", "greedy": "#1f77b4", "sampled": "#ff7f0e"}


def _draw_band(ax, series: list[dict[int, float]], label: str, color: str, window: int = 1, style: str = "-"):
    steps, mean, lo, hi = band(series)
    if not steps:
        return False
    _, mean = smooth(steps, mean, window)
    ax.plot(steps, mean, style, color=color, label=label + (f" (mean of {len(series)} seeds)" if len(series) > 1
                                                            else ""), lw=1.8)
    if len(series) > 1:
        _, lo = smooth(steps, lo, window)
        _, hi = smooth(steps, hi, window)
        ax.fill_between(steps, lo, hi, color=color, alpha=0.18, lw=0)
    return True


def eval_curves(runs: list[Run], out: Path) -> Path | None:
    """Held-out accuracy (greedy and sampled) against generation steps, seed band = min..max over seeds; the SFT
    control's accuracy on the same axis (matched wall time) when it exists."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    drawn = False
    for mode in ("greedy", "sampled"):
        drawn |= _draw_band(ax, [r.series("eval", f"{mode}/accuracy") for r in runs], f"RL, {mode}", COLORS[mode])
    controls = [{row["step"]: row["greedy/accuracy"] for row in r.control_rows if row["phase"] == "eval"
                 and "greedy/accuracy" in row} for r in runs if r.control_rows]
    if controls:
        _draw_band(ax, controls, "SFT control (same wall time), greedy", COLORS["control_sft"], style="--")
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("generation step (control: RL-step equivalent of its wall time)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title("Held-out accuracy during training")
    return _save(fig, out / "eval_accuracy.png")


LEARNED = ("reward_model", "judge")  # the learned rewards a run can be gamed through (the gold: greedy/accuracy)


def window_mean(series: dict[int, float], after: int, upto: int) -> float:
    """The mean of `series` over steps in (after, upto]; the last value at or before `upto` when there is none."""
    values = [v for s, v in series.items() if after < s <= upto]
    if values:
        return sum(values) / len(values)
    earlier = [s for s in series if s <= upto]
    return series[max(earlier)] if earlier else 0.0


def proxy_gold_plot(runs: list[Run], out: Path) -> Path | None:
    """The over-optimisation picture (Gao et al. 2023): each run's held-out learned reward (the proxy, right axis)
    and held-out accuracy (the gold, left axis) at every evaluation, against the step and, where the run logged `kl`
    (a reference was loaded), against the KL from the start (the mean `kl` of the train steps since the last
    evaluation). None when no run trained against a learned reward."""
    rows = []
    for r in runs:
        for name in LEARNED:
            proxy = r.series("eval", f"greedy/reward/{name}")
            if len(proxy) > 1:
                rows.append((r, name, proxy, r.series("eval", "greedy/accuracy"), r.series("train", "kl")))
    if not rows:
        return None
    plt = _pyplot()
    with_kl = any(kl for *_, kl in rows)
    fig, axes = plt.subplots(1, 2 if with_kl else 1, figsize=(11 if with_kl else 6.5, 4.0), squeeze=False)
    for col, against in enumerate(["step", "kl"] if with_kl else ["step"]):
        ax = axes[0][col]
        twin = ax.twinx()
        for k, (run, name, proxy, gold, kl) in enumerate(rows):
            steps = sorted(set(proxy) & set(gold))
            if against == "kl":
                if not kl:
                    continue
                x = [window_mean(kl, before, step) for before, step in zip([-1, *steps[:-1]], steps, strict=True)]
            else:
                x = steps
            label = run.name if len(rows) > 1 else ""
            ax.plot(x, [gold[s] for s in steps], "o-", color=f"C{2 * k}", lw=1.6, label=f"gold: accuracy {label}")
            twin.plot(x, [proxy[s] for s in steps], "s--", color=f"C{2 * k + 1}", lw=1.6,
                      label=f"proxy: {name} {label}")
        ax.set_xlabel("generation step" if against == "step" else "mean per-token KL from the start (train steps)")
        ax.set_ylabel("held-out accuracy (gold)")
        twin.set_ylabel("held-out learned reward (proxy)")
        ax.grid(alpha=0.3)
        lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(lines, [h.get_label() for h in lines], fontsize=8, loc="best")
    fig.suptitle("Proxy and gold: the learned reward against held-out accuracy")
    return _save(fig, out / "proxy_gold.png")


TRAIN_PANELS = [("accuracy", "train accuracy"), ("reward/total/mean", "reward (total)"),
                ("response_length", "answer length (tokens)"), ("entropy", "entropy"),
                ("clip_fraction", "clip fraction"), ("zero_variance_groups", "zero-variance groups"),
                ("kl", "KL to reference"), ("truncated_share", "share hitting the length limit"),
                ("reasoning/length", "reasoning length (tokens)"), ("tokens_per_correct", "tokens per correct answer"),
                ("backtracking/share", "share of answers backtracking")]


def train_curves(runs: list[Run], out: Path) -> Path | None:
    """Per-step training metrics (moving average), one panel each, seed band = min..max over seeds; one panel per
    reward component too."""
    plt = _pyplot()
    keys = {k for r in runs for row in r.rows if row["phase"] == "train" for k in row}
    keys = {k for k in keys if any(r.series("train", k) for r in runs)}  # a value at some step, not only undefined
    components = sorted(k for k in keys if k.startswith("reward/") and k.endswith("/mean") and k != "reward/total/mean")
    panels = [(k, t) for k, t in TRAIN_PANELS if k in keys] + [(k, k[7:-5] + " reward") for k in components]
    if not panels:
        return None
    cols = 3
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(11, 2.8 * rows_n), squeeze=False)
    n_steps = max(len(r.series("train", panels[0][0])) for r in runs)
    window = max(1, n_steps // 40)
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        _draw_band(ax, [r.series("train", key) for r in runs], title, COLORS["rl"], window)
        ax.set_title(title + (f" (moving average of {window})" if window > 1 else ""), fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.supxlabel("generation step", fontsize=9)
    return _save(fig, out / "train_curves.png")


def pass_at_k_plot(runs: list[Run], out: Path) -> Path | None:
    """pass@k against k (log scale) for the start and the end of RL, mean over seeds."""
    plt = _pyplot()
    first, last = [r.evals()[0] for r in runs if r.evals()], [r.evals()[-1] for r in runs if r.evals()]
    ks = sorted({int(k.split("@")[1]) for row in first + last for k in row if k.startswith("sampled/pass@")})
    if len(ks) < 2:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for rows, label, color in ((first, "after SFT (start)", COLORS["start"]), (last, "after RL", COLORS["rl"])):
        stats = [mean_std([r.get(f"sampled/pass@{k}") for r in rows]) for k in ks]
        ax.errorbar(ks, [m for m, _ in stats], yerr=[s or 0.0 for _, s in stats], marker="o", color=color,
                    label=label, capsize=3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (unbiased)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("pass@k before and after RL")
    return _save(fig, out / "pass_at_k.png")


def baselines_plot(table: dict[str, dict[str, tuple]], out: Path) -> Path | None:
    """Grouped bars: greedy accuracy per split (in-distribution, OOD...) for each arm, error bars = std over seeds.
    `table[split][arm] = (mean, std)`."""
    if not table:
        return None
    plt = _pyplot()
    splits = list(table)
    arms = list(dict.fromkeys(a for s in splits for a in table[s]))
    fig, ax = plt.subplots(figsize=(1.8 + 2.2 * len(splits), 3.8))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(splits))]
        means = [(table[s].get(arm) or (None, None))[0] for s in splits]
        stds = [(table[s].get(arm) or (None, None))[1] for s in splits]
        yerr = [x or 0.0 for x in stds] if any(x is not None for x in stds) else None  # one seed: no error bars
        ax.bar(xs, [m if m is not None else 0.0 for m in means], width, yerr=yerr, capsize=3, label=arm,
               color=COLORS.get(arm))
    ax.set_xticks(range(len(splits)), splits)
    ax.set_ylabel("greedy accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    ax.set_title("Start, RL and the matched-compute control")
    return _save(fig, out / "baselines.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
