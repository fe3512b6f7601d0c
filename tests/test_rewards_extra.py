"""Classification, detection, keywords, process hook, math and multiple choice, min length: crafted strings,
hand-computed expectations, exploits included."""

from __future__ import annotations

import json

import pytest

from vlmrl.rewards import (
    accuracy_reward,
    classification_reward,
    detection_reward,
    keywords_reward,
    length_penalty,
    process_reward,
)
from vlmrl.rewards.boxes import detection_score, match_boxes
from vlmrl.rewards.verifiable import choice_index

# ------------------------------------------------------------------------------------------------ classification


def cls(answer: str, solution="cat", **kwargs) -> float | None:
    return classification_reward([f"<answer>{answer}</answer>"], [solution], **kwargs)[0]


def test_classification_pays_one_label():
    assert cls("cat") == 1.0 and cls("The Cat.") == 1.0 and cls("dog") == 0.0
    assert cls("automobile", "car", synonyms={"car": ["automobile", "auto"]}) == 1.0
    assert cls("car", "automobile", synonyms={"car": ["automobile"]}) == 1.0  # the solution may be a synonym too
    assert cls("It is a cat.", labels=["cat", "dog"]) == 1.0  # a phrase naming exactly one known label
    assert cls("It is a cat.") == 0.0  # without the label set the answer must be the label


@pytest.mark.parametrize("answer", ["", "   ", "cat, dog", "cat or dog", "cat and dog", "cat/dog", "dog; cat"])
def test_classification_empty_and_several_labels_pay_nothing(answer):
    assert cls(answer) == 0.0
    assert cls(answer, labels=["cat", "dog", "bird"]) == 0.0


def test_classification_label_set_mentions():
    labels = ["red", "dark red", "blue"]
    assert cls("dark red", "dark red", labels=labels) == 1.0  # one mention, not also "red"
    assert cls("a dark red one", "dark red", labels=labels) == 1.0
    assert cls("red or maybe blue", "red", labels=labels) == 0.0
    assert cls("cat", "cat", strict=True, completion_truncated=[True]) == 0.0
    assert classification_reward(["<answer>cat</answer></answer>"], ["cat"]) == [0.0]  # the closing-tag hack
    assert classification_reward(["<answer>x</answer>"], [""]) == [None]


# ---------------------------------------------------------------------------------------------------- detection


def test_match_boxes_greedy_and_hungarian():
    # pred 0 = x 3..13: IoU 7/13 with gold 0 (x 0..10), 3/17 with gold 1 (x 10..20); pred 1 = x 0..5: 5/10 with
    # gold 0. Greedy takes the best pair (0, 0) and leaves pred 1 unmatched; Hungarian matches both.
    gold = [(0, 0, 10, 10), (10, 0, 20, 10)]
    pred = [(3, 0, 13, 10), (0, 0, 5, 10)]
    assert match_boxes(pred, gold, 0.15, "greedy") == [(0, 0, pytest.approx(7 / 13))]
    assert sorted((p, g) for p, g, _ in match_boxes(pred, gold, 0.15, "hungarian")) == [(0, 1), (1, 0)]
    assert match_boxes(pred, gold, 0.2, "hungarian") == [(0, 0, pytest.approx(7 / 13))]  # 3/17 < 0.2
    with pytest.raises(ValueError):
        match_boxes(pred, gold, 0.5, "optimal")


def test_detection_f1_and_ap_by_hand():
    gold = [(0, 0, 10, 10), (20, 20, 30, 30)]
    assert detection_score([(0, 0, 10, 10), (20, 20, 30, 30)], gold) == 1.0
    assert detection_score([(0, 0, 10, 10)], gold) == pytest.approx(2 * 1 / 3)  # 2TP/(P+G) = 2/3
    assert detection_score([(0, 0, 10, 10), (50, 50, 60, 60)], gold) == pytest.approx(2 / 4)
    # AP over the ranked list [miss, hit, hit]: (1/2)(1/2 + 2/3), times min(1, G/P) = 2/3
    ranked = [(50, 50, 60, 60), (0, 0, 10, 10), (20, 20, 30, 30)]
    assert detection_score(ranked, gold, score="ap") == pytest.approx(0.5 * (0.5 + 2 / 3) * 2 / 3)
    # soft F1: IoU of the one match is 50/150 at a 0.3 threshold
    assert detection_score([(0, 0, 10, 5)], [(0, 0, 10, 15)], 0.3, soft=True) == pytest.approx(2 * (1 / 3) / 2)
    assert detection_score([], []) == 1.0 and detection_score([(0, 0, 1, 1)], []) == 0.0


@pytest.mark.parametrize("score", ["f1", "ap"])
def test_detection_spamming_boxes_does_not_pay(score):
    target = "[[10, 10, 30, 30]]"
    spam = [[10, 10, 30, 30]] + [[x, y, x + 20, y + 20] for x in range(0, 70, 10) for y in range(0, 70, 10)][:49]
    assert len(spam) == 50
    one = detection_reward(["<answer>[[10, 10, 30, 30]]</answer>"], [target], score=score, width=[100], height=[100])
    many = detection_reward([f"<answer>{json.dumps(spam)}</answer>"], [target], score=score, width=[100],
                            height=[100])
    assert one == [1.0] and many[0] <= 2 / 51 + 1e-9


