"""A judge made with vlmrl: judged retrievals as data rows, the `judgement` reward, agreement numbers by hand, and the
rows asking exactly what ReCLIP's LLM judge asks."""

import json

import pytest

from vlmrl.reclip.feedback import Feedback, Reason
from vlmrl.reclip.grm import (
    GRM_TEMPLATE,
    KINDS,
    agreement,
    agreement_score,
    judge_prompt,
    judged_retrievals,
    judgement_reward,
    read_reply,
    reply_text,
    write_rows,
)
from vlmrl.reclip.judge import LLMJudge, SceneGraphJudge, build_judge
from vlmrl.reclip.scenes import make_scenes
from vlmrl.rewards import REWARDS
from vlmrl.rewards.registry import RewardFailure

RED_BLUE = Reason("colour", "red", "blue")
CIRCLE_SQUARE = Reason("shape", "circle", "square")
COUNT = Reason("count", "1", "2")


@pytest.fixture(scope="module")
def retrievals():
    return judged_retrievals(make_scenes(120, "train", 0), 150, seed=0)


def test_every_kind_and_direction_is_drawn_and_judged_by_the_programmatic_judge(retrievals):
    assert {r.kind for r in retrievals} == set(KINDS) and {r.direction for r in retrievals} == {"t2i", "i2t"}
    judge = SceneGraphJudge()
    for r in retrievals:
        assert judge(r.query, r.retrieved, r.truth) == r.gold
        assert (r.gold.verdict == "relevant") == (r.kind == "truth")  # a near miss always differs from its truth
    # i2t truths are sometimes said from the other side: relevant all the same
    flipped = [r for r in retrievals if r.kind == "truth" and r.direction == "i2t" and r.retrieved.text != r.truth.text]
    assert flipped and all(r.gold.verdict == "relevant" for r in flipped)


def test_a_reply_reads_back_as_the_judgement_it_writes(retrievals):
    for r in retrievals:
        text = reply_text(r.gold)
        back = read_reply(text)
        assert back.verdict == r.gold.verdict
        assert [str(x) for x in back.reasons] == [str(x) for x in r.gold.reasons[:4]]
        assert agreement_score(back, r.gold) == 1.0
    assert reply_text(Feedback("irrelevant", [RED_BLUE, CIRCLE_SQUARE])) == (
        "- colour: red != blue\n- shape: circle != square\n[IRRELEVANT]")
    assert read_reply("- colour: red != blue") is None  # no verdict tag


def test_agreement_by_hand():
    gold_a = Feedback("irrelevant", [RED_BLUE, CIRCLE_SQUARE])
    pred_a = Feedback("irrelevant", [Reason("colour", "Red", "blue"), COUNT])  # case ignored: 1 of 2 right
    gold_b = Feedback("relevant")
    pred_b = Feedback("irrelevant", [COUNT])
    res = agreement([(pred_a, gold_a), (pred_b, gold_b), (None, gold_b)])
    # verdicts: 1 of 3; reasons: 1 shared, 3 predicted, 2 expected
    assert res["verdict_agreement"] == pytest.approx(1 / 3)
    assert res["reason_precision"] == pytest.approx(1 / 3) and res["reason_recall"] == pytest.approx(1 / 2)
    assert res["reason_f1"] == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))  # 0.4
    assert res["exact"] == 0.0 and res["no_verdict"] == 1
    assert res["recall_by_attribute"] == {"colour": 1.0, "shape": 0.0}
    # kappa: gold relevant 2/3, predicted relevant 0 -> chance 2/3 x 0 + 1/3 x 1 = 1/3 = observed: kappa 0
    assert res["kappa"] == pytest.approx(0.0, abs=1e-12)
    # all three right, one relevant: kappa 1
    assert agreement([(gold_a, gold_a), (gold_b, gold_b), (gold_a, gold_a)])["kappa"] == pytest.approx(1.0)
    # the reward: half for the verdict, half for F1 (2 x 1 / (2 + 2) = 0.5)
    assert agreement_score(pred_a, gold_a) == pytest.approx(0.5 + 0.25)
    assert agreement_score(pred_b, gold_b) == 0.0 and agreement_score(None, gold_a) == 0.0
    assert agreement_score(Feedback("relevant"), gold_b) == 1.0  # no reasons on either side: F1 1
    only = agreement([(gold_b, gold_b)])
    assert only["reason_precision"] is None and only["reason_f1"] is None and only["exact"] == 1.0


