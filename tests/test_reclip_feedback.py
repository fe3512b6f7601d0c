"""The feedback format and parser, self-compression, the reward, and the programmatic judge on crafted scenes."""

import pytest

from vlmrl.reclip.feedback import (
    Feedback,
    FeedbackParseError,
    Reason,
    compress,
    feedback_reward,
    format_feedback,
    parse_feedback,
)
from vlmrl.reclip.judge import ExactJudge, JudgeError, LLMJudge, SceneGraphJudge, View, build_judge
from vlmrl.reclip.scenes import Description, Group, caption, describe

RED_CIRCLE, BLUE_SQUARE = Group(1, "red", "circle"), Group(1, "blue", "square")
LEFT = Description((RED_CIRCLE, BLUE_SQUARE), "left of")  # a red circle to the left of a blue square


def judge(truth: Description, got: Description) -> Feedback:
    return SceneGraphJudge()(View(text=caption(truth)), View(description=got), View(description=truth))


# --- parser ------------------------------------------------------------------------------------------------------


def test_parse_the_issue_example():
    fb = parse_feedback("[IRRELEVANT] colour: red != blue; relation: left-of != right-of")
    assert fb.verdict == "irrelevant" and fb.score is None
    assert [(r.attribute, r.expected, r.got) for r in fb.reasons] == [("colour", "red", "blue"),
                                                                        ("relation", "left-of", "right-of")]


def test_parse_loose_spellings_newlines_and_score():
    fb = parse_feedback("[Partially Relevant]\n- Color wrong: red vs blue\n* relation reversed\nscore: 0.4")
    assert fb.verdict == "partial" and fb.score == pytest.approx(0.4)
    assert [(r.attribute, r.expected, r.got) for r in fb.reasons] == [("colour", "red", "blue"),
                                                                        ("relation", None, None)]
    assert parse_feedback("[relevant]").verdict == "relevant"
    assert parse_feedback("[NOT RELEVANT] number: 2 -> 3").reasons[0].attribute == "count"
    assert parse_feedback("[IRRELEVANT] texture: smooth != rough").reasons[0].attribute == "other"


def test_format_and_parse_round_trip():
    fb = Feedback("irrelevant", [Reason("count", "2", "3"), Reason("shape", "circle", "square")], 0.25)
    text = format_feedback(fb)
    assert text == "[IRRELEVANT] count: 2 != 3; shape: circle != square; score: 0.25"
    again = parse_feedback(text)
    assert [str(r) for r in again.reasons] == [str(r) for r in fb.reasons] and again.score == 0.25


@pytest.mark.parametrize("bad", ["", "colour: red != blue", "RELEVANT", "[MAYBE] colour: red != blue"])
def test_unparseable_output_raises_with_the_text(bad):
    with pytest.raises(FeedbackParseError, match="must start with"):
        parse_feedback(bad)


def test_self_compression_keeps_only_decisive_reasons():
    fb = parse_feedback("[IRRELEVANT] colour: red != blue; colour: red != blue; shape: circle == circle; "
                        "size: small != big")
    kept, dropped = compress(fb, keep={"colour": 0.25, "shape": 0.25})
    assert [str(r) for r in kept.reasons] == ["colour: red != blue"] and dropped == 3
    relevant, dropped = compress(parse_feedback("[RELEVANT] colour: red == red"))
    assert relevant.reasons == [] and dropped == 1


def test_reward_is_verdict_weight_minus_attribute_penalties():
    weights = {"relevant": 1.0, "partial": 0.5, "irrelevant": 0.0}
    penalties = {"colour": 0.25, "relation": 0.5, "other": 0.1}
    assert feedback_reward(parse_feedback("[RELEVANT]"), weights, penalties) == 1.0
    # 0 - 0.25 - 0.5 = -0.75
    fb = parse_feedback("[IRRELEVANT] colour: red != blue; relation: left-of != right-of")
    assert feedback_reward(fb, weights, penalties) == pytest.approx(-0.75)
    # 0.5 - 0.1 (unknown attribute -> other) = 0.4; clipped at min_reward
    assert feedback_reward(parse_feedback("[PARTIAL] size: 1 != 2"), weights, penalties) == pytest.approx(0.4)
    assert feedback_reward(fb, weights, penalties, min_reward=-0.5) == -0.5


