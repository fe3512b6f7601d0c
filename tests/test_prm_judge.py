"""Step labels from an LLM judge (`vlmrl rm label --judge`): every step of every answer is sent once with the
steps before it, labelled by the verdict (or a graded judge's probability), and an answer with an ungraded step is
left out and counted, never labelled 0; the rows train a PRM as they are."""

from __future__ import annotations

import re

import pytest

from tests.judge_server import JudgeServer
from tests.test_judge_graded import entry
from vlmrl.data import make_task
from vlmrl.rewards.judge import JudgeClient
from vlmrl.trainer.prm import check_step_rows
from vlmrl.trainer.prm_judge import STEP_TEMPLATE, judge_steps

FAST = {"backoff_base": 0.01, "timeout": 2.0, "cache_dir": None, "max_retries": 0, "template": STEP_TEMPLATE}


def last_step(prompt: str) -> str:
    return re.findall(r"^Step \d+: (.*)$", prompt, flags=re.M)[-1]


def parity_judge(prompt: str) -> str:
    """A judge that calls a step right when its digit is even."""
    return "+ even\n[RELEVANT]" if int(last_step(prompt)) % 2 == 0 else "- odd\n[IRRELEVANT]"


def answers_for(samples):
    return [["<think>2\n3</think><answer>1</answer>", "<think>8\n7\n6</think><answer>1</answer>",
             "<answer>1</answer>",  # no steps: not a row, no request
             "<think>2\n3</think><answer>1</answer>"],  # the same steps to the same prompt: asked once
            ["<think>2\n3</think><answer>1</answer>"]]  # the same steps to another prompt: asked again


def test_each_step_is_judged_with_the_steps_before_it_and_labelled_by_the_verdict():
    samples = make_task("shapes_count", 2, "train", seed=0)
    with JudgeServer(reply=parity_judge) as server:
        client = JudgeClient(server.base_url, "judge-model", **FAST)
        rows, report = judge_steps(client, samples, answers_for(samples))
        prompts = server.prompts()
        bodies = list(server.requests)
    assert [r["labels"] for r in rows] == [[1.0, 0.0], [1.0, 0.0, 1.0], [1.0, 0.0], [1.0, 0.0]]
    first, second = samples[0]["id"], samples[1]["id"]
    assert [r["id"] for r in rows] == [f"{first}#1", f"{first}#2", f"{first}#3", f"{second}#1"]
    assert [r["group"] for r in rows] == [first] * 3 + [second]
    # 2+3 distinct steps of the first sample's answers; the second sample's question differs: 2 more
    assert report["requests"] == 7 == len(prompts) and report["ungraded"] == 0 and report["with_steps"] == 4
    step3 = next(p for p in prompts if "Step 3:" in p)
    assert "Step 1: 8\nStep 2: 7\nStep 3: 6" in step3 and f"Reference answer: {samples[0]['solution']}" in step3
    assert samples[0]["problem"] in step3
    parts = bodies[0]["messages"][-1]["content"]
    assert any(p.get("type") == "image_url" for p in parts)  # the image goes with every step
    good, skipped = check_step_rows(rows, "lines", "think")
    assert len(good) == 4 and skipped == 0


def test_an_answer_with_an_ungraded_step_is_left_out_and_counted():
    samples = make_task("shapes_count", 2, "train", seed=0)
    with JudgeServer(reply=parity_judge, rules={"Step 3: 6": "500"}) as server:
        client = JudgeClient(server.base_url, "judge-model", **FAST)
        rows, report = judge_steps(client, samples, answers_for(samples))
    assert [r["labels"] for r in rows] == [[1.0, 0.0]] * 3  # the 8/7/6 answer is gone, not labelled 0
    assert report["ungraded"] == 1 and "500" in report["error"]


def test_a_graded_judge_gives_soft_labels():
    samples = make_task("shapes_count", 1, "train", seed=0)

    def graded(prompt: str):  # P(RELEVANT) at the deciding token: 0.3 / (0.3 + 0.6) for odd, 0.6 / 0.9 for even
        odd = int(last_step(prompt)) % 2
        first, second = (("IR", 0.6), ("RE", 0.3)) if odd else (("RE", 0.6), ("IR", 0.3))
        tag = "IRRELEVANT" if odd else "RELEVANT"
        return f"[{tag}]", [entry("[", 1.0, ("x", 1e-9)), entry(first[0], first[1], second),
                            entry(tag[2:] + "]", 1.0, ("x", 1e-9))]

    with JudgeServer(reply=graded) as server:
        client = JudgeClient(server.base_url, "judge-model", graded=True, **FAST)
        rows, _ = judge_steps(client, samples, [["<think>2\n3</think><answer>1</answer>"]])
    assert rows[0]["labels"] == pytest.approx([2 / 3, 1 / 3])


def test_the_cli_needs_the_judges_model_name(capsys):
    from vlmrl.cli import main

    assert main(["rm", "label", "--policy", "x", "--data", "{task: digits_sum, n: 2}", "--out", "x.jsonl",
                 "--judge", "http://127.0.0.1:1/v1"]) != 0
    assert "--judge needs --judge-model" in capsys.readouterr().err
    assert main(["rm", "label", "--policy", "x", "--data", "{task: digits_sum, n: 2}", "--out", "x.jsonl",
                 "--judge", "http://127.0.0.1:1/v1", "--judge-model", "m", "--completer", "y"]) != 0
    assert "--completer continues the steps to label them and --judge grades them" in capsys.readouterr().err