def test_the_judgement_reward_reads_replies_and_refuses_a_solution_that_is_not_one():
    gold = "- colour: red != blue\n- shape: circle != square\n[IRRELEVANT]"
    assert REWARDS["judgement"] is judgement_reward  # registered once the module is imported
    out = judgement_reward(["- colour: red != blue\n[IRRELEVANT]", gold, "[RELEVANT]", "red", "x"],
                               solution=[gold, gold, gold, gold, "three"])
    assert out[0] == pytest.approx(0.5 + 0.5 * 2 * 1 / 3)  # F1 = 2 x 1 / (1 + 2)
    assert out[1] == 1.0 and out[2] == 0.0 and out[3] == 0.0
    assert isinstance(out[4], RewardFailure) and "not a judge reply" in out[4].reason


def test_a_row_asks_what_the_llm_judge_sends(retrievals, monkeypatch):
    """The learned judge must be asked at serve time exactly what it learned: the row's prompt and image are the
    ones LLMJudge sends with the same template."""
    judge = LLMJudge({"base_url": "http://127.0.0.1:9/v1", "model": "m", "template": GRM_TEMPLATE, "max_reasons": 4,
                      "cache_dir": None})
    sent = []

    def fake(**kwargs):
        sent.append(kwargs)
        return None

    monkeypatch.setattr(judge.client, "judge", fake)
    monkeypatch.setattr(judge.client, "last_error", "no server", raising=False)
    for r in retrievals[:20]:
        with pytest.raises(Exception, match="no server"):
            judge(r.query, r.retrieved, r.truth)
        text, image = judge_prompt(r)
        msgs = judge.client.messages(sent[-1]["question"], sent[-1]["prediction"], sent[-1]["reference"],
                                     sent[-1]["images"])
        assert msgs[-1]["content"][0]["text"] == text
        assert sent[-1]["images"] == [image]
    assert build_judge("scene_graph")  # the programmatic judge needs no options


def test_rows_are_written_as_a_data_file_vlmrl_train_reads(tmp_path, retrievals):
    from vlmrl.data import build_dataset

    path = write_rows(retrievals[:10], tmp_path, "train")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["solution"] for row in rows] == [reply_text(r.gold) for r in retrievals[:10]]
    samples, report = build_dataset({"path": str(path)}, "train", 0)
    assert report.loaded == 10 and samples[0]["problem"] == judge_prompt(retrievals[0])[0]
    assert samples[0]["answer_type"] == "text"
    assert samples[0]["images"][0].size == retrievals[0].truth.image.size


@pytest.mark.slow  # ~2 min: data, a judge trained for 150 SFT steps, `vlmrl serve`, agreement, two ReCLIP arms
def test_the_judge_loop_end_to_end(tmp_path):
    """benchmarks/reclip_grm.py --smoke: every stage as its users run it, the served judge called over HTTP by
    grm-eval and by ReCLIP's LLM judge path."""
    from tests.test_benchmarks import run_script

    out = tmp_path / "grm"
    proc = run_script("reclip_grm.py", "--smoke", "--out", str(out), timeout=600)
    assert "learned judge − programmatic (wins)" in proc.stdout, proc.stdout[-3000:]
    results = json.loads((out / "results.json").read_text())
    agree = results["agreement"]
    assert agree["n"] == 40 and agree["failed"] == 0  # every request answered over HTTP
    assert agree["no_verdict"] < 40  # 150 SFT steps teach the reply's format: some replies carry a verdict
    arms = results["reclip"]["results"][0]
    assert {"reclip", "reclip_learned_judge"} <= set(arms) and "comp/all" in arms["reclip_learned_judge"]
    # the learned arm was judged by the server: judgements made, and those without a verdict counted as failures
    logged = [json.loads(line) for line in (out / "reclip" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    learned = [m for m in logged if m["phase"] == "train_reclip_learned_judge"]
    calls = sum(m.get("judge/calls", 0) for m in learned)
    assert calls > sum(m.get("judge/failures", 0) for m in learned)
