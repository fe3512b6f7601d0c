"""`evaluate` with n answers per prompt on the tiny model: the summary (accuracy, each reward component, reasoning
and compute) agrees with its own records; `vlmrl eval --samples-out` writes every sample."""

import json

import pytest
import torch

from vlmrl.data import make_task
from vlmrl.eval.generative import evaluate
from vlmrl.eval.metrics import mean_pass_at_k
from vlmrl.eval.reasoning import split_reasoning
from vlmrl.rewards import REWARDS, RewardSpec


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


def column_score(completions, *, score, **_):
    """The sample's `score` column: a number, "nan" (a failure: NaN is not a score) or None (does not apply)."""
    return [None if s is None else float(s) for s in score]


def test_each_reward_component_is_kept_and_failures_are_left_out(policy, monkeypatch):
    """Four samples scored 0.25, 0.75, NaN (failed) and None (does not apply): reward/test_column_score is the mean of
    the two scores, the failure is counted, and the failed sample has no total."""
    samples = [dict(s, score=v) for s, v in zip(make_task("shapes_count", 4, "test", seed=0),
                                                  [0.25, 0.75, "nan", None], strict=True)]
    monkeypatch.setitem(REWARDS, "test_column_score", column_score)
    specs = [RewardSpec("accuracy"), RewardSpec("test_column_score", isolate=False)]
    res = evaluate(policy, samples, temperature=0.0, max_new_tokens=6, rewards=specs, batch_size=3)
    m, records = res["metrics"], res["records"]
    assert m["reward/test_column_score"] == pytest.approx((0.25 + 0.75) / 2)
    assert m["reward/test_column_score/failures"] == 1.0 and m["reward/accuracy/failures"] == 0.0
    assert m["reward_failed_samples"] == 1.0 and records[2]["rewards"] == [None]
    acc = [float(r["answers_correct"][0]) for r in records]  # the strict accuracy reward: 1 right, 0 wrong
    assert m["reward/accuracy"] == pytest.approx(sum(acc) / 4)
    assert m["mean_reward"] == pytest.approx((acc[0] + 0.25 + acc[1] + 0.75 + acc[3]) / 3)  # sample 2 left out
    assert res["per_task"]["shapes_count"]["reward/test_column_score"] == pytest.approx(0.5)


def test_reasoning_and_compute_metrics_agree_with_records(policy, mixed_samples):
    res = evaluate(policy, mixed_samples, temperature=1.0, n=3, max_new_tokens=6, seed=1)
    m, records = res["metrics"], res["records"]
    tok = policy.processor.tokenizer
    chains = [t for r in records for t in r["reasoning_tokens"]]
    parts = [split_reasoning(a)[0] for r in records for a in r["answers"]]
    assert len(chains) == 27 and chains == [  # the policy's tokens of each answer's reasoning, None without a block
        None if p is None else len(tok(p, add_special_tokens=False)["input_ids"]) for p in parts]
    present = [c for c in chains if c is not None]
    assert m["reasoning/block_share"] == pytest.approx(len(present) / 27)
    assert m["reasoning/length"] == (pytest.approx(sum(present) / len(present)) if present else None)
    right = sum(map(sum, (r["answers_correct"] for r in records)))
    tokens = sum(map(sum, (r["lengths"] for r in records)))
    assert m["tokens_per_correct"] == (pytest.approx(tokens / right) if right else None)
    assert m["compute/seconds_per_1k_rollouts"] > 0 and "compute/gpu_seconds_per_1k_rollouts" not in m  # CPU
    assert res["backtracking"]["counts"]["answers"] == 27
    assert set(res["backtracking"]["ratios"]) == set(res["reflection"]["ratios"])
    assert m["backtracking/share"] == res["backtracking"]["ratios"]["share"]


