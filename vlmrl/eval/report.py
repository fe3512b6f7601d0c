"""`vlmrl report RUN_DIR [RUN_DIR ...]`: a self-contained HTML page (index.html + PNGs in one folder) that shows
how a model learned: a before/after table, the start/RL/control table on in-distribution and OOD splits, learning
curves with seed bands, pass@k, reasoning and compute, reflection and backtracking ratios, the worst tasks of the final
evaluation with their samples (RUN_DIR/eval_samples.jsonl), and a rollout gallery from early, middle and late steps.

Images are files beside index.html, referenced by relative paths, so the folder can be zipped or served as is.
"""

from __future__ import annotations

import html
import os
import shutil
from pathlib import Path

from vlmrl.eval import plots
from vlmrl.eval.metrics import marker_sets
from vlmrl.eval.runs import Run, discover, load_run, mean_std
from vlmrl.eval.samples import EVAL_SAMPLES, read_samples, worst_tasks

REFLECTION_RATIOS = ("share", "share_correct", "share_incorrect", "accuracy_reflective", "accuracy_nonreflective")
MARKER_SETS = tuple(marker_sets())  # reflection, backtracking: each with the five ratios above
REASONING_KEYS = ("reasoning/length", "reasoning/block_share", "tokens_per_correct", "backtracking/share",
                  "compute/seconds_per_1k_rollouts", "compute/gpu_seconds_per_1k_rollouts")
ARM_NAMES = {"start": "start (after SFT)", "rl": "RL", "control_sft": "SFT control (same wall time)"}
WORST_TASKS, SAMPLES_PER_TASK = 3, 4


def fmt(mean: float | None, std: float | None = None, pct: bool = True) -> str:
    """'63.3 ± 2.1' (percent) or 'undefined' when there is no value."""
    if mean is None:
        return "undefined"
    scale, digits = (100.0, 1) if pct else (1.0, 2)
    value = scale * mean
    text = f"{value if abs(value) >= 0.5 * 10 ** -digits else 0.0:.{digits}f}"  # no "-0.00"
    return text + (f" ± {scale * std:.{digits}f}" if std is not None else "")


def is_rate(key: str) -> bool:
    """Whether a metric is a share (shown in percent): not a count, length, reward, time or tokens-per-answer."""
    parts = key.split("/")
    if "reward" in parts[:-1] or "compute" in parts or parts[-1] == "n" or "tool/failures" in key \
            or "agent/ended" in key:
        return False
    return not key.endswith(("mean_length", "samples_per_prompt", "mean_reward", "reward_failed_samples",
                             "tokens_per_correct", "reasoning/length", "_per_episode"))


def before_after(runs: list[Run], keys: list[str] | None = None) -> list[tuple[str, str, str, str]]:
    """Rows (metric, start, final, change) from each run's first and last eval rows, mean ± std over seeds. `keys`
    default: the accuracy, reward and length metrics (greedy/ and sampled/), reflection/share."""
    firsts = [r.evals()[0] for r in runs if r.evals()]
    lasts = [r.evals()[-1] for r in runs if r.evals()]
    if not firsts:
        return []
    if keys is None:  # pass@1 and mean@n equal accuracy, so they are not repeated; the reasoning rows have their own
        keys = [k for k in firsts[0] if k.startswith(("greedy/", "sampled/")) and "/task/" not in k
                and not k.endswith(("/n", "samples_per_prompt", "/pass@1", "/failures", "_ci_low", "_ci_high"))
                and not any(f"/{m}/" in k for m in MARKER_SETS) and "/mean@" not in k
                and not k.split("/", 1)[1].startswith(REASONING_KEYS + ("reasoning/",))]
        keys += [k for k in firsts[0] if k.endswith("reflection/share")]
    rows = []
    for key in keys:
        pct = is_rate(key)
        a = [f.get(key) for f in firsts]
        b = [f.get(key) for f in lasts]
        diff = [y - x for x, y in zip(a, b, strict=True) if x is not None and y is not None]
        ds = mean_std(diff)
        change = fmt(*ds, pct=pct)
        rows.append((key, fmt(*mean_std(a), pct=pct) + interval_note(firsts, key),
                     fmt(*mean_std(b), pct=pct) + interval_note(lasts, key),
                     ("+" if ds[0] is not None and ds[0] > 0 else "") + change))
    return rows


