"""Process reward models (issue 55 item 2): steps and where a PRM reads them, the per-step loss and the Math-Shepherd
step labels worked by hand, `vlmrl rm train data.steps` on labels visible in the text, the PRM as a reward, and the
refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vlmrl.data import make_task
from vlmrl.errors import ConfigError, DataError
from vlmrl.models import load_policy
from vlmrl.models.reward_model import REWARD_MODEL_FILE, RewardModel, aggregate_steps, step_token_ends
from vlmrl.rewards import RewardSpec, compute_rewards
from vlmrl.rewards.reasoning import step_spans
from vlmrl.trainer import prm_labels
from vlmrl.trainer.prm import check_step_rows, process_loss, step_classification
from vlmrl.trainer.rm import load_rm_config


def test_step_spans_in_think_blocks_and_outside_the_answer():
    text = "<think>3\n 5 \n\n</think><answer>8</answer>"
    assert [text[a:b] for a, b in step_spans(text)] == ["3", "5"]
    bare = "red\nblue.\n<answer>2</answer>\nafter"
    assert [bare[a:b] for a, b in step_spans(bare)] == ["red", "blue.", "after"]
    two = "<think>a. b</think> x <think>c</think><answer>1</answer>"
    assert [two[a:b] for a, b in step_spans(two, "sentences")] == ["a.", "b", "c"]
    assert step_spans("<answer>8</answer>") == []


def test_a_step_is_read_at_the_token_holding_its_last_character(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    tok = policy.processor.literal_tokenizer
    text = "<think>red\nblue circle</think><answer>3</answer>"
    spans = step_spans(text)
    (ends,) = step_token_ends(policy, [text], [spans])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for (a, b), end in zip(spans, ends, strict=True):
        assert text[a:b] in tok.decode(ids[:end + 1])  # the step is complete at its end token ...
        assert text[a:b] not in tok.decode(ids[:end])  # ... and one token earlier it is not


def test_process_loss_and_gradient_by_hand():
    z = torch.tensor([0.0, math.log(3.0)], requires_grad=True)  # sigmoid: 0.5, 0.75
    loss = process_loss([z[:1], z[1:]], [[1.0], [0.5]])
    # BCE(0.5 | 1) = ln 2 = 0.693147; BCE(0.75 | 0.5) = -(0.5 ln 0.75 + 0.5 ln 0.25) = 0.836988; mean 0.765068
    assert loss.item() == pytest.approx(0.765068, abs=1e-6)
    loss.backward()
    assert z.grad.tolist() == pytest.approx([(0.5 - 1.0) / 2, (0.75 - 0.5) / 2])


def test_aggregates_by_hand():
    p = [0.9, 0.5, 0.8]
    assert aggregate_steps(p, "min") == 0.5
    assert aggregate_steps(p, "product") == pytest.approx(0.36)
    assert aggregate_steps(p, "last") == 0.8
    assert aggregate_steps(p, "mean") == pytest.approx(2.2 / 3)
    assert aggregate_steps([], "min") is None


def test_step_classification_by_hand():
    # labels: right, wrong, wrong, right; predictions: right, wrong, right, wrong
    out = step_classification([0.9, 0.2, 0.7, 0.1], [1.0, 0.0, 0.25, 0.75])
    assert out["step_accuracy"] == 0.5
    assert out["error_precision"] == 0.5 and out["error_recall"] == 0.5 and out["error_f1"] == 0.5


def test_math_shepherd_labels_on_a_toy_tree(monkeypatch):
    """Answer '<think>2\\n3</think><answer>5</answer>' to 'sum?' (solution 5): from '<think>2' two of four
    continuations reach 5 (label 0.5, hard 1); from '<think>2\\n3' three of four do (0.75); from '<think>9' (another
    answer's first step) none does (0, hard 0). An answer without steps gets no row."""
    tree = {
        "<think>2": ["\n3</think><answer>5</answer>", "\n4</think><answer>6</answer>",
                     "\n3</think><answer>5</answer>", "\n1</think><answer>3</answer>"],
        "<think>2\n3": ["</think><answer>5</answer>"] * 3 + ["</think><answer>6</answer>"],
        "<think>9": ["\n3</think><answer>12</answer>"] * 4,
        "<think>9\n3": ["</think><answer>12</answer>"] * 4,
    }
    monkeypatch.setattr(prm_labels, "continuation_prompts", lambda policy, samples, prefixes, template: prefixes)

    def fake_generate(policy, prefixes, m, max_new_tokens, temperature, generator=None):
        texts = [t for p in prefixes for t in tree[p][:m]]
        return SimpleNamespace(prompt_index=torch.arange(len(prefixes)).repeat_interleave(m), texts=texts,
                               truncated=torch.zeros(len(texts), dtype=torch.bool))

    monkeypatch.setattr(prm_labels, "generate", fake_generate)
    policy = SimpleNamespace(sampling=lambda: __import__("contextlib").nullcontext())
    sample = {"id": "s", "problem": "sum?", "solution": "5", "answer_type": "number"}
    answers = [["<think>2\n3</think><answer>5</answer>", "<think>9\n3</think><answer>12</answer>",
                "<answer>5</answer>"]]
    rows = prm_labels.label_steps(policy, [sample], answers, continuations=4, chunk=3)
    assert [r["labels"] for r in rows] == [[0.5, 0.75], [0.0, 0.0]]
    assert rows[0]["continuations"] == [2, 3] and rows[0]["completion"] == answers[0][0]
    hard = prm_labels.label_steps(policy, [sample], answers, continuations=4, hard=True)
    assert [r["labels"] for r in hard] == [[1.0, 1.0], [0.0, 0.0]]
    assert prm_labels.estimate_labels([[True, False, False, False], [False] * 4]) == [0.25, 0.0]


def _visible_step_file(tmp_path: Path, n: int = 48) -> Path:
    """Answers whose steps are single digits: an odd one is a wrong step (label 0), an even one right (label 1); one
    token each, so a PRM reading a step one token early cannot tell."""
    (tmp_path / "images").mkdir()
    rows = []
    patterns = [["2", "4"], ["2", "3"], ["5", "4"], ["7", "9"], ["2", "6", "1"], ["8", "7", "6"]]
    for i, s in enumerate(make_task("shapes_count", n, "train", seed=0)):
        s["images"][0].save(tmp_path / "images" / f"{i}.png")
        steps = patterns[i % len(patterns)]
        rows.append({"image": f"images/{i}.png", "problem": s["problem"], "solution": s["solution"],
                     "completion": "<think>" + "\n".join(steps) + f"</think><answer>{s['solution']}</answer>",
                     "labels": [1.0 - int(w) % 2 for w in steps]})
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def trained_prm(tmp_path_factory, tiny_model_dir):
    from tests.test_reward_model import train_small_rm

    tmp = tmp_path_factory.mktemp("prm")
    return train_small_rm(tmp, f"data.steps.path={_visible_step_file(tmp)}", tiny_model_dir, 40, 24)


def test_prm_learns_visible_step_labels_and_scores_answers_by_their_weakest_step(trained_prm):
    final = trained_prm["final"]
    assert trained_prm["heldout_pairs"] == 12
    assert final["step_accuracy"] >= 0.9 and final["error_f1"] >= 0.9, final
    info = json.loads((Path(trained_prm["checkpoint"]) / REWARD_MODEL_FILE).read_text())
    assert info["kind"] == "process" and info["process"] == {"split": "lines", "think_tag": "think",
                                                              "aggregate": "min"}
    assert info["trained"]["heldout"]["error_f1"] == final["error_f1"]
    assert RewardModel.from_pretrained(trained_prm["checkpoint"]).kind == "process"
    s = make_task("shapes_count", 1, "test", seed=5)[0]
    answers = ["<think>2\n4</think><answer>1</answer>", "<think>2\n3</think><answer>1</answer>",
               "<answer>1</answer>"]
    out = compute_rewards([RewardSpec("reward_model", kwargs={"path": trained_prm["run_dir"]})], answers,
                          {k: [s[k]] * 3 for k in ("id", "problem", "solution", "images")})
    good, bad, none = out.components["reward_model"]
    assert 0 <= bad < 0.5 < good <= 1 and none is None
    assert out.failures["reward_model"] == 1 and "no reasoning steps" in out.errors["reward_model"]


@pytest.mark.parametrize("coef", [1.0, 0.0])
def test_a_distilled_prm_follows_its_teacher_not_the_labels(trained_prm, tiny_model_dir, tmp_path, coef):
    """A process teacher (trained on the true step labels) teaches a PRM on the same answers with every label
    flipped: with distill.coef = 1 the student calls each held-out step as the teacher does (so it disagrees with the
    flipped labels), with coef = 0 it learns the flipped labels: the per-step KL is what teaches."""
    from tests.test_reward_model import train_small_rm

    rows = [json.loads(line) for line in _visible_step_file(tmp_path).read_text().splitlines()]
    flipped = tmp_path / "flipped.jsonl"
    flipped.write_text("".join(json.dumps({**r, "labels": [1.0 - v for v in r["labels"]]}) + "\n" for r in rows))
    final = train_small_rm(tmp_path, f"data.steps.path={flipped}", tiny_model_dir, 40, 24,
                           f"distill.teacher={trained_prm['run_dir']}", f"distill.coef={coef}")["final"]
    assert final["teacher_step_accuracy"] <= 0.1, final  # the teacher disagrees with the flipped labels
    if coef == 1.0:
        assert final["teacher_agreement"] >= 0.9 and final["step_accuracy"] <= 0.1, final
    else:
        assert final["teacher_agreement"] <= 0.1 and final["step_accuracy"] >= 0.9, final


def test_a_teacher_splitting_steps_otherwise_is_refused(trained_prm, tmp_path):
    from vlmrl.trainer.rm import train_reward_model

    cfg = load_rm_config(None, [f"data.steps.path={_visible_step_file(tmp_path)}", "process.split=sentences",
                                f"distill.teacher={trained_prm['run_dir']}", f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(DataError, match="splits answers into steps by .*'lines'.* this PRM by .*'sentences'"):
        train_reward_model(cfg)


def test_rm_label_continues_the_policys_answers_with_the_completer(tiny_model_dir, tmp_path, monkeypatch):
    """`vlmrl rm label --completer C`: the answers are the policy's, every continuation is C's (Math-Shepherd's
    completer); without it the policy continues its own answers."""
    import shutil

    from vlmrl.cli import main

    completer_dir = tmp_path / "completer"
    shutil.copytree(tiny_model_dir, completer_dir)
    seen = {}

    def sample(policy, samples, *args, **kwargs):
        seen["sampler"] = policy.family.model.name_or_path
        return [[("<think>1\n2</think><answer>3</answer>", False)] for _ in samples]

    def label(policy, samples, answers, *args, **kwargs):
        seen["completer"] = policy.family.model.name_or_path
        return [{**samples[0], "id": "a#1", "group": "a", "completion": answers[0][0], "labels": [1.0, 0.0],
                 "correct": True}]

    monkeypatch.setattr(prm_labels, "sample_answers", sample)
    monkeypatch.setattr(prm_labels, "label_steps", label)
    base = ["rm", "label", "--policy", str(tiny_model_dir), "--data", "{task: digits_sum, n: 2}", "--threads", "1"]
    assert main([*base, "--out", str(tmp_path / "a.jsonl"), "--completer", str(completer_dir)]) == 0
    assert seen == {"sampler": str(tiny_model_dir), "completer": str(completer_dir)}
    assert main([*base, "--out", str(tmp_path / "b.jsonl")]) == 0
    assert seen == {"sampler": str(tiny_model_dir), "completer": str(tiny_model_dir)}


def test_step_rows_are_checked_against_their_steps():
    rows = [{"id": "a", "completion": "<think>x\ny</think><answer>1</answer>", "labels": [1, 0]},
            {"id": "b", "completion": "<think>x\ny</think><answer>1</answer>", "labels": [1]},
            {"id": "c", "completion": "<answer>1</answer>", "labels": []},
            {"id": "d", "completion": "<think>x</think>", "labels": [1.5]}]
    with pytest.raises(DataError, match=r"row 'b'.*2 numbers in \[0, 1\].*data.on_error=skip"):
        check_step_rows(rows, "lines", "think")
    good, skipped = check_step_rows(rows, "lines", "think", skip=True)
    assert [r["id"] for r in good] == ["a"] and skipped == 3
    assert good[0]["labels"] == [1.0, 0.0]


def test_rm_train_takes_one_source_steps_included():
    with pytest.raises(ConfigError, match="exactly one source"):
        load_rm_config(None, ["data.steps.path=x.jsonl", "data.rollouts=runs/x"])
    assert load_rm_config(None, ["data.steps.path=x.jsonl"]).process.aggregate == "min"


def test_continuations_start_where_the_prefix_ends(tiny_model_dir):
    """The prompt a step's continuations are sampled from is the chat prompt followed by the answer's prefix: its
    last tokens are the prefix's, after the generation prompt, its images' placeholders in place."""
    policy = load_policy(tiny_model_dir)
    samples = make_task("shapes_count", 2, "train", seed=0)
    prefixes = ["<think>2", "<think>2\n3"]
    batch = prm_labels.continuation_prompts(policy, samples, prefixes)
    plain = prm_labels.make_prompts(policy, samples)
    tok = policy.processor.tokenizer
    for row, prefix in enumerate(prefixes):
        ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        base = plain.input_ids[row][plain.attention_mask[row].bool()].tolist()
        assert ids[:len(base)] == base and tok.decode(ids[len(base):]) == prefix
    assert batch.image_tokens == plain.image_tokens


def test_best_of_n_by_hand():
    from vlmrl.eval.metrics import best_of_n

    assert best_of_n([0.1, 0.9, 0.9], [False, True, False])  # the first of the tied best
    assert not best_of_n([0.9, 0.1], [False, True])
    assert best_of_n([None, 0.2, float("nan")], [False, True, False])  # unscored answers are never picked
    assert not best_of_n([None, float("nan")], [True, True])  # none scored: wrong, as every vote abstaining is


def test_weighted_vote_by_hand():
    from vlmrl.eval.metrics import weighted_vote

    keys, right = ["3", "4", "4", "3", None], [True, False, False, True, False]
    assert not weighted_vote(keys, [0.2, 0.3, 0.3, 0.1, 0.9], right)  # "4": 0.6 against "3": 0.3; None adds nothing
    assert weighted_vote(keys, [0.5, 0.3, 0.1, 0.5, 0.9], right)  # "3": 1.0 against 0.4
    assert weighted_vote(keys, [0.5, 0.25, 0.25, None, 0.0], right)  # a tie (0.5 each) goes to the key seen first
    assert not weighted_vote([None, None], [0.5, 0.5], [True, True])
    with pytest.raises(ValueError, match="negative"):
        weighted_vote(keys, [-1.0, 0, 0, 0, 0], right)


def test_write_rows_reads_back_as_user_data(tmp_path):
    from vlmrl.data import build_dataset
    from vlmrl.data.export import write_rows

    rows = make_task("digits_sum", 3, "train", seed=0)
    path = write_rows([{**r, "completion": "x"} for r in rows], tmp_path / "d" / "rows.jsonl")
    back, report = build_dataset({"path": str(path)}, "train", 0)
    assert report.loaded == 3 and [b["digits"] for b in back] == [r["digits"] for r in rows]
    assert all(b["completion"] == "x" for b in back)
    assert back[0]["images"][0].tobytes() == rows[0]["images"][0].convert("RGB").tobytes()


def test_the_logprob_term_is_the_models_own_logprob_of_what_it_scores(tiny_model_dir, tmp_path):
    """model.logprob_term: with the head at zero and the term's weight at 1 (a new RM), an outcome RM scores an
    answer with the sum of its tokens' log-probabilities (end token included) under the VLM's language model, as the
    training forward computes them (sequence_logprobs at temperature 1), and a PRM scores each step with the sum over
    that step's tokens ("7+3=10": five tokens); a trained weight and head survive a save and load."""
    from vlmrl.models.forward import sequence_logprobs
    from vlmrl.models.reward_model import answer_ids, step_token_spans
    from vlmrl.rewards.reward_model import text_step_logits
    from vlmrl.rollout.batch import make_prompts

    policy = load_policy(tiny_model_dir)
    samples = make_task("digits_sum", 2, "train", seed=0)
    texts = ["<think>7\n7+3=10</think><answer>10</answer>", "<think>4</think><answer>4</answer>"]
    ids, mask = answer_ids(policy, texts)
    with torch.no_grad():
        prompts = make_prompts(policy, samples, "{problem}")
        token_lp = sequence_logprobs(policy, prompts, torch.arange(2), ids, mask, 1.0).logprobs
        outcome = RewardModel.on(policy, logprob_term=True)
        assert outcome.score(outcome.prompts(samples), torch.arange(2), ids, mask).tolist() == pytest.approx(
            (token_lp * mask).sum(-1).tolist(), abs=1e-4)
        process = RewardModel.on(policy, process={"split": "lines", "think_tag": "think", "aggregate": "min"},
                                 logprob_term=True)
        steps = step_token_spans(policy, texts, [step_spans(t) for t in texts])
        tok = policy.processor.literal_tokenizer
        assert [tok.decode(ids[0, a:b + 1]) for a, b in steps[0]] == ["7", "7+3=10"]
        logits = text_step_logits(process, process.prompts(samples), torch.arange(2), texts)
        for n, row in enumerate(steps):
            assert logits[n].tolist() == pytest.approx([token_lp[n, a:b + 1].sum().item() for a, b in row], abs=1e-4)
        process.logprob_weight.fill_(0.5)
        process.head.bias.fill_(0.25)
        process.save_pretrained(tmp_path / "prm")
    loaded = RewardModel.from_pretrained(tmp_path / "prm")
    assert loaded.logprob_weight is not None and loaded.logprob_weight.item() == 0.5
    with torch.no_grad():
        again = text_step_logits(loaded, loaded.prompts(samples), torch.arange(2), texts)
    for n, row in enumerate(steps):
        assert again[n].tolist() == pytest.approx([0.25 + 0.5 * token_lp[n, a:b + 1].sum().item() for a, b in row],
                                                  abs=1e-4)
    assert RewardModel.on(policy).logprob_weight is None  # off unless asked: the head alone, as before
    with torch.no_grad():  # an answer without steps, batched with one that has them: no score, no error
        mixed = text_step_logits(loaded, loaded.prompts(samples), torch.arange(2), ["<answer>4</answer>", texts[0]])
    assert len(mixed[0]) == 0 and len(mixed[1]) == 2