def test_eval_cli_samples_out_holds_every_sample(tiny_model_dir, tmp_path):
    """--samples-out: one line per sample and temperature, every field present, images saved beside the file, and
    the lines agree with the --out metrics."""
    from PIL import Image

    from vlmrl.cli import main
    from vlmrl.eval.samples import ANSWER_FIELDS, SAMPLE_FIELDS, read_samples

    path, out = tmp_path / "answers.jsonl", tmp_path / "eval.json"
    assert main(["eval", str(tiny_model_dir), "eval.max_new_tokens=6", "--data", "shapes_color", "--n", "5",
                 "--samples", "3", "--temperatures", "0", "1.0", "--samples-out", str(path), "--out", str(out)]) == 0
    lines = read_samples(path)
    raw = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines == raw and len(lines) == 5 * 2  # 5 samples x 2 temperatures, round-tripped
    assert [x["temperature"] for x in lines] == [0.0] * 5 + [1.0] * 5
    assert len({x["id"] for x in lines}) == 5 and {x["task"] for x in lines} == {"shapes_color"}
    for x in lines:
        assert set(SAMPLE_FIELDS) <= set(x) and x["problem"] and x["solution"]
        assert len(x["answers"]) == (1 if x["temperature"] == 0 else 3)
        for a in x["answers"]:
            assert set(ANSWER_FIELDS) <= set(a) and {"reflection", "backtracking"} <= set(a)
            assert set(a["components"]) == {"accuracy"} and a["reward"] == a["components"]["accuracy"]
        assert Image.open(path.parent / x["images"][0]).size[0] > 0
    res = json.loads(out.read_text())
    for label, temperature in (("T=0.0", 0.0), ("T=1.0", 1.0)):
        answers = [a for x in lines if x["temperature"] == temperature for a in x["answers"]]
        assert res[label]["accuracy"] == pytest.approx(sum(a["correct"] for a in answers) / len(answers))
        assert res[label]["truncated_share"] == pytest.approx(sum(a["truncated"] for a in answers) / len(answers))
        assert res[label]["reward/accuracy"] == pytest.approx(sum(a["reward"] for a in answers) / len(answers))


def test_samples_file_names_image_files_and_saves_images_in_memory(tmp_path):
    """A file's image is referenced by its own path (not copied); an image in memory is saved once beside the file;
    a line missing a field is an error naming the file and line."""
    from PIL import Image

    from vlmrl.data import LazyImages
    from vlmrl.errors import DataError
    from vlmrl.eval.samples import read_samples, write_samples

    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    samples = [{"id": "a/1", "images": LazyImages([str(tmp_path / "a.png")])},
               {"id": "b", "images": [Image.new("RGB", (8, 8), "blue")]}, {"id": "c"}]
    record = lambda i: {"id": samples[i]["id"], "task": "t", "problem": "q", "solution": "3",  # noqa: E731
                        "answers": ["<answer>3</answer>", "x"], "answers_correct": [True, False],
                        "truncated": [False, True], "lengths": [4, 6], "reasoning_tokens": [None, None],
                        "rewards": [1.0, None], "components": {"accuracy": [1.0, None]},
                        "markers": {"backtracking": [False, True]}}
    path = tmp_path / "out" / "answers.jsonl"
    assert write_samples(path, [(0.5, {"records": [record(i) for i in range(3)]})], samples, step=7) == 3
    lines = read_samples(path)
    assert [x["images"] for x in lines] == [[str(tmp_path / "a.png")], ["answers_images/1-b-0.png"], []]
    assert Image.open(path.parent / lines[1]["images"][0]).getpixel((0, 0)) == (0, 0, 255)
    assert lines[0]["accuracy"] == 0.5 and lines[0]["step"] == 7 and lines[0]["temperature"] == 0.5
    assert lines[0]["answers"][1] == {"text": "x", "correct": False, "truncated": True, "length": 6, "reward": None,
                                      "components": {"accuracy": None}, "reasoning_tokens": None,
                                      "backtracking": True}
    path.write_text(path.read_text() + '{"id": "d"}\n')
    with pytest.raises(DataError, match=r"answers.jsonl line 4: no task"):
        read_samples(path)