def interval_note(evals: list[dict], key: str) -> str:
    """The 95% interval of an accuracy next to its value: ' [62.0, 69.4]' for one run; for several, the mean
    half-width of the runs' own intervals (' (95% CI ±3.7 per run)'), beside the spread over seeds; '' without one."""
    lows, highs = [e.get(f"{key}_ci_low") for e in evals], [e.get(f"{key}_ci_high") for e in evals]
    if not evals or any(v is None for v in lows + highs):
        return ""
    if len(evals) == 1:
        return f" [{100 * lows[0]:.1f}, {100 * highs[0]:.1f}]"
    half = sum(h - lo for lo, h in zip(lows, highs, strict=True)) / (2 * len(evals))
    return f" (95% CI ±{100 * half:.1f} per run)"


def reasoning_rows(runs: list[Run]) -> list[tuple[str, str, str, str]]:
    """before_after rows of the reasoning-chain, token-efficiency, backtracking and compute metrics."""
    firsts = [r.evals()[0] for r in runs if r.evals()]
    keys = [f"{mode}/{k}" for mode in ("greedy", "sampled") for k in REASONING_KEYS]
    return before_after(runs, [k for k in keys if firsts and k in firsts[0]])


def baseline_splits(runs: list[Run]) -> dict[str, list[dict]]:
    """split -> one {arm: metrics} per run that has baselines.json (in-distribution first, then the OOD sets)."""
    with_b = [r.baselines for r in runs if r.baselines]
    if not with_b:
        return {}
    splits = {"in-distribution": [b["in_distribution"] for b in with_b]}
    for name in with_b[0].get("ood", {}):
        splits[name] = [b["ood"].get(name, {}) for b in with_b]
    return splits


def baselines_table(runs: list[Run], key: str = "greedy/accuracy") -> dict[str, dict[str, tuple]]:
    """split -> arm -> (mean, std) of `key` over the runs that have baselines.json."""
    table: dict[str, dict[str, tuple]] = {}
    for split, per_run in baseline_splits(runs).items():
        arms = list(dict.fromkeys(a for arms in per_run for a in arms))
        table[split] = {a: mean_std([arms.get(a, {}).get(key) for arms in per_run]) for a in arms}
    return table


def baselines_notes(runs: list[Run], key: str = "greedy/accuracy") -> dict[str, dict[str, str]]:
    """split -> arm -> the 95% interval note of `key` (interval_note) over the runs that have baselines.json."""
    return {split: {a: interval_note([arms.get(a, {}) for arms in per_run], key)
                    for a in dict.fromkeys(a for arms in per_run for a in arms)}
            for split, per_run in baseline_splits(runs).items()}