def test_detection_parses_forms_and_invalid_boxes():
    gold = '[{"bbox_2d": [0, 0, 10, 10]}, {"bbox_2d": [20, 20, 30, 30]}]'
    size = {"width": [40], "height": [40]}
    qwen = "<|box_start|>(0,0),(250,250)<|box_end|> <|box_start|>(500,500),(750,750)<|box_end|>"
    assert detection_reward([qwen], [gold], **size) == [1.0]  # 0..1000 grid on a 40 px image
    assert detection_reward(["(0,0),(10,10) and (20,20),(30,30)"], [gold], **size) == [1.0]
    # an inverted and an out-of-image box are predictions that match nothing: 2 * 1 / (3 + 2)
    assert detection_reward(["[[0,0,10,10],[30,30,20,20],[0,0,90,90]]"], [gold], **size) == [pytest.approx(0.4)]
    assert detection_reward(["[0,0,1,1]"] * 2, [gold, "[[5,5,1,1]]"]) == [0.0, None]  # a bad solution: None
    assert detection_reward(["[[0,0,1,1]]"] * 101 and [json.dumps([[0, 0, 10, 10]] * 101)], [gold]) == [0.0]


# -------------------------------------------------------------------------------------------- keywords, process


def test_keywords_partial_credit_and_spam_penalty():
    think = "<think>I see a red circle and a square.</think><answer>2</answer>"
    assert keywords_reward([think], keywords=[["red", "circle", "blue"]]) == [pytest.approx(2 / 3)]
    assert keywords_reward([think], keywords=["red", "triangle"]) == [0.5]  # one list for every sample (a kwarg)
    spam = "<think>red green blue yellow circle square triangle</think><answer>2</answer>"
    assert keywords_reward([spam], keywords=[["red", "circle"]], forbidden=[["green", "blue", "yellow"]]) == [0.0]
    assert keywords_reward(["<think>redder circles</think>"], keywords=[["red"]]) == [0.0]  # whole words only
    assert keywords_reward(["<answer>red</answer>"], keywords=[["red"]]) == [0.0]  # not in the reasoning
    assert keywords_reward(["<answer>red</answer>"], keywords=[["red"]], where="answer") == [1.0]
    assert keywords_reward(["x"], keywords=[[]]) == [None]


def step_scorer(step: str, index: int, steps: list[str], solution: str = "", **_) -> float | None:
    """+1 for a step that mentions the solution, 0 otherwise; None for a step that only says 'hmm'."""
    return None if step == "hmm" else float(solution in step)


def test_process_reward_hook():
    completion = "<think>count the circles\nhmm\nthere are 3\n</think><answer>3</answer>"
    ref = f"{__name__}:step_scorer"
    assert process_reward([completion], step_fn=ref, solution=["3"]) == [0.5]  # (0 + 1) / 2, "hmm" skipped
    assert process_reward([completion], step_fn=ref, aggregate="min", solution=["3"]) == [0.0]
    assert process_reward([completion], step_fn=ref, aggregate="last", solution=["3"]) == [1.0]
    assert process_reward(["<answer>3</answer>"], step_fn=ref, solution=["3"]) == [None]


# -------------------------------------------------------------------------------------- math, choice, length


def acc(answer: str, solution: str, **kwargs) -> float | None:
    return accuracy_reward([f"<answer>{answer}</answer>"], [solution], **kwargs)[0]


def test_accuracy_math_symbolic():
    assert acc("x^2+2x+1", "(x+1)^2") == 1.0
    assert acc("\\frac{1}{2}", "0.5", answer_type="math") == 1.0
    assert acc("2\\sqrt{2}", "\\sqrt{8}") == 1.0
    assert acc("\\dfrac{x^2-1}{x-1}", "x+1") == 1.0
    assert acc("x+2", "x+1") == 0.0
    assert acc("__import__('os').system('true')", "x+1") == 0.0  # never reaches eval
    assert acc("", "x+1") == 0.0
    assert acc("a.__class__", "x") == 0.0 and acc("x = \\frac12", "0.5", answer_type="math") == 1.0


def test_accuracy_multiple_choice():
    options = [["red", "blue", "green"]]
    assert [acc(a, "B", options=options) for a in ("B", "(b)", "B.", "B) blue", "blue")] == [1.0] * 5
    assert [acc(a, "B", options=options) for a in ("A", "B, C", "B or C", "B. red", "purple", "")] == [0.0] * 6
    assert acc("B", "blue", choices=options) == 1.0  # the solution given as the option's text
    assert acc("C", "B", options=[{"A": "x", "B": "y", "C": "z"}]) == 0.0
    assert choice_index("blue", ["blue", "Blue"]) is None  # ambiguous option texts pick nothing


def test_length_min_length():
    # min 4, max 10, cache 4: L < 4 -> (L - 4) / 4
    got = length_penalty(["x"] * 4, max_length=10, cache_length=4, min_length=4, completion_lengths=[0, 2, 4, 9])
    assert got == [-1.0, -0.5, 0.0, -0.75]
    with pytest.raises(ValueError):
        length_penalty(["x"], max_length=10, cache_length=4, min_length=8)
