"""`evaluate` with n answers per prompt on the tiny model: the summary agrees with its own records."""

import json

import pytest

from vlmrl.data import make_task
from vlmrl.eval.generative import evaluate
from vlmrl.eval.metrics import mean_pass_at_k


@pytest.fixture(scope="module")
def mixed_samples():
    return make_task("shapes_count", 5, "test", seed=0) + make_task("shapes_color", 4, "test", seed=0)


def test_n_samples_per_prompt_metrics_agree_with_records(policy, mixed_samples):
    res = evaluate(policy, mixed_samples, temperature=1.0, n=4, ks=(1, 2, 4, 8), max_new_tokens=6, batch_size=12,
                   seed=3)
    m, records = res["metrics"], res["records"]
    assert len(records) == 9 and all(len(r["answers"]) == 4 for r in records)
    correct = [r["answers_correct"] for r in records]
    assert m["pass@1"] == pytest.approx(m["accuracy"]) and m["mean@4"] == m["accuracy"]
    assert m["accuracy"] == pytest.approx(sum(map(sum, correct)) / 36)
    assert m["pass@2"] == pytest.approx(mean_pass_at_k(correct, 2))
    assert m["pass@4"] == pytest.approx(sum(any(c) for c in correct) / 9)  # n == k: any of the n
    assert "pass@8" not in m  # k > n is not reported
    assert m["maj@4"] == pytest.approx(sum(r["vote"] for r in records) / 9)
    assert m["n"] == 9 and m["samples_per_prompt"] == 4
    assert m["mean_length"] == pytest.approx(sum(sum(r["lengths"]) for r in records) / 36)
    assert 0.0 <= m["truncated_share"] <= 1.0
    # a per-task breakdown, also flattened into the metrics when there is more than one task
    assert set(res["per_task"]) == {"shapes_count", "shapes_color"}
    assert res["per_task"]["shapes_count"]["n"] == 5 and m["task/shapes_color/n"] == 4
    pooled = (5 * res["per_task"]["shapes_count"]["accuracy"] + 4 * res["per_task"]["shapes_color"]["accuracy"]) / 9
    assert pooled == pytest.approx(m["accuracy"])
    assert res["reflection"]["counts"]["answers"] == 36
    assert set(res["reflection"]["ratios"]) == {"share", "share_correct", "share_incorrect", "accuracy_reflective",
                                                "accuracy_nonreflective"}


def test_greedy_takes_one_answer_and_is_deterministic(policy, mixed_samples):
    a = evaluate(policy, mixed_samples[:4], temperature=0.0, n=8, ks=(1, 4), max_new_tokens=6)
    b = evaluate(policy, mixed_samples[:4], temperature=0.0, max_new_tokens=6, batch_size=2)
    assert a["metrics"]["samples_per_prompt"] == 1 and "pass@4" not in a["metrics"]
    assert [r["answers"] for r in a["records"]] == [r["answers"] for r in b["records"]]
    assert a["metrics"]["accuracy"] == b["metrics"]["accuracy"] and "task/shapes_count/n" not in a["metrics"]


def test_empty_eval_set_is_an_error(policy):
    with pytest.raises(ValueError, match="no samples"):
        evaluate(policy, [], temperature=0.0)


def test_eval_cli_temperatures_pass_at_k_tasks_and_reflection(tiny_model_dir, tmp_path, capsys):
    from vlmrl.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", str(tiny_model_dir), "eval.max_new_tokens=6", "--data", "shapes_color", "--n", "4",
                 "--samples", "3", "--k", "1", "2", "--temperatures", "0", "1.0", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert list(res) == ["T=0.0", "T=1.0"]
    assert res["T=0.0"]["samples_per_prompt"] == 1 and "pass@2" not in res["T=0.0"]
    t1 = res["T=1.0"]
    assert t1["samples_per_prompt"] == 3 and {"pass@1", "pass@2", "mean@3", "maj@3"} <= set(t1)
    assert t1["per_task"]["shapes_color"]["n"] == 4 and t1["reflection"]["counts"]["answers"] == 12
    assert "pass@2" in printed and "reflection (pooled)" in printed
    # the tiny model writes no reflection words: accuracy among reflective answers is undefined, not 0
    assert t1["reflection"]["ratios"]["accuracy_reflective"] is None and "undefined" in printed
