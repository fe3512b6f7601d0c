"""Every answer type in the data has a weighted reward that grades it (issue 42, item 2): refused up front when not,
and counted per task during training."""

import json
import re

import pytest

from vlmrl.cli import main
from vlmrl.config import ConfigError, load_config
from vlmrl.data import build_dataset
from vlmrl.rewards import RewardSpec, compute_rewards
from vlmrl.rewards.coverage import check_coverage
from vlmrl.trainer.run import Progress, train

SMALL = ["trainer.threads=1", "model.tiny.hidden_size=32", "model.tiny.num_layers=1", "model.tiny.num_heads=2",
         "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=64", "model.tiny.vision_depth=1",
         "model.tiny.vision_dim=32", "model.tiny.vision_heads=2", "model.tiny.vocab_size=400",
         "model.tiny.min_pixels=3136", "model.tiny.max_pixels=7056", "model.image_cache_mb=16", "sft.steps=2",
         "sft.batch_size=4", "rollout.prompts_per_step=3", "rollout.group_size=2", "algorithm.max_resample_rounds=1",
         "trainer.eval_every=0", "eval.batch_size=16"]
TASKS = ("shapes_count", "shapes_color", "shapes_box")  # number, word and box answers


def mixed_file(tmp_path, n: int = 4) -> str:
    """A user JSONL (with its PNGs) mixing number, word and box answers, each row naming its task."""
    rows = []
    for task in TASKS:
        assert main(["data", "export", task, "--n", str(n), "--out", str(tmp_path / "data")]) == 0
        rows += (tmp_path / "data" / f"{task}-train.jsonl").read_text().splitlines()
    (tmp_path / "data" / "mixed.jsonl").write_text("\n".join(rows) + "\n")
    return "{path: data/mixed.jsonl}"


@pytest.fixture(scope="module")
def samples():
    return [s for task in TASKS for s in build_dataset({"task": task, "n": 2}, "train", 0)[0]]


def test_a_box_answer_with_no_reward_that_grades_it_is_refused_naming_it(samples):
    with pytest.raises(ConfigError) as err:
        check_coverage([RewardSpec("exact_match"), RewardSpec("length")], samples)
    message = str(err.value)
    assert message.startswith("data.train: 2 of 6 samples have answer_type box (e.g. sample 'shapes_box/train/0' of "
                              "task 'shapes_box', solution '[")
    assert "rewards: exact_match (1), length (1)" in message and "Add {name: iou, weight: 1.0}" in message
    # a shaping reward never counts, nor does a reward with weight 0; iou does, and an undeclared reward may
    with pytest.raises(ConfigError, match="answer_type number"):
        check_coverage([RewardSpec("length"), RewardSpec("accuracy", 0.0), RewardSpec("format")], samples)
    check_coverage([RewardSpec("exact_match"), RewardSpec("iou")], samples)
    check_coverage([RewardSpec("process")], samples)  # registered without a declaration, like a user reward


def test_graded_marks_answers_only_a_shaping_reward_scored():
    out = compute_rewards([RewardSpec("exact_match"), RewardSpec("length", kwargs={"max_length": 12,
                                                                                   "cache_length": 4})],
                          ["<answer>3</answer>", "<answer>[1, 2, 3, 4]</answer>"],
                          {"solution": ["3", "[1, 2, 5, 6]"], "answer_type": ["number", "box"],
                           "completion_lengths": [5, 9]})
    # exact_match gives the box a value, but it does not grade boxes (text against coordinates); length only shapes
    assert out.graded == [True, False] and out.components["exact_match"][1] is not None


