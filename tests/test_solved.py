"""One definition of "correct" (issue 42, item 1): the recipe's `solved` section drives logged accuracy, the curriculum
and evaluation."""

import json

import pytest

from vlmrl.config import ConfigError, load_config
from vlmrl.eval.generative import Solved, correctness
from vlmrl.rewards import RewardSpec, compute_rewards
from vlmrl.trainer.run import train

from .test_reward_coverage import SMALL


def test_the_default_is_accuracy_and_a_box_is_right_by_iou():
    columns = {"solution": ["3", "[0, 0, 10, 10]", "[0, 0, 10, 10]"], "answer_type": ["number", "box", "box"]}
    texts = ["<answer>3</answer>", "<answer>[0, 0, 10, 8]</answer>", "<answer>[0, 0, 10, 4]</answer>"]
    assert correctness(texts, columns) == [True, True, False]


def test_a_recipe_names_the_component_and_threshold_and_its_options_are_used():
    cfg = load_config(None, ["rewards=[{name: token_f1, label: f1}]", "solved.reward=f1", "solved.threshold=0.5"])
    solved = Solved.from_config(cfg)
    assert solved.spec == RewardSpec("token_f1", label="f1") and solved.threshold == 0.5
    texts, columns = ["<answer>red circle</answer>", "<answer>blue</answer>"], {"solution": ["red", "red"]}
    scores = compute_rewards([solved.spec], texts, columns)
    assert correctness(texts, columns, solved, scores) == [True, False]  # F1 2/3 >= 0.5; 0
    with pytest.raises(ConfigError, match="solved.reward='judgee' is neither a component of rewards"):
        Solved.from_config(load_config(None, ["solved.reward=judgee"]))


def test_solved_drives_logged_accuracy_the_curriculum_and_evaluation(tmp_path):
    # "solved" = a length penalty of at least -1, which every answer has: the nearly untrained model is wrong by
    # accuracy, so every 1.0 below shows that the recipe's definition is the one used
    cfg = load_config(None, [*SMALL, "data.train={task: shapes_count, n: 8}", "data.sft={task: shapes_count, n: 4}",
                             "data.eval={task: shapes_count, n: 4}", "trainer.steps=2", "rollout.max_new_tokens=6",
                             "eval.max_new_tokens=6", "rewards=[{name: accuracy}, {name: length, weight: 0.5}]",
                             "solved.reward=length", "solved.threshold=-1", "curriculum.order=learnability",
                             f"trainer.output_dir={tmp_path / 'run'}"])
    summary = train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for step in [r for r in rows if r["phase"] == "train"]:
        assert step["accuracy"] == 1.0 and step["reward/accuracy/mean"] < 1.0
        assert step["curriculum/mean_pass_rate_seen"] == 1.0 and step["trained_pass_rate/100"] == 1.0
    for run in (summary["start"], summary["final"]):
        assert run["greedy/accuracy"] == 1.0 and run["sampled/accuracy"] == 1.0