def test_reasoning_metrics_of_crafted_answers(policy, monkeypatch):
    """`evaluate` on answers written by hand (generation replaced, tokens counted as words), over two generation
    calls (batch_size 3 of 4 samples):

        s0 <think>two and one. Wait, three</think><answer>right</answer>  12 tokens, right, reasoning 5, backtracks
        s1 <answer>99</answer>                                             5 tokens, wrong, no block
        s2 <think>actually unsure                                         20 tokens, cut off, reasoning 2, backtracks
        s3 <answer>right</answer>                                          4 tokens, right, no block

    reasoning/length = (5 + 2) / 2, block_share = 2/4, tokens_per_correct = 41 / 2, backtracking/share = 2/4."""
    import vlmrl.eval.generative as generative
    from vlmrl.rollout.generate import Rollout

    samples = make_task("shapes_count", 4, "test", seed=0)
    crafted = {samples[0]["id"]: (f"<think>two and one. Wait, three</think><answer>{samples[0]['solution']}</answer>",
                                  12, False),
               samples[1]["id"]: ("<answer>99</answer>", 5, False),
               samples[2]["id"]: ("<think>actually unsure", 20, True),
               samples[3]["id"]: (f"<answer>{samples[3]['solution']}</answer>", 4, False)}

    def fake_generate(policy, prompts, n, max_new_tokens, temperature, generator=None):
        rows = [crafted[i] for i in prompts.sample_ids]
        mask = torch.tensor([[1] * k + [0] * (20 - k) for _, k, _ in rows])
        return Rollout(torch.arange(len(rows)), torch.zeros_like(mask), mask, torch.zeros(mask.shape),
                       torch.tensor([t for _, _, t in rows]), [text for text, _, _ in rows])

    monkeypatch.setattr(generative, "generate", fake_generate)
    monkeypatch.setattr(generative, "token_counter", lambda tokenizer: lambda texts: [len(t.split()) for t in texts])
    res = evaluate(policy, samples, temperature=0.0, batch_size=3)
    m = res["metrics"]
    assert [r["reasoning_tokens"] for r in res["records"]] == [[5], [None], [2], [None]]
    assert [r["correct"] for r in res["records"]] == [True, False, False, True]
    assert [r["markers"]["backtracking"] for r in res["records"]] == [[True], [False], [True], [False]]
    assert m["reasoning/length"] == pytest.approx(3.5) and m["reasoning/block_share"] == pytest.approx(0.5)
    assert m["tokens_per_correct"] == pytest.approx(20.5) and m["mean_length"] == pytest.approx(41 / 4)
    assert m["truncated_share"] == pytest.approx(0.25)
    assert m["backtracking/share"] == pytest.approx(0.5) and m["backtracking/accuracy_reflective"] == pytest.approx(0.5)
    assert m["reflection/share"] == pytest.approx(0.25)  # "wait" is on MAYE's list too; "actually" is not


@pytest.mark.parametrize("on_benchmark", [False, True])
def test_eval_loads_the_model_with_the_recipes_autocast(tiny_model_dir, tmp_path, monkeypatch, on_benchmark):
    """`vlmrl eval` (and `--benchmark`) load the model as training and serving do: with `model.autocast` (it was
    dropped, so a recipe's autocast=false still evaluated under bf16 autocast on CUDA)."""
    import vlmrl.models
    from vlmrl.cli import main

    seen = []

    def refuse(*args, **kwargs):
        seen.append(args[5] if len(args) > 5 else kwargs.get("autocast"))
        raise SystemExit(0)  # enough: the arguments are what this test reads

    monkeypatch.setattr(vlmrl.models, "load_policy", refuse)
    from tests import hub_fixtures

    bench = ["--benchmark", "mathvista", "--data", str(hub_fixtures.BUILDERS["mathvista"](tmp_path))]
    args = ["eval", str(tiny_model_dir), "model.autocast=false"] + (bench if on_benchmark else [])
    with pytest.raises(SystemExit):
        main(args)
    assert seen == [False]
