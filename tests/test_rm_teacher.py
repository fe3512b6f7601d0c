"""An LLM judge as an outcome RM's distillation teacher (`distill.judge`): its margin worked by hand, a student that
follows the judge rather than its labels, every answer asked once, and pairs the judge could not score left out of
the KL and counted."""

from __future__ import annotations

import math

import pytest

from tests.judge_server import JudgeServer
from tests.test_reward_model import _flipped_pairs, train_small_rm
from vlmrl.errors import ConfigError
from vlmrl.trainer.rm import load_rm_config
from vlmrl.trainer.rm_teacher import judge_margin


def test_the_judges_margin_by_hand():
    assert judge_margin(0.8, 0.5) == pytest.approx(math.log(4))  # logit(0.8) - logit(0.5)
    assert judge_margin(1.0, 0.0) == pytest.approx(2 * math.log(99))  # held in [0.01, 0.99]: 9.19
    assert judge_margin(0.0, 1.0) == pytest.approx(-2 * math.log(99))
    assert judge_margin(1.0, 1.0) == 0.0  # two right answers: no preference
    # the Bradley-Terry preference of two answers whose rewards are the judge's log-odds
    p = 1 / (1 + math.exp(-judge_margin(0.8, 0.3)))
    assert p == pytest.approx(0.8 * 0.7 / (0.8 * 0.7 + 0.3 * 0.2))
    assert math.isnan(judge_margin(None, 0.5)) and math.isnan(judge_margin(0.5, None))


def tag_judge(prompt: str) -> str:
    """A judge that prefers answers in answer tags (the opposite of the flipped pairs' labels)."""
    return "+ tagged\n[RELEVANT]" if "Answer to grade: <answer>" in prompt else "- bare number\n[IRRELEVANT]"


def judge_option(server: JudgeServer) -> str:
    return (f"distill.judge={{base_url: '{server.base_url}', model: judge-model, cache_dir: null, max_retries: 0, "
            "backoff_base: 0.01, timeout: 5}")


def test_a_judge_distilled_rm_follows_the_judge_and_asks_each_answer_once(tiny_model_dir, tmp_path):
    pairs = _flipped_pairs(tmp_path)
    with JudgeServer(reply=tag_judge) as server:
        out = train_small_rm(tmp_path, f"data.pairs.path={pairs}", tiny_model_dir, 30, 16, judge_option(server))
        asked = len(server.requests)
    final = out["final"]
    assert final["teacher_pairwise_accuracy"] == 0.0 and final["teacher_unscored"] == 0  # it disagrees with labels
    assert final["teacher_agreement"] >= 0.9 and final["pairwise_accuracy"] <= 0.1 and final["margin"] <= -1.0, final
    # 30 steps of 8 pairs draw each of the 36 training pairs ~7 times: each of the 48 pairs' two answers (the held-out
    # pairs' too) is asked once
    assert asked == 2 * 48


def test_pairs_the_judge_cannot_score_are_left_out_and_counted(tiny_model_dir, tmp_path):
    pairs = _flipped_pairs(tmp_path)
    with JudgeServer(reply=tag_judge, rules={"Answer to grade: <answer>2</answer>": "500"}) as server:
        out = train_small_rm(tmp_path, f"data.pairs.path={pairs}", tiny_model_dir, 30, 16, judge_option(server))
    final = out["final"]
    assert final["teacher_unscored"] > 0 and final["teacher_agreement"] >= 0.9, final
    assert final["teacher_unscored"] < final["pairs"]


def test_an_answer_in_two_pairs_to_one_prompt_is_asked_once():
    from vlmrl.trainer.rm_teacher import JudgeTeacher

    pairs = [{"id": f"g#{k}", "group": "g", "problem": "How many?", "solution": "3", "chosen": c, "rejected": r}
             for k, (c, r) in enumerate((("<answer>3</answer>", "3"), ("<answer>3</answer>", "4"),
                                         ("<answer>3</answer>", "3")))]
    with JudgeServer(reply=tag_judge) as server:
        teacher = JudgeTeacher({"base_url": server.base_url, "model": "judge-model", "cache_dir": None})
        margins = teacher.margins(pairs)
        assert len(server.requests) == 3  # "<answer>3</answer>", "3", "4"
        teacher.margins([{**pairs[0], "group": "h", "problem": "How many circles?"}])  # another prompt: asked again
        assert len(server.requests) == 5
    assert margins.tolist() == pytest.approx([2 * math.log(99)] * 3)


def test_a_failed_answer_is_asked_again_at_its_next_draw():
    from vlmrl.trainer.rm_teacher import JudgeTeacher

    pair = {"group": "g", "problem": "How many?", "solution": "3", "chosen": "<answer>3</answer>", "rejected": "3"}
    with JudgeServer(reply=tag_judge, script=["500"]) as server:  # the first request fails, then all succeed
        teacher = JudgeTeacher({"base_url": server.base_url, "model": "judge-model", "cache_dir": None,
                                "max_retries": 0, "concurrency": 1})
        first, again = teacher.margins([pair]), teacher.margins([pair])
    assert math.isnan(first.item())
    assert again.item() == pytest.approx(2 * math.log(99)) and len(server.requests) == 3


def test_one_teacher_and_a_judge_for_outcome_rms_only():
    judge = "distill.judge={base_url: 'http://127.0.0.1:1/v1', model: m}"
    with pytest.raises(ConfigError, match="two teachers: give one"):
        load_rm_config(None, ["data.pairs.path=x.jsonl", judge, "distill.teacher=runs/rm"])
    with pytest.raises(ConfigError, match="vlmrl rm label --judge"):
        load_rm_config(None, ["data.steps.path=x.jsonl", judge])
