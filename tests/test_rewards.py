"""Rewards: crafted completions with hand-computed expectations, exploits included."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmrl.rewards import (
    REWARDS,
    RewardSpec,
    accuracy_reward,
    box_giou,
    box_iou,
    compute_rewards,
    counting_reward,
    format_reward,
    giou_reward,
    iou_reward,
    length_penalty,
    register_reward,
    resolve_reward,
)
from vlmrl.rewards.parsing import extract_answer, normalize_text, parse_boxes, parse_number

HACK = "<answer>5</answer></answer></answer>"


def acc(completion: str, solution: str = "5", **kwargs) -> float | None:
    return accuracy_reward([completion], [solution], **kwargs)[0]


# ------------------------------------------------------------------------------------------------- accuracy


def test_accuracy_answer_block():
    assert acc("<answer>5</answer>") == 1.0
    assert acc("<think>2+3 is 5</think>\n<answer> 5 </answer>\n") == 1.0
    assert acc("<answer>6</answer>") == 0.0


@pytest.mark.parametrize("strict", [True, False])
def test_accuracy_empty_answers_pay_zero(strict):
    for completion in ["", "<answer></answer>", "<answer>   </answer>", "5", "<think>5</think>"]:
        assert acc(completion, strict=strict) == 0.0, completion


@pytest.mark.parametrize("strict", [True, False])
def test_accuracy_answer_inside_think_does_not_count(strict):
    assert acc("<think>maybe <answer>5</answer></think>", strict=strict) == 0.0
    assert acc("<think>maybe <answer>5</answer></think><answer>4</answer>", strict=strict) == 0.0
    assert acc("<think>draft <answer>4</answer></think><answer>5</answer>", strict=strict) == 1.0
    assert acc("<think>unclosed <answer>5</answer>", strict=strict) == 0.0


def test_accuracy_repeated_closing_tags_hack():
    assert acc(HACK) == 0.0
    assert acc(HACK, strict=False) == 1.0  # the lenient parser that the policy learned to exploit
    assert acc("<answer>4</answer><answer>5</answer>") == 0.0
    assert acc("<answer>5</answer> and some more text") == 0.0
    assert acc("preamble <answer>5</answer>") == 0.0


def test_accuracy_truncated():
    kwargs = {"completion_truncated": [True]}
    assert accuracy_reward(["<answer>5</answer>"], ["5"], **kwargs) == [0.0]
    assert accuracy_reward(["<answer>5</answer>"], ["5"], strict=False, **kwargs) == [1.0]


def graded(answer: str, solution: str, answer_type: str) -> float | None:
    return acc(f"<answer>{answer}</answer>", solution, answer_type=[answer_type])


def test_accuracy_numbers():
    # Arabic-Indic and full-width digits, fractions, separators, unit text around one number
    assert [graded(a, "3", "number") for a in ("\u0663", "\uff13", "3.0", "$3", "3 apples", "x = 3", "3.")] == [1.0] * 7
    assert [graded(a, "0.75", "number") for a in ("3/4", "\\frac{3}{4}", "\uff13/\uff14", "\u0663/\u0664")] == [1.0] * 4
    separators = [("1,000", "1000"), ("-2.50", "-2.5"), ("\u0661\u0662", "12")]
    assert [graded(a, s, "number") for a, s in separators] == [1.0] * 3
    assert graded("5.0000000001", "5", "number") == 1.0  # within the default tolerance
    # listing candidates, ranges, division by zero, words, a real difference: nothing
    assert [graded(a, "3", "number") for a in ("3 or 4", "3-4", "3/0", "three", "3.0001")] == [0.0] * 5


def test_accuracy_tolerance_option():
    assert acc("<answer>5.01</answer>", "5", answer_type=["number"], tolerance=0.01) == 1.0
    assert acc("<answer>5.1</answer>", "5", answer_type=["number"], tolerance=0.01) == 0.0


def test_accuracy_text():
    pays = [("The Red.", "red"), ('"red"', "Red"), ("  dark   RED ", "dark red"), ("an apple!", "Apple"), ("A", "A")]
    assert [graded(a, s, "text") for a, s in pays] == [1.0] * 5
    assert graded("\\boxed{red}", "red", "text") == 1.0
    assert graded("blue", "red", "text") == 0.0
    assert graded("the", "A", "text") == 0.0  # articles are kept when removing them leaves nothing: "the" != "a"
    assert graded("...", "red", "text") == 0.0
    assert graded("...", "...", "text") is None  # a solution that normalises to nothing is bad data: not graded


def test_accuracy_answer_type_inferred_box_by_iou_and_lists():
    completions = ["<answer>5</answer>", "<answer>Red</answer>", "<answer>[0, 0, 1, 1]</answer>", "<answer>b</answer>"]
    solutions = ["5.0", "red", "[0, 0, 1, 1]", ["a", "B"]]
    assert accuracy_reward(completions, solutions) == [1.0, 1.0, 1.0, 1.0]  # the box string compared as text
    assert accuracy_reward(completions, solutions, answer_type=["number", "text", "box", "text"]) == [1, 1, 1, 1]
    # a box pays by IoU >= iou_threshold (0.5): [0,0,10,10] vs [0,0,10,8] is 0.8, vs [0,0,10,4] is 0.4
    boxes = ["<answer>[0, 0, 10, 8]</answer>", "<answer>[0, 0, 10, 4]</answer>", "[0, 0, 10, 10]", "<answer>[0]</answer>"]
    assert accuracy_reward(boxes, ["[0, 0, 10, 10]"] * 4, answer_type="box") == [1.0, 0.0, 0.0, 0.0]  # strict
    assert accuracy_reward(boxes[:2], ["[0, 0, 10, 10]"] * 2, answer_type="box", iou_threshold=0.3) == [1.0, 1.0]
    assert accuracy_reward(boxes[:1], ["not a box"], answer_type="box") == [None]  # bad data: not graded
    assert accuracy_reward(["<answer>5</answer>"], ["five"], answer_type="number") == [None]  # bad data: not graded


def test_accuracy_rejects_unknown_options():
    with pytest.raises(ValueError, match="answer_type"):
        accuracy_reward(["<answer>5</answer>"], ["5"], answer_type=["integer"])
    with pytest.raises(ValueError, match="extract"):
        accuracy_reward(["<answer>5</answer>"], ["5"], extract="json")


def test_accuracy_extract_modes():
    assert acc("The sum is \\boxed{5}.", extract="boxed", strict=False) == 1.0
    assert acc("The sum is \\boxed{\\frac{10}{2}}", extract="boxed", strict=False) == 1.0
    assert acc("work\nwork\n5\n", extract="last_line", strict=False) == 1.0
    assert acc("<think>\\boxed{5}</think>\\boxed{4}", extract="auto", strict=False) == 0.0
    assert acc("<answer>the answer is \\boxed{5}</answer>", extract="boxed") == 1.0
    assert extract_answer("a <answer>1</answer> \\boxed{2}\n3", "auto") == "1"
    assert extract_answer("a \\boxed{2}\n3", "auto") == "2"
    assert extract_answer("a\n3", "auto") == "3"


def test_accuracy_ignores_unknown_columns():
    assert accuracy_reward(["<answer>5</answer>"], ["5"], problem=["q"], id=["x"], width=[3], task=["t"]) == [1.0]


# --------------------------------------------------------------------------------------------------- format


def test_format_think_and_answer():
    ok = "<think>reasoning</think>\n<answer>5</answer>\n"
    assert format_reward([ok]) == [1.0]
    assert format_reward(["<answer>5</answer>"]) == [0.0]  # think required by default
    assert format_reward(["<answer>5</answer>"], think=False) == [1.0]
    assert format_reward([ok], think=False) == [0.0]
    assert format_reward(["<think>r</think><answer></answer>"]) == [0.0]  # empty answer
    assert format_reward(["<think>r</think><answer>5</answer><answer>6</answer>"]) == [0.0]
    assert format_reward([ok], completion_truncated=[True]) == [0.0]


def test_format_strict_and_search():
    hack = "<think>r</think>" + HACK
    assert format_reward([hack]) == [0.0]
    assert format_reward([hack], strict=False) == [0.0]  # still three closing tags: not one answer block
    chatty = "Sure! <think>r</think><answer>5</answer> Hope this helps."
    assert format_reward([chatty]) == [0.0]
    assert format_reward([chatty], strict=False) == [1.0]
    assert format_reward(["<reason>r</reason><final>5</final>"], tags=["reason", "final"]) == [1.0]


# ------------------------------------------------------------------------------------------------------ iou


def iou1(prediction: str, solution: str = "[5, 5, 15, 15]", **kwargs) -> float | None:
    return iou_reward([prediction], [solution], **kwargs)[0]


def test_iou_by_hand():
    assert box_iou((0, 0, 10, 10), (5, 5, 15, 15)) == pytest.approx(25 / 175)
    assert iou1("<answer>[0, 0, 10, 10]</answer>") == pytest.approx(25 / 175)
    assert iou1("<answer>(0,0),(10,10)</answer>") == pytest.approx(25 / 175)
    assert iou1("The box is [5, 5, 15, 15].") == 1.0  # no tag: whole completion
    assert iou1('```json\n[{"bbox_2d": [5, 5, 15, 15], "label": "cat"}]\n```') == 1.0
    assert iou1('{"Position": [0, 0, 10, 10]}') == pytest.approx(25 / 175)
    assert iou1("<answer>[20, 20, 30, 30]</answer>") == 0.0
    assert iou1("<answer>[0, 0, 10, 10]</answer>", threshold=0.5) == 0.0
    assert iou1("<answer>[4, 4, 15, 15]</answer>", threshold=0.5) == 1.0
    assert iou_reward(["[0,0,1,1]"], [[0, 0, 1, 1]]) == [1.0]  # solution given as a list


def test_iou_invalid_boxes_pay_zero():
    size = {"width": [20], "height": [20]}
    assert iou1("<answer>[15, 15, 5, 5]</answer>") == 0.0  # inverted
    assert iou1("<answer>[5, 5, 5, 15]</answer>") == 0.0  # empty
    assert iou1("<answer>[0, 0, 25, 20]</answer>", **size) == 0.0  # 5 px outside
    assert iou1("<answer>[-2, 0, 15, 15]</answer>") == 0.0
    assert iou1("<answer>[5, 5, 21, 15]</answer>", **size) == pytest.approx(100 / 160)  # within 1 px: valid
    assert iou1("<answer>no box here</answer>") == 0.0
    assert iou1("<answer>[1e999, 0, 10, 10]</answer>") == 0.0


def test_iou_several_boxes_pay_zero():
    many = '[{"bbox_2d": [5, 5, 15, 15]}, {"bbox_2d": [0, 0, 10, 10]}]'
    assert iou1(many) == 0.0
    assert iou1("[5, 5, 15, 15] [0, 0, 20, 20]") == 0.0
    assert iou1('{"bbox_2d": [[5, 5, 15, 15], [0, 0, 1, 1]]}') == 0.0


def test_iou_qwen_grid():
    # 0..1000 grid on a 200x100 image: x * 200 / 1000, y * 100 / 1000
    text = "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,200),(500,1000)<|box_end|>"
    assert parse_boxes(text, width=200, height=100) == [(20.0, 20.0, 100.0, 100.0)]
    assert iou_reward([text], ["[20, 20, 100, 100]"], width=[200], height=[100]) == [1.0]
    assert iou_reward([text], ["[20, 20, 100, 100]"]) == [0.0]  # absolute needs the image size
    assert iou_reward([text], ["[0.1, 0.2, 0.5, 1.0]"], coords="normalized") == [pytest.approx(1.0)]


def test_iou_normalized_coords():
    # inter 0.25 * 0.25 = 0.0625, union 0.25 + 0.25 - 0.0625 = 0.4375
    assert iou1("[0, 0, 0.5, 0.5]", "[0.25, 0.25, 0.75, 0.75]", coords="normalized") == pytest.approx(1 / 7)
    assert iou1("[0, 0, 1.5, 0.5]", "[0.25, 0.25, 0.75, 0.75]", coords="normalized") == 0.0


def test_iou_not_applicable_and_strict():
    assert iou_reward(["[0,0,1,1]"] * 2, ["[0,0,1,1]", "5"], answer_type=["box", "number"]) == [1.0, None]
    assert iou1("<answer>[5, 5, 15, 15]</answer>", "not a box") is None
    assert iou1("<answer>[5, 5, 15, 15]</answer>", completion_truncated=[True]) == 1.0
    assert iou1("<answer>[5, 5, 15, 15]</answer>", strict=True, completion_truncated=[True]) == 0.0
    assert iou1("<answer>[5, 5, 15, 15]</answer></answer>", strict=True) == 0.0
    assert iou1("<think>[5, 5, 15, 15]</think>") == 0.0  # a box in the reasoning is not an answer


def test_giou_disjoint_and_overlapping():
    # disjoint: I = 0, U = 2, C = 3 -> GIoU = 0 - (3 - 2) / 3 = -1/3 -> mapped (1 - 1/3) / 2 = 1/3
    assert box_giou((0, 0, 1, 1), (2, 0, 3, 1)) == pytest.approx(-1 / 3)
    assert giou_reward(["[0, 0, 1, 1]"], ["[2, 0, 3, 1]"]) == [pytest.approx(1 / 3)]
    # overlapping: C = U (enclosing 15x15 = 225 vs union 175 -> GIoU = 25/175 - 50/225)
    assert giou_reward(["[0,0,10,10]"], ["[5,5,15,15]"]) == [pytest.approx((25 / 175 - 50 / 225 + 1) / 2)]
    assert giou_reward(["[10, 10, 0, 0]"], ["[2, 0, 3, 1]"]) == [0.0]  # invalid pays 0, not 0.5


# ------------------------------------------------------------------------------------------ counting, length


def test_counting():
    def count(answer: str) -> float | None:
        return counting_reward([f"<answer>{answer}</answer>"], ["3"])[0]

    assert [count(a) for a in ("3", "3.0", "3 shapes", "\u0663")] == [1.0] * 4
    assert [count(a) for a in ("4", "3.5", "3 or 4", "")] == [0.0] * 4


def test_counting_strict_and_bad_solution():
    assert counting_reward(["<answer>3</answer></answer>"], [3]) == [0.0]
    assert counting_reward(["<answer>3</answer></answer>"], [3], strict=False) == [1.0]
    assert counting_reward(["<answer>3</answer>"], ["3.5"]) == [None]


def test_length_penalty_three_regimes():
    # max_length 10, cache 4: 0 up to 6, then (6 - L) / 4, -1 beyond 10
    lengths = [3, 6, 8, 10, 11]
    penalties = length_penalty(["x"] * 5, max_length=10, cache_length=4, completion_lengths=lengths)
    assert penalties == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert length_penalty(["a" * 7], max_length=10, cache_length=4) == [-0.25]  # characters without token lengths
    with pytest.raises(ValueError):
        length_penalty(["x"], max_length=10, cache_length=0)


# ------------------------------------------------------------------------------------------ compute_rewards


def test_compute_rewards_weights_and_none():
    completions = [
        "<think>r</think><answer>5</answer>",
        "<answer>4</answer>",
        "<think>r</think><answer>[0,0,1,1]</answer>",
    ]
    columns = {"solution": ["5", "5", "[0,0,1,1]"], "answer_type": ["number", "number", "box"]}
    specs = [RewardSpec("accuracy", 1.0), RewardSpec("format", 0.5), RewardSpec("iou", 2.0)]
    out = compute_rewards(specs, completions, columns)
    assert out.components == {
        "accuracy": [1.0, 0.0, 1.0],  # a box pays accuracy by IoU >= 0.5
        "format": [1.0, 0.0, 1.0],
        "iou": [None, None, 1.0],
    }
    # 1 + 0.5 ; 0 + 0 ; 1 + 0.5 + 2
    assert out.total.dtype == torch.float32
    assert out.total.tolist() == [1.5, 0.0, 3.5]
    assert out.no_reward == 0
    assert out.failures == {"accuracy": 0, "format": 0, "iou": 0}


def test_compute_rewards_no_reward_counted():
    out = compute_rewards([RewardSpec("iou")], ["[0,0,1,1]", "x"], {"solution": ["5", "[0,0,1,1]"]})
    assert out.components["iou"] == [None, 0.0]
    assert out.total.tolist() == [0.0, 0.0]
    assert out.no_reward == 1


def test_compute_rewards_survives_broken_rewards(monkeypatch):
    def boom(completions, **_):
        raise RuntimeError("judge down")

    def short(completions, **_):
        return [1.0]

    def bad_values(completions, **_):
        return [float("nan"), "1", math.inf, 0.25]

    for name, fn in [("boom", boom), ("short", short), ("bad_values", bad_values)]:
        monkeypatch.setitem(REWARDS, name, fn)
    specs = [RewardSpec("boom"), RewardSpec("short"), RewardSpec("bad_values", 2.0), RewardSpec("length")]
    out = compute_rewards(specs, ["a", "b", "c", "d"], {"solution": ["1"] * 4})
    assert out.components["boom"] == [None] * 4
    assert out.components["short"] == [None] * 4
    assert out.components["bad_values"] == [None, None, None, 0.25]
    assert out.failures == {"boom": 4, "short": 4, "bad_values": 3, "length": 0}
    assert "judge down" in out.errors["boom"] and "1 values for 4" in out.errors["short"]
    assert out.total.tolist() == [0.0, 0.0, 0.0, 0.5]
    assert out.no_reward == 0  # `length` still scored every sample
    metrics = out.metrics()
    assert metrics["reward/failure_rate"] == pytest.approx(11 / 16)
    assert metrics["reward/boom/failures"] == 4.0


def test_metrics_keys_and_values():
    out = compute_rewards(
        [RewardSpec("accuracy"), RewardSpec("format", 0.5)],
        ["<answer>5</answer>", "<answer>4</answer>"],
        {"solution": ["5", "5"]},
    )
    metrics = out.metrics()
    expected = {f"reward/{k}/{s}" for k in ("accuracy", "format") for s in ("mean", "std", "count", "failures")}
    expected |= {"reward/total/mean", "reward/total/std", "reward/failure_rate", "reward/failed_samples",
                 "reward/no_reward"}
    expected |= {"time/reward/accuracy", "time/reward/format"}
    assert set(metrics) == expected
    assert metrics["reward/accuracy/mean"] == 0.5 and metrics["reward/accuracy/std"] == 0.5
    assert metrics["reward/total/mean"] == 0.5 and metrics["reward/no_reward"] == 0.0
    assert all(isinstance(v, float) for v in metrics.values())


def test_compute_rewards_config_errors():
    with pytest.raises(ValueError, match="accuracy.*counting.*detection.*format.*giou.*iou.*judge.*length"):
        compute_rewards([RewardSpec("acuracy")], ["x"], {"solution": ["5"]})
    with pytest.raises(ValueError, match="label"):
        compute_rewards([RewardSpec("accuracy"), RewardSpec("accuracy")], ["x"], {"solution": ["5"]})
    with pytest.raises(ValueError, match="shadow"):
        compute_rewards([RewardSpec("accuracy", kwargs={"solution": 1})], ["x"], {"solution": ["5"]})
    labelled = [RewardSpec("accuracy"), RewardSpec("accuracy", 0.0, {"strict": False}, label="accuracy_lenient")]
    out = compute_rewards(labelled, [HACK], {"solution": ["5"]})
    assert out.components == {"accuracy": [0.0], "accuracy_lenient": [1.0]}
    assert out.total.tolist() == [0.0]


def test_resolve_reward_from_file_and_module(tmp_path, monkeypatch):
    path = tmp_path / "my_rewards.py"
    path.write_text("def shout(completions, **_):\n    return [float(c.isupper()) for c in completions]\n")
    fn = resolve_reward(f"{path}:shout")
    assert fn(["HI", "hi"]) == [1.0, 0.0]
    assert resolve_reward(f"{path}:shout") is fn  # the file is imported once
    out = compute_rewards([RewardSpec(f"{path}:shout")], ["HI"], {})
    assert out.total.tolist() == [1.0]
    monkeypatch.chdir(tmp_path)
    assert resolve_reward("my_rewards.py:shout") is fn
    assert resolve_reward("vlmrl.rewards.verifiable:accuracy_reward") is REWARDS["accuracy"]
    with pytest.raises(ValueError, match="no callable"):
        resolve_reward(f"{path}:whisper")
    with pytest.raises(FileNotFoundError):
        resolve_reward("missing.py:shout")
    with pytest.raises(ValueError, match="registered rewards: accuracy, bleu, classification, counting, detection, exact_match, format"):
        resolve_reward("nope")


def test_register_reward_refuses_a_taken_name(monkeypatch):
    monkeypatch.setattr("vlmrl.rewards.registry.REWARDS", dict(REWARDS))
    with pytest.raises(ValueError, match="already registered"):

        @register_reward("accuracy")
        def other(completions, **_):
            return [0.0] * len(completions)


# --------------------------------------------------------------------------------------------------- parsing


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_parse_number_round_trips_integers(value):
    assert parse_number(str(value)) == value
    assert parse_number(f"{value:,}") == value


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=4, max_size=4), st.floats(0.1, 50), st.floats(0.1, 50))
def test_iou_is_symmetric_and_bounded(corner, w, h):
    a = (corner[0], corner[1], corner[0] + w, corner[1] + h)
    b = (corner[2], corner[3], corner[2] + h, corner[3] + w)
    assert box_iou(a, b) == pytest.approx(box_iou(b, a))
    assert 0.0 <= box_iou(a, b) <= 1.0
    assert -1.0 <= box_giou(a, b) <= box_iou(a, b) + 1e-12
    assert box_iou(a, a) == pytest.approx(1.0)


def test_normalize_text_examples():
    assert normalize_text("The Red.") == "red"
    assert normalize_text("\u201cNew  York\u201d!") == "new york"
    assert normalize_text("\uff32\uff25\uff24") == "red"  # full-width letters


def test_reward_outputs_concatenate_in_order():
    """DAPO's dynamic sampling joins the scores of several sampling rounds: totals, components and counts."""
    from vlmrl.rewards.registry import RewardOutput

    specs = [RewardSpec("accuracy", 1.0, {"strict": False}), RewardSpec("format", 0.5)]
    a = compute_rewards(specs, ["<answer>3</answer>", "<answer>4</answer>"], {"solution": ["3", "3"]})
    b = compute_rewards(specs, ["no tags"], {"solution": ["7"]})
    both = RewardOutput.concat([a, b])
    assert both.total.tolist() == a.total.tolist() + b.total.tolist()
    assert both.total[0] > both.total[1] and len(both.total) == 3
    assert both.components["accuracy"] == [1.0, 0.0, 0.0]
    assert both.no_reward == a.no_reward + b.no_reward