def _table(header: list[str], rows: list[tuple], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def gallery_entries(run: Run) -> list[tuple[str, dict]]:
    """The first, middle and last rollout-gallery entries of a run, labelled early / middle / late."""
    entries = sorted(run.rollouts, key=lambda e: e.get("step", 0))
    if not entries:
        return []
    picks = {"early": 0, "middle": len(entries) // 2, "late": len(entries) - 1}
    seen, out = set(), []
    for label, i in picks.items():
        if i not in seen:
            seen.add(i)
            out.append((label, entries[i]))
    return out


def feedback_text(component: str, detail) -> str:
    """One answer's reward details as a line: a judge's verdict, score and reasons, or its error; else as text."""
    if detail is None:
        return ""
    if isinstance(detail, dict):
        if detail.get("skipped"):
            return f"{component}: skipped ({detail['skipped']})"
        reasons = detail.get("reasons") or []
        bits = [str(detail[k]) for k in ("verdict", "score") if detail.get(k) is not None]
        bits += [str(r) for r in (reasons if isinstance(reasons, list) else [reasons])]
        if detail.get("error"):
            bits.append(f"error: {detail['error']}")
        return f"{component}: " + " · ".join(bits) if bits else ""
    return f"{component}: {detail}"


def _image(run: Run, ref, out: Path, folder: str, name: str, alt: str) -> str:
    """An <img> of `ref` (a path relative to the run directory, or absolute) copied into out/folder; "" if missing."""
    if not isinstance(ref, str) or not (run.path / ref).exists():
        return ""
    rel = Path(folder) / f"{name}{Path(ref).suffix or '.png'}"
    (out / folder).mkdir(exist_ok=True)
    shutil.copyfile(run.path / ref, out / rel)
    return f'<img class="scene" src="{rel.as_posix()}" alt="{html.escape(alt)}">'


def answers_table(answers: list[dict], notes: bool = False) -> str:
    """Sampled answers ({"text", "correct", "reward", "components": {name: value}, "note"}) as a table with ✓/✗."""
    rows = []
    for a in answers:
        ok, reward = a.get("correct"), a.get("reward")
        mark = {True: "✓", False: "✗"}.get(ok, "")
        parts = ", ".join(f"{k} {v:.2f}" if isinstance(v, (int, float)) else f"{k} n/a"
                          for k, v in (a.get("components") or {}).items())
        rows.append(f'<tr class="{"ok" if ok else "bad" if ok is False else ""}"><td class="mark">{mark}</td>'
                    f"<td><code>{html.escape(a['text']) or '<em>(empty)</em>'}</code></td>"
                    f"<td>{f'{reward:.2f}' if isinstance(reward, (int, float)) else 'failed'}</td>"
                    f"<td>{html.escape(parts)}</td>" + (f"<td>{html.escape(a.get('note', ''))}</td>" if notes else "")
                    + "</tr>")
    return ("<table class='answers'><thead><tr><th></th><th>sampled answer</th><th>reward</th><th>components</th>"
            + ("<th>reward details (judge feedback)</th>" if notes else "")
            + f"</tr></thead><tbody>{''.join(rows)}</tbody></table>")


def _card(title: str, img: str, problem, solution, answers: str, anchor: str = "") -> str:
    anchor = f' id="{anchor}"' if anchor else ""
    return (f'<div class="card"{anchor}><h3>{html.escape(title)}</h3>'
            f'<div class="card-body">{img}<div><p><b>Question:</b> {html.escape(str(problem))}<br><b>Solution:</b> '
            f"<code>{html.escape(str(solution))}</code></p>{answers}</div></div></div>")


def gallery_html(run: Run, out: Path) -> str:
    cards = []
    for label, e in gallery_entries(run):
        img = _image(run, e.get("image"), out, "gallery", f"{run.name}-{Path(str(e.get('image'))).stem}",
                     f"image of {e.get('id', '')}")
        correct = e.get("correct") or []
        answers = [{"text": text, "reward": reward, "correct": correct[j] if j < len(correct) else None,
                    "components": {k: vs[j] for k, vs in (e.get("components") or {}).items()},
                    "note": "; ".join(filter(None, (feedback_text(k, v[j]) for k, v in (e.get("details") or {}).items()
                                                    if j < len(v))))}
                   for j, (text, reward) in enumerate(zip(e.get("answers", []), e.get("rewards", []), strict=False))]
        table = answers_table(answers, notes=bool(e.get("details"))) + turns_html(run, e, out)
        cards.append(_card(f"{label}: step {e.get('step')}", img, e.get("problem", ""), e.get("solution", ""), table))
    if not cards:
        return "<p>No rollout gallery in this run (trainer.log_rollouts_every = 0).</p>"
    return f"<p>Sampled answers for one training prompt, from run <code>{html.escape(run.name)}</code>.</p>" + \
        "".join(cards)


def turns_html(run: Run, entry: dict, out: Path, answers: int = 2) -> str:
    """The first `answers` episodes of a multi-turn gallery entry: each turn's message, its tool calls and failures,
    whether its call looked at the target (where the environment knows one) and the images the tools returned ("" for
    a single-turn entry)."""
    parts = []
    for a, episode in enumerate((entry.get("turns") or [])[:answers]):
        rows = []
        for i, t in enumerate(episode):
            calls = ", ".join(t.get("tool_calls") or []) or "none"
            errors = f" (failed: {', '.join(t['errors'])})" if t.get("errors") else ""
            if "on_target" in t:  # the environment's word on where the call looked (the zoom task)
                errors += " · on target" if t["on_target"] else " · off target"
            imgs = "".join(_image(run, ref, out, "gallery", f"{run.name}-{Path(str(ref)).stem}",
                                  f"tool image, answer {a + 1}, turn {i + 1}") for ref in t.get("images") or [])
            rows.append(f"<li>turn {i + 1}: <code>{html.escape(str(t.get('text', '')))}</code> "
                        f"&middot; tools: {html.escape(calls)}{html.escape(errors)}<br>{imgs}</li>")
        parts.append(f"<p><b>Episode of answer {a + 1}</b></p><ol>{''.join(rows)}</ol>")
    return "".join(parts)


def task_anchor(task: str) -> str:
    return "samples-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in task)


def worst_tasks_html(runs: list[Run], out: Path) -> str:
    """The final evaluation's worst tasks (lowest accuracy, from RUN_DIR/eval_samples.jsonl), each linked to its
    least accurate samples: image, question, solution and every answer with its reward and components."""
    run = next((r for r in runs if (r.path / EVAL_SAMPLES).exists()), None)
    if run is None:
        return (f"<p>No {EVAL_SAMPLES} in this run (a training run writes it at its final evaluation; "
                f"<code>vlmrl eval CKPT --samples-out RUN_DIR/{EVAL_SAMPLES}</code> writes one).</p>")
    lines = read_samples(run.path / EVAL_SAMPLES)
    worst = worst_tasks(lines, WORST_TASKS)
    if not worst:
        return f"<p>{EVAL_SAMPLES} of run <code>{html.escape(run.name)}</code> is empty.</p>"
    temperature, step = worst[0][2][0]["temperature"], worst[0][2][0].get("step")
    rows = "".join(f'<tr><td><a href="#{task_anchor(t)}">{html.escape(t or "(no task)")}</a></td><td>{fmt(acc)}</td>'
                   f"<td>{len(ls)}</td></tr>" for t, acc, ls in worst)
    cards = []
    for t, _, ls in worst:
        for i, line in enumerate(ls[:SAMPLES_PER_TASK]):
            img = "".join(_image(run, ref, out, "samples", f"{run.name}-{task_anchor(t)}-{i}-{j}",
                                 f"image of {line['id']}") for j, ref in enumerate(line["images"][:1]))
            cards.append(_card(f"{t or '(no task)'}: sample {line['id']} ({fmt(line['accuracy'])} right)", img,
                               line["problem"], line["solution"], answers_table(line["answers"]),
                               task_anchor(t) if i == 0 else ""))
    return (f"<p class='note'>Final evaluation of run <code>{html.escape(run.name)}</code>"
            + (f" at step {step}" if step is not None else "") + f", temperature {temperature}: the "
            + (f"{len(worst)} tasks" if len(worst) > 1 else "task") + " with the lowest accuracy, linked to at most "
            f"{SAMPLES_PER_TASK} of its samples, the least accurate first (all samples: {EVAL_SAMPLES}).</p><table><thead><tr><th>task</th><th>accuracy</th><th>samples</th>"
            f"</tr></thead><tbody>{rows}</tbody></table>" + "".join(cards))


def reflection_rows(runs: list[Run], name: str = "reflection") -> list[tuple[str, str, str]]:
    """(ratio, start, final) of marker set `name` (reflection, backtracking) in the sampled evaluations."""
    firsts = [r.evals()[0] for r in runs if r.evals()]
    lasts = [r.evals()[-1] for r in runs if r.evals()]
    rows = []
    for ratio in REFLECTION_RATIOS:
        key = f"sampled/{name}/{ratio}"
        if firsts and key in firsts[0]:
            rows.append((ratio, fmt(*mean_std([f.get(key) for f in firsts])),
                         fmt(*mean_std([f.get(key) for f in lasts]))))
    return rows


def run_info(runs: list[Run]) -> list[tuple[str, str]]:
    cfg = runs[0].config
    g = lambda *path: _get(cfg, path)  # noqa: E731
    train = g("data", "train")
    task = train.get("task") or train.get("path") if isinstance(train, dict) else str(train)
    walls = [r.series("summary", "wall_seconds") for r in runs]
    wall = [next(iter(w.values())) for w in walls if w]
    rows = [("runs", ", ".join(r.name for r in runs)), ("seeds", ", ".join(str(_get(r.config, ("trainer", "seed")))
                                                                          for r in runs)),
            ("model", str(g("model", "name_or_path"))), ("training data", str(task)),
            ("algorithm", f"{g('algorithm', 'advantage')} advantages, {g('algorithm', 'policy_loss')} loss"),
            ("rollout", f"{g('rollout', 'prompts_per_step')} prompts × G={g('rollout', 'group_size')} answers, "
                        f"temperature {g('rollout', 'temperature')}"),
            ("RL steps, lr", f"{g('trainer', 'steps')}, {g('trainer', 'lr')}")]
    if wall:
        m, sd = mean_std(wall)
        rows.append(("wall time per run", f"{m:.0f} s" + (f" ± {sd:.0f}" if sd is not None else "")))
    for key, label in (("compute/seconds_per_1k_rollouts", "RL step time per 1,000 rollouts"),
                       ("compute/gpu_seconds_per_1k_rollouts", "GPU time per 1,000 rollouts")):
        m, sd = mean_std([v for r in runs for v in r.series("train", key).values()])
        if m is not None:
            rows.append((label, f"{m:.1f} {'GPU-' if 'gpu' in key else ''}s" + (f" ± {sd:.1f}" if sd else "")
                         + " (mean ± std over steps)"))
    return rows


def _get(cfg: dict, path: tuple):
    for p in path:
        cfg = cfg.get(p, {}) if isinstance(cfg, dict) else {}
    return cfg if cfg != {} else "?"


STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:24px auto;padding:0 16px;color:#222}
h1{margin-bottom:4px}h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;font-size:14px}
th{background:#f5f5f5}img.plot{max-width:100%;border:1px solid #eee;margin:6px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;margin:12px 0}.card-body{display:flex;gap:16px}
img.scene{width:168px;height:168px;image-rendering:pixelated;border:1px solid #ccc;flex:none}
tr.ok td.mark{color:#080}tr.bad td.mark{color:#c00}.answers td{font-size:13px}code{font-size:13px}
img.broken{outline:3px solid red}.note{color:#555;font-size:13px}"""

SCRIPT = """<script>
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; });
  imgs.forEach(function (i) { if (ok.indexOf(i) < 0) { i.classList.add('broken'); } });
  document.body.setAttribute('data-images-loaded', ok.length + '/' + imgs.length);
});
</script>"""


def write_report(paths: list[str | Path], out: str | Path | None = None) -> Path:
    """Write `out/index.html` (default: RUN_DIR/report, or the common parent's report/ for several runs) with its
    PNGs; returns the path of index.html."""
    run_dirs = discover(paths)
    runs = [load_run(p) for p in run_dirs]
    if out is None:
        out = Path(paths[0]) / "report" if len(paths) == 1 else Path(os.path.commonpath(run_dirs)) / "report"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = [(plots.eval_curves(runs, out), "Held-out accuracy against generation steps. Band: min to max over "
                "seeds. The SFT control's evaluations sit at the RL step with the same share of the wall-time "
                "budget."),
               (plots.pass_at_k_plot(runs, out), "pass@k (unbiased estimator over n samples per prompt) at the "
                "start and at the end of RL; error bars: std over seeds."),
               (plots.proxy_gold_plot(runs, out), "A learned reward (the proxy) and held-out accuracy (the gold) at "
                "every evaluation of a run trained against the learned reward: the proxy rising while the gold falls "
                "is the policy learning to please the reward (docs/rewards.md, \"Watching for reward hacking\")."),
               (plots.train_curves(runs, out), "Training metrics at every generation step.")]
    btable = baselines_table(runs)
    bplot = plots.baselines_plot(btable, out)
    title = f"vlmrl report: {', '.join(r.name for r in runs[:4])}{' ...' if len(runs) > 4 else ''}"
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             '<section id="summary"><h2>Run</h2>' + _table(["setting", "value"], run_info(runs)) + "</section>"]
    ba = before_after(runs)
    seeds_note = f" Mean ± std over {len(runs)} seeds." if len(runs) > 1 else ""
    parts.append('<section id="before-after"><h2>Before and after RL</h2><p class="note">Held-out set, first and '
                 f"last evaluation of each run (greedy = temperature 0).{seeds_note}</p>"
                 + (_table(["metric", "after SFT (start)", "after RL", "change"], ba) if ba else "<p>No evaluations"
                    " logged.</p>") + "</section>")
    if btable:
        splits = list(btable)
        arms = list(dict.fromkeys(a for s in splits for a in btable[s]))
        notes = baselines_notes(runs)
        rows = [(ARM_NAMES.get(a, a), *[fmt(*btable[s].get(a, (None, None))) + notes[s].get(a, "") for s in splits])
                for a in arms]
        parts.append('<section id="baselines"><h2>What RL adds beyond more training</h2><p class="note">Greedy '
                     "accuracy of the SFT start, the RL run, and continued SFT from the same start on the same "
                     f"labelled data for the same training wall time, in-distribution and out of distribution."
                     f"{seeds_note}</p>" + _table(["", *splits], rows)
                     + (f'<img class="plot" src="{bplot.name}" alt="baselines">' if bplot else "") + "</section>")
    parts.append('<section id="curves"><h2>Learning curves</h2>')
    for fig, caption in figures:
        if fig is not None:
            parts.append(f'<figure><img class="plot" src="{fig.name}" alt="{fig.stem}"><figcaption class="note">'
                         f"{html.escape(caption)}</figcaption></figure>")
    parts.append("</section>")
    reasoning = reasoning_rows(runs)
    if reasoning:
        parts.append('<section id="reasoning"><h2>Reasoning and compute</h2><p class="note">Held-out set, first and '
                     "last evaluation: tokens inside the reasoning block (answers that have one), the share of "
                     "answers with one, generated tokens per correct answer, the share of answers with a "
                     "backtracking marker, and the evaluation's seconds per 1,000 answers. <i>undefined</i>: no "
                     f"answer to average over.{seeds_note}</p>"
                     + _table(["metric", "after SFT (start)", "after RL", "change"], reasoning) + "</section>")
    markers = {name: reflection_rows(runs, name) for name in MARKER_SETS}
    if any(markers.values()):
        parts.append('<section id="reflection"><h2>Reflection and backtracking</h2><p class="note">Answers holding a '
                     "reflection word, and answers holding a backtracking marker (matched on word boundaries), "
                     "sampled evaluation, from pooled counts. <i>undefined</i>: the ratio's denominator is empty.</p>"
                     + "".join(f"<h3>{name}</h3>" + _table(["ratio", "after SFT (start)", "after RL"], rows)
                               for name, rows in markers.items() if rows) + "</section>")
    parts.append('<section id="worst-tasks"><h2>Worst tasks and their answers</h2>' + worst_tasks_html(runs, out)
                 + "</section>")
    parts.append('<section id="gallery"><h2>Rollout gallery</h2>' + gallery_html(runs[0], out) + "</section>")
    parts.append(SCRIPT + "</body></html>")
    index = out / "index.html"
    index.write_text("\n".join(parts), encoding="utf-8")
    return index