def test_a_recipe_with_no_reward_for_the_files_box_answers_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec = mixed_file(tmp_path)
    code = main(["train", f"data.train={spec}", f"data.sft={spec}", f"data.eval={spec}", *SMALL,
                 "rewards=[{name: exact_match}, {name: length}]"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and re.match(r"error: data.train: 4 of 12 samples have answer_type box \(e.g. sample "
                                  r"'shapes_box/train/0' of task 'shapes_box'", err), err
    assert "Add {name: iou, weight: 1.0} to rewards" in err
    assert not (tmp_path / "runs").exists()  # refused before a run directory, a model or a step


USER_REWARD = '''
def words_only(completions, solution, answer_type, **_):
    """Pays an exact answer on number and word tasks; None ("does not apply") on boxes."""
    return [None if kind == "box" else float(f"<answer>{s}</answer>" == c)
            for c, s, kind in zip(completions, solution, answer_type)]
'''


def test_answers_no_weighted_reward_graded_are_counted_per_task_and_warned_about(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = mixed_file(tmp_path)
    (tmp_path / "user.py").write_text(USER_REWARD)

    class Messages(Progress):
        def __init__(self):
            self.lines = []

        def message(self, text):
            self.lines.append(text)

    said = Messages()
    # an undeclared user reward passes the up-front check; it gives None on boxes, which the run counts and names
    cfg = load_config(None, [f"data.train={spec}", f"data.sft={spec}", f"data.eval={spec}", *SMALL,
                             "rollout.max_new_tokens=22", "eval.max_new_tokens=22", "trainer.steps=2",
                             "rollout.prompts_per_step=12", "rewards=[{fn: 'user.py:words_only', isolate: false}, "
                             "{name: length}]", f"trainer.output_dir={tmp_path / 'run'}"])
    summary = train(cfg, said)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if r["phase"] == "train"][0]
    assert step["task/shapes_box/ungraded_answers"] == 8 and step["task/shapes_box/graded_answers"] == 0
    for task in ("shapes_count", "shapes_color"):
        assert step[f"task/{task}/graded_answers"] == 8 and step[f"task/{task}/ungraded_answers"] == 0
    warnings = [w for w in said.lines if "ungraded_answers" in w]
    assert len(warnings) == 1 and warnings[0].startswith("warning: step 1: task 'shapes_box': 8 of 8 answers were "
                                                         "scored by no weighted reward that grades answers")
    assert any("task 'shapes_box'" in note for note in summary["notes"])


def test_a_mixed_file_trained_with_the_defaults_is_graded_on_every_answer_type(tmp_path, monkeypatch, capsys):
    """Issue 42: number, word and box answers in one user file, `vlmrl train` with its defaults (the quickstart's
    accuracy + length). The labels do not fit max_new_tokens=12: refused, nothing left behind; rerun with the value
    the refusal names: every answer of every task is graded (accuracy pays a box with IoU >= 0.5), no warning."""
    monkeypatch.chdir(tmp_path)
    spec = mixed_file(tmp_path)
    args = ["train", f"data.train={spec}", f"data.sft={spec}", f"data.eval={spec}", *SMALL, "trainer.steps=2",
            "rollout.prompts_per_step=12"]
    assert main(args) == 2
    err = capsys.readouterr().err
    need = re.search(r"set rollout.max_new_tokens=(\d+) or more", err)
    assert need and not (tmp_path / "runs").exists(), err
    budget = need.group(1)
    assert main([*args, f"rollout.max_new_tokens={budget}", f"eval.max_new_tokens={budget}"]) == 0
    err = capsys.readouterr().err
    assert "ungraded" not in err and "max_length" not in err, err
    rows = [json.loads(x) for x in (tmp_path / "runs" / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    for step in [r for r in rows if r["phase"] == "train"]:
        for task in TASKS:  # every answer of every task scored by accuracy (a box by IoU)
            assert step[f"task/{task}/graded_answers"] >= 2 and step[f"task/{task}/ungraded_answers"] == 0
        answers = sum(step[f"task/{task}/graded_answers"] for task in TASKS)
        assert step["reward/accuracy/count"] == answers == step["reward/length/count"]
        assert step["reward/iou/count"] == step["task/shapes_box/graded_answers"]  # a box's IoU, graded, besides
        for task in TASKS:  # every generated group counted per task, for the sparse-signal warning
            assert step[f"task/{task}/groups"] >= step[f"task/{task}/signal_groups"] >= 0


def test_the_default_rewards_pay_a_box_its_iou_and_solve_it_at_half():
    """The default recipe grades a box as Visual-RFT does (its IoU, for a well-formed answer) on top of accuracy's
    IoU >= 0.5, so a box close to the target earns more than a far one before any box is right; what counts as
    solved (accuracy, curriculum, held-out) stays IoU >= 0.5; other answers score as before."""
    from vlmrl.config import QUICKSTART
    from vlmrl.eval.generative import Solved, correctness
    from vlmrl.rewards.specs import reward_specs

    cfg = load_config(QUICKSTART, ["rollout.max_new_tokens=30"])  # what `vlmrl train` runs without a recipe
    answers = ["<answer>[10, 10, 30, 30]</answer>", "<answer>[12, 10, 30, 30]</answer>",  # IoU 1, 0.9
               "<answer>[10, 10, 30, 22]</answer>", "<answer>[40, 40, 50, 50]</answer>",  # IoU 0.6, 0
               "[10, 10, 30, 30]", "<answer>3</answer>"]  # no answer block: 0; a number: IoU does not apply
    n = len(answers)
    columns = {"solution": ["[10, 10, 30, 30]"] * 5 + ["3"], "answer_type": ["box"] * 5 + ["number"],
               "width": [56] * n, "height": [56] * n, "completion_truncated": [False] * n,
               "completion_lengths": [5] * n}
    out = compute_rewards(reward_specs(cfg), answers, columns)
    assert out.components["iou"] == pytest.approx([1.0, 0.9, 0.6, 0.0, 0.0, None])
    assert out.total.tolist() == pytest.approx([2.0, 1.9, 1.6, 0.0, 0.0, 1.0])
    assert correctness(answers, columns, Solved.from_config(cfg), out) == [True, True, True, False, False, True]
