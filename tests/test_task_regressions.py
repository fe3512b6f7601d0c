"""Per-task learning at a glance: each task's held-out accuracy before and after RL in the table `vlmrl train`
prints, and a task that fell by more than its interval named in a warning at the end of the run (issue 42 item 5)."""

import json
import re
from pathlib import Path

import pytest

import vlmrl.trainer.run as run_module
from vlmrl.cli import main
from vlmrl.eval.metrics import wilson_interval
from vlmrl.eval.regressions import fallen_tasks, fallen_warning, task_accuracies
from vlmrl.eval.tables import train_table

ROOT = Path(__file__).resolve().parents[1]


def task_metrics(counts: dict[str, tuple[int, int]], mode: str = "greedy") -> dict:
    """Flat evaluation metrics as the trainer logs them, from {task: (right, n)} (Wilson intervals, as greedy)."""
    right, n = sum(r for r, _ in counts.values()), sum(k for _, k in counts.values())
    out = {f"{mode}/accuracy": right / n, f"{mode}/n": float(n)}
    out[f"{mode}/accuracy_ci_low"], out[f"{mode}/accuracy_ci_high"] = wilson_interval(right, n)
    for task, (r, k) in counts.items():
        low, high = wilson_interval(r, k)
        out.update({f"{mode}/task/{task}/accuracy": r / k, f"{mode}/task/{task}/accuracy_ci_low": low,
                    f"{mode}/task/{task}/accuracy_ci_high": high, f"{mode}/task/{task}/n": float(k),
                    f"{mode}/task/{task}/reward/accuracy": r / k})  # a component named like the metric
    return out


def test_a_task_falls_when_its_after_rl_upper_bound_is_below_its_start():
    # Wilson's upper bound at 0/200 is z^2 / (200 + z^2) = 3.8415 / 203.84 = 1.88%: a start of 10/200 = 5% fell,
    # a start of 3/200 = 1.5% is inside it. At 86/200 = 43% the upper bound is 49.9% (a start of 50% fell); at
    # 88/200 = 44% it is 50.9% (it did not).
    start = task_metrics({"box": (10, 200), "count": (3, 200), "color": (100, 200), "shape": (100, 200)})
    final = task_metrics({"box": (0, 200), "count": (0, 200), "color": (86, 200), "shape": (88, 200)})
    assert task_accuracies(final)["color"] == pytest.approx(
        {"accuracy": 0.43, "low": 0.3633, "high": 0.4993, "n": 200.0}, abs=1e-4)
    assert list(task_accuracies(final)) == ["box", "count", "color", "shape"]  # not 'box/reward'
    assert fallen_tasks(start, final) == ["box", "color"]
    warning = fallen_warning(start, final)
    assert warning.startswith("tasks box, color fell during RL")
    assert "box 5.0% [2.7, 9.0] -> 0.0% [0.0, 1.9]" in warning and "color 50.0% [43.1, 56.9] -> 43.0%" in warning
    # a task that rose or stayed, one missing before RL, and a held-out set of one task: no warning
    assert fallen_warning(final, start) is None
    assert fallen_tasks(task_metrics({"box": (10, 200)}), task_metrics({"box": (0, 200), "new": (0, 9)})) == ["box"]
    one = {"greedy/accuracy": 0.5, "greedy/accuracy_ci_low": 0.4, "greedy/accuracy_ci_high": 0.6}
    assert task_accuracies(one) == {} and fallen_warning(one, {**one, "greedy/accuracy": 0.0}) is None


def readme_table() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"```text\n(held-out .*?)\n```", text, re.S).group(1)


def test_a_single_task_run_prints_the_readme_table_unchanged():
    """The quickstart's held-out set is one task: its per-task accuracy adds no line to the table README.md quotes."""
    run = json.loads((ROOT / "benchmarks/results/quickstart_readme.json").read_text())
    start, final = ({**m, "greedy/task/shapes_count/reward/accuracy": m["greedy/accuracy"]}
                    for m in (run["start"], run["final"]))
    assert train_table(start, final) == readme_table()


def test_several_tasks_add_one_line_each_and_mark_the_one_that_fell():
    start = task_metrics({"shapes_box": (10, 200), "shapes_count": (60, 200)})
    final = task_metrics({"shapes_box": (0, 200), "shapes_count": (150, 200)})
    lines = train_table(start, final).splitlines()
    assert lines[0] == f"{'held-out':<35}{'after SFT':>22}{'after RL':>22}"  # widened for the longest key
    box, count = lines[2], lines[3]
    assert box.startswith("greedy/task/shapes_box/accuracy") and box.endswith("0.0% [0.0, 1.9]  fell")
    assert count.startswith("greedy/task/shapes_count/accuracy") and count.endswith("75.0% [68.6, 80.5]")
    assert lines[-1] == "(accuracy on 400 held-out samples (shapes_box 200, shapes_count 200), with its 95% interval)"


SMALL = ["model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64", "model.tiny.vision_depth=1",
         "model.tiny.vision_dim=32", "model.tiny.vision_heads=2", "model.tiny.vocab_size=400",
         "model.tiny.min_pixels=3136", "model.tiny.max_pixels=7056", "data.train.n=20", "data.sft.n=8",
         "data.eval=[{task: shapes_count, n: 4}, {task: shapes_color, n: 4}]", "sft.steps=1", "sft.batch_size=4",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=11", "eval.max_new_tokens=11",
         "trainer.eval_every=0", "trainer.threads=1", "trainer.steps=1"]


def test_vlmrl_train_ends_with_a_warning_naming_the_task_that_fell(tmp_path, monkeypatch, capsys):
    """A real (tiny) run whose held-out evaluation is forced: shapes_color 4/4 after SFT, 0/4 after RL."""
    real_eval = run_module.run_eval

    def forced(policy, cfg, samples, rewards, progress, label, *args, **kwargs):
        out = real_eval(policy, cfg, samples, rewards, progress, label, *args, **kwargs)
        right = 4 if label == "after SFT" else 0
        low, high = wilson_interval(right, 4)
        key = "greedy/task/shapes_color/accuracy"
        out.update({key: right / 4, f"{key}_ci_low": low, f"{key}_ci_high": high})
        return out

    monkeypatch.setattr(run_module, "run_eval", forced)
    run = tmp_path / "run"
    assert main(["train", *SMALL, f"trainer.output_dir={run}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    color = next(line for line in lines if line.startswith("greedy/task/shapes_color/accuracy"))
    assert color.endswith("0.0% [0.0, 49.0]  fell")
    assert any(line.startswith("greedy/task/shapes_count/accuracy") for line in lines)
    assert lines[-1].startswith("warning: task shapes_color fell during RL")  # the run's last line
    assert "shapes_color 100.0% [51.0, 100.0] -> 0.0% [0.0, 49.0]" in lines[-1]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["fallen_tasks"] for r in rows if r["phase"] == "summary"] == [["shapes_color"]]  # logged too
