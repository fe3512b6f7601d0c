"""On-policy distillation (vlmrl/trainer/distill.py): the per-token reverse-KL advantage worked by hand, a teacher
equal to the student's start that changes nothing, a different teacher that moves the advantages, and the refusal
of a teacher with another vocabulary before any step."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TEST_MODEL
from tests.test_train_e2e import SMALL
from vlmrl.cli import main
from vlmrl.data import vocabulary_texts
from vlmrl.errors import ConfigError
from vlmrl.models import build_tiny_vlm
from vlmrl.trainer.distill import check_same_vocabulary, distill_advantages


def test_the_reverse_kl_advantage_by_hand():
    # two answers of two tokens, the second answer one token long; the reward's advantages +1 and -1
    student = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    teacher = torch.tensor([[-1.5, -1.0], [-0.5, -3.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, metrics = distill_advantages(torch.tensor([1.0, -1.0]), student, teacher, mask, coef=0.5)
    # student - teacher on answer tokens: [[0.5, -1.0], [0.0, (padding)]]; advantage - 0.5 x that
    assert adv.tolist() == [[0.75, 1.5], [-1.0, 0.0]]
    assert metrics["distill/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    assert metrics["distill/teacher_logprob"] == pytest.approx((-1.5 - 1.0 - 0.5) / 3)
    # per-token advantages (reinforce_pp, gae) take the same term; coef 0 leaves them as they were
    per_token = torch.tensor([[0.2, 0.1], [0.3, 0.0]])
    assert torch.allclose(distill_advantages(per_token, student, teacher, mask, coef=1.0)[0],
                          torch.tensor([[-0.3, 1.1], [0.3, 0.0]]))
    assert distill_advantages(per_token, student, teacher, mask, coef=0.0)[0].tolist() == per_token.tolist()


class Vocab:
    def __init__(self, vocab: dict[str, int]):
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_a_teacher_is_refused_unless_it_splits_text_into_the_same_ids():
    check_same_vocabulary(Vocab({"a": 0, "b": 1}), Vocab({"b": 1, "a": 0}), "distill.teacher T")
    for other in ({"a": 0, "b": 1, "c": 2}, {"a": 1, "b": 0}):  # another size; the same tokens, other ids
        with pytest.raises(ConfigError, match="distill.teacher T: the teacher's tokenizer is not the student's"):
            check_same_vocabulary(Vocab({"a": 0, "b": 1}), Vocab(other), "distill.teacher T")


def steps(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "train"]


def test_a_teacher_equal_to_the_start_changes_nothing_and_another_one_moves_the_update(tmp_path):
    # answers of varied length, the length penalty over all of them: groups whose rewards differ, a loss that moves
    base = ["train", *SMALL, "trainer.steps=2", "algorithm.dynamic_sampling=false", "algorithm.overlong_filter=false",
            "rewards=[{name: accuracy}, {name: length, kwargs: {max_length: 12, cache_length: 12}}]", "sft.steps=30",
            "rollout.max_new_tokens=12", "rollout.group_size=4"]
    plain, same, other = tmp_path / "plain", tmp_path / "same", tmp_path / "other"
    assert main([*base, f"trainer.output_dir={plain}"]) == 0
    # the same seed and data make the same SFT start: a teacher equal to the student at step 1
    assert main([*base, f"trainer.output_dir={same}", f"distill.teacher={plain / 'checkpoint-0'}"]) == 0
    first, twin = steps(plain)[0], steps(same)[0]
    assert twin["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-6)
    assert abs(first["loss"]) > 1e-3  # (the rewards differ: a loss to compare)
    assert twin["loss"] == pytest.approx(first["loss"], abs=1e-6)  # the reward's advantages, per token
    # a teacher that is not the start: a model trained with more SFT
    teacher = tmp_path / "teacher"
    assert main([*base, f"trainer.output_dir={teacher}", "sft.steps=60", "trainer.steps=1"]) == 0
    assert main([*base, f"trainer.output_dir={other}", f"distill.teacher={teacher}", "distill.coef=2.0"]) == 0
    moved = steps(other)
    assert all(abs(r["distill/reverse_kl"]) > 1e-4 and r["distill/teacher_logprob"] < 0 for r in moved)
    assert moved[0]["loss"] != pytest.approx(first["loss"], abs=1e-6)


def test_vlmrl_train_refuses_a_teacher_with_another_vocabulary_before_a_step(tmp_path, capsys):
    other = build_tiny_vlm(tmp_path / "other", vocabulary_texts(0),
                           type(TEST_MODEL)(**{**vars(TEST_MODEL), "vocab_size": 300}), seed=0)
    run = tmp_path / "run"
    assert main(["train", *SMALL, "trainer.steps=1", "sft.steps=0", f"trainer.output_dir={run}",
                 f"distill.teacher={other}"]) == 2
    assert "the teacher's tokenizer is not the student's" in capsys.readouterr().err
    assert not run.exists()  # refused before a training step: the run directory is removed


def test_distillation_alone_trains_on_the_teacher_and_refuses_what_needs_a_reward(tmp_path, capsys):
    """No reward of positive weight: the teacher grades every answer (no coverage refusal, no no-signal warnings),
    the rewards' advantages are 0, and the update moves only by the teacher; dynamic sampling and the solved filters
    would keep nothing, so they are refused, as DPO and gae are."""
    from vlmrl.config import QUICKSTART, load_config

    alone = ["rewards=[{name: accuracy, weight: 0.0}]", "algorithm.dynamic_sampling=false",
             "curriculum.filter_solved=false", "curriculum.filter_unsolved=false"]
    with pytest.raises(ConfigError, match="distillation alone"):  # the quickstart samples dynamically
        load_config(QUICKSTART, ["distill.teacher=somewhere", "rewards=[{name: accuracy, weight: 0.0}]"])
    with pytest.raises(ConfigError, match="does not apply to DPO"):
        load_config(None, ["distill.teacher=somewhere", "algorithm.policy_loss=dpo"])
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    base = ["train", *SMALL, "algorithm.overlong_filter=false", "rollout.max_new_tokens=12", "rollout.group_size=4",
            "trainer.no_signal_steps=1"]
    assert main([*base, f"trainer.output_dir={teacher}", "sft.steps=60", "trainer.steps=1"]) == 0
    capsys.readouterr()
    assert main([*base, "sft.steps=30", "trainer.steps=2", f"trainer.output_dir={student}",
                 f"distill.teacher={teacher}", *alone]) == 0
    err = capsys.readouterr().err
    assert "ungraded" not in err and "no learning signal" not in err, err
    rows = steps(student)
    assert all(r["reward/total/std"] == 0 and abs(r["loss"]) > 1e-4 and r["grad_norm"] > 0 for r in rows)
