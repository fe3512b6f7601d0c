"""A graded judge: P(RELEVANT) read from the reply's token log-probs where the verdict tag is decided, worked by
hand; the client asks for log-probs, caches the probability with the reply, and counts replies that do not show
the decision; ReCLIP weighs a graded verdict by its probability."""

from __future__ import annotations

import math

import pytest

from tests.judge_server import JudgeServer
from vlmrl.reclip.feedback import Feedback as ReclipFeedback
from vlmrl.reclip.feedback import feedback_reward
from vlmrl.reclip.judge import from_rewards_feedback
from vlmrl.rewards.feedback import verdict_probability
from vlmrl.rewards.judge import GRADED_TOP_LOGPROBS, JudgeClient

FAST = {"backoff_base": 0.01, "timeout": 2.0, "cache_dir": None}


def entry(token: str, p: float, *alternatives: tuple[str, float]) -> dict:
    """One OpenAI log-prob entry: the token written with probability p, and the listed alternatives."""
    listed = [(token, p), *alternatives] if alternatives else []
    return {"token": token, "logprob": math.log(p), "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": math.log(q), "bytes": list(t.encode())} for t, q in listed]}


REPLY = [entry("- colour", 0.9, ("+", 0.1)), entry(": red != blue\n", 0.8, ("\n", 0.2)), entry("[", 0.99, ("-", 0.01)),
         entry("IR", 0.6, ("RE", 0.2), ("R", 0.1), ("\n", 0.05)), entry("RELEVANT", 1.0, ("REL", 1e-6)),
         entry("]", 1.0, ("]\n", 1e-6))]


def test_the_deciding_tokens_alternatives_give_the_probability():
    # at "IR": RELEVANT's starts "RE" 0.2 and "R" 0.1, IRRELEVANT's "IR" 0.6; "\n" starts no tag
    assert verdict_probability(REPLY) == pytest.approx(0.3 / 0.9)
    # the bracket in the deciding token: "[R" and "[RE" start RELEVANT; "[" alone decides nothing yet
    fused = [entry("ok ", 0.9, ("no", 0.1)), entry("[IR", 0.5, ("[R", 0.25), ("[RE", 0.15), ("[", 0.1)),
             entry("RELEVANT]", 1.0, ("x", 1e-9))]
    assert verdict_probability(fused) == pytest.approx(0.4 / 0.9)
    # a relevant verdict written with the other tag unlisted is certain; lower case and "[ " count
    assert verdict_probability([entry("[", 1.0, ("x", 1e-9)), entry("Rel", 0.7, ("rel", 0.2)),
                                entry("evant]", 1.0, ("x", 1e-9))]) == 1.0
    spaced = [entry("[ ", 1.0, ("x", 1e-9)), entry("ir", 0.5, ("re", 0.5)), entry("relevant ]", 1.0, ("x", 1e-9))]
    assert verdict_probability(spaced) == pytest.approx(0.5)
    # the last tag decides (an earlier one quoted in the reasons does not)
    assert verdict_probability([entry("[RE", 0.5, ("[IR", 0.5)), entry("LEVANT] no\n", 1.0, ("x", 1e-9)),
                                *REPLY[2:]]) == pytest.approx(0.3 / 0.9)


def test_replies_that_do_not_show_the_decision_have_no_probability():
    assert verdict_probability(None) is None and verdict_probability([]) is None
    assert verdict_probability([entry("I cannot decide.", 1.0, ("x", 1e-9))]) is None  # no tag
    bare = [{**e, "top_logprobs": []} for e in REPLY]  # top_logprobs 0: the written token only
    assert verdict_probability(bare) is None


def graded_reply(prompt: str):
    return "- colour: red != blue\n[IRRELEVANT]", REPLY


def test_a_graded_client_scores_by_probability_and_caches_it(tmp_path):
    with JudgeServer(reply=graded_reply) as server:
        client = JudgeClient(server.base_url, "judge-model", **{**FAST, "cache_dir": tmp_path}, graded=True)
        fb = client.judge(question="q", prediction="blue", reference="red")
        rerun = JudgeClient(server.base_url, "judge-model", **{**FAST, "cache_dir": tmp_path}, graded=True)
        again = rerun.judge(question="q", prediction="blue", reference="red")
        plain = JudgeClient(server.base_url, "judge-model", **{**FAST, "cache_dir": tmp_path})
        tag = plain.judge(question="q", prediction="blue", reference="red")
    assert server.requests[0]["logprobs"] is True and server.requests[0]["top_logprobs"] == GRADED_TOP_LOGPROBS
    assert fb.verdict == "IRRELEVANT" and fb.score == fb.probability == pytest.approx(1 / 3)
    assert again.probability == pytest.approx(1 / 3) and rerun.stats["cache_hits"] == 1  # from disk
    assert tag.score == 0.0 and tag.probability is None and "logprobs" not in server.requests[-1]  # its own key
    assert len(server.requests) == 2 and client.stats["ungraded"] == 0


def test_a_server_without_logprobs_keeps_the_tag_and_is_counted():
    with JudgeServer() as server:  # answers without logprobs, as a server that ignores the field
        client = JudgeClient(server.base_url, "judge-model", **FAST, graded=True)
        fb = client.judge(question="q", prediction="red", reference="red")
    assert fb.score == 1.0 and fb.probability is None and client.stats["ungraded"] == 1
    with pytest.raises(ValueError, match="graded=true reads the probability of a verdict tag"):
        JudgeClient("http://127.0.0.1:9/v1", "m", mode="score", graded=True)


def test_reclip_weighs_a_graded_verdict_by_its_probability():
    with JudgeServer(reply=graded_reply) as server:
        fb = JudgeClient(server.base_url, "judge-model", **FAST, graded=True).judge(
            question="q", prediction="blue", reference="red")
    ours = from_rewards_feedback(fb)
    assert ours.verdict == "irrelevant" and ours.probability == pytest.approx(1 / 3)
    assert [(r.attribute, r.expected, r.got) for r in ours.reasons] == [("colour", "red", "blue")]
    # 1/3 * 1 + 2/3 * 0 - 0.25 (one colour reason), by hand
    assert feedback_reward(ours) == pytest.approx(1 / 3 - 0.25)
    weights = {"relevant": 1.0, "partial": 0.5, "irrelevant": -0.5}
    assert feedback_reward(ReclipFeedback("relevant", [], probability=0.8), weights) == pytest.approx(0.8 - 0.1)
    assert feedback_reward(ReclipFeedback("relevant", [])) == 1.0  # ungraded: the tag's weight