# --- the programmatic judge ------------------------------------------------------------------------------------


def test_judge_same_meaning_in_other_words_is_relevant():
    # "a blue square to the right of a red circle" means the same as LEFT
    assert str(judge(LEFT, Description((BLUE_SQUARE, RED_CIRCLE), "right of"))) == "[RELEVANT]"


def test_judge_reversed_relation():
    fb = judge(LEFT, Description((RED_CIRCLE, BLUE_SQUARE), "right of"))
    assert str(fb) == "[IRRELEVANT] relation: left-of != right-of"


def test_judge_swapped_colours_binding():
    fb = judge(LEFT, Description((Group(1, "blue", "circle"), Group(1, "red", "square")), "left of"))
    assert str(fb) == "[IRRELEVANT] colour: red != blue; colour: blue != red"


def test_judge_count_and_colour_and_vertical_relation():
    got = Description((Group(2, "red", "circle"), Group(1, "green", "square")), "above")
    assert str(judge(LEFT, got)) == "[IRRELEVANT] count: 1 != 2; colour: blue != green; relation: left-of != above"


def test_judge_missing_and_extra_groups():
    assert str(judge(LEFT, Description((RED_CIRCLE,)))) == "[IRRELEVANT] missing: a blue square != none"
    three = Description((Group(3, "green", "triangle"),))
    assert str(judge(three, LEFT)).startswith("[IRRELEVANT] count: 3 != 1")
    assert "extra:" in str(judge(three, LEFT))


def test_judge_reads_raw_scene_graphs():
    # the relation comes from the boxes: every red box ends before every blue box starts -> red left of blue
    objects = [{"shape": "circle", "color": "red", "bbox": [0, 20, 12, 32]},
               {"shape": "square", "color": "blue", "bbox": [60, 24, 72, 36]}]
    assert describe(objects) == LEFT.canonical()
    flipped = [{**o, "bbox": [80 - o["bbox"][2], o["bbox"][1], 80 - o["bbox"][0], o["bbox"][3]]} for o in objects]
    assert str(judge(LEFT, describe(flipped))) == "[IRRELEVANT] relation: left-of != right-of"


def test_judge_needs_descriptions_and_exact_judge_compares_captions():
    with pytest.raises(JudgeError, match="judge.name=exact"):
        SceneGraphJudge()(View(), View(text="a dog"), View(text="a cat"))
    exact = ExactJudge()
    assert exact(View(), View(text="A  dog"), View(text="a dog")).verdict == "relevant"
    assert exact(View(), View(text="a cat"), View(text="a dog")).verdict == "irrelevant"
    with pytest.raises(ValueError, match="unknown judge"):
        build_judge("oracle")


def test_llm_judge_through_the_judge_client_and_a_local_server(tmp_path):
    import re

    from tests.judge_server import JudgeServer

    def reply(prompt: str) -> str:
        truth = re.search(r"Ground truth .*?: (.*)", prompt).group(1)
        got = re.search(r"Retrieved: (.*)", prompt).group(1)
        if truth == got:
            return "+ same objects\n[RELEVANT]"
        return "+ the shapes agree\n- colour: red != blue\n- relation reversed\n[IRRELEVANT]"

    with JudgeServer(reply=reply) as server:
        judge = build_judge("llm", {"base_url": server.base_url, "model": "m", "cache_dir": None})
        bad = judge(View(text="a red circle"), View(text="a blue circle"), View(text="a red circle"))
        good = judge(View(text="a red circle"), View(text="a red circle"), View(text="a red circle"))
    assert str(bad) == "[IRRELEVANT] colour: red != blue; relation reversed" and good.verdict == "relevant"
    assert feedback_reward(bad) == pytest.approx(-0.5)
    with pytest.raises(JudgeError, match="judge.options.base_url"):
        build_judge("llm", {"model": "m"})


def test_llm_judge_adapter_parses_a_client_answer():
    prompts = []

    def client(prompt: str) -> str:
        prompts.append(prompt)
        return "[IRRELEVANT] colour: red != blue"

    fb = LLMJudge(client=client)(View(text="a red circle"), View(text="a blue circle"), View(text="a red circle"))
    assert fb.reasons[0].attribute == "colour" and "Retrieved: a blue circle" in prompts[0]
