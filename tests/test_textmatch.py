"""Free-form answer rewards (exact_match, token_f1, bleu, rouge_l) against values worked by hand on tiny strings."""

from __future__ import annotations

import importlib.util
import math

import pytest

from vlmrl.errors import ConfigError
from vlmrl.rewards import RewardSpec, compute_rewards, registry
from vlmrl.rewards.textmatch import (
    bleu,
    bleu_reward,
    exact_match_reward,
    normalize_answer,
    rouge_l,
    rouge_l_reward,
    token_f1,
    token_f1_reward,
)


def answer(text: str) -> str:
    return f"<answer>{text}</answer>"


@pytest.mark.parametrize(("text", "normal"), [
    ("The Cat, sat.", "cat sat"),  # case, punctuation, articles
    ("U.S.A.", "usa"),  # punctuation first, then articles: the "a" of U.S.A. is no article
    ("don't", "dont"),
    ("an apple  a day", "apple day"),
    ("the", "the"),  # only articles: kept, so "the" is not the empty answer
    ("\\boxed{Paris}", "paris"),
    ("\\text{The Eiffel Tower.}", "eiffel tower"),
    ("\u201cQuoted\u201d", "quoted"),
    ("北京。", "北京"),
    ("  .", ""),
])
def test_normalize_answer(text, normal):
    assert normalize_answer(text) == normal


def test_token_f1_by_hand():
    # [cat, sat] vs [cat, sat, down]: 2 shared, p = 2/2, r = 2/3, F1 = 2 * 1 * 2/3 / (1 + 2/3) = 0.8
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(0.8)
    # multisets: [cat, cat] vs [cat] share 1, p = 1/2, r = 1, F1 = 2/3 (repeating a word does not pay twice)
    assert token_f1("cat cat", "cat") == pytest.approx(2 / 3)
    assert token_f1("sat cat down", "cat sat down") == 1.0  # order does not count
    assert token_f1("dog", "cat") == 0.0


def test_rouge_l_by_hand():
    # LCS of [sat, cat, down] and [cat, sat, down] is 2 ("cat down"): P = R = 2/3, F = 2/3 (order counts)
    assert rouge_l("sat cat down", "cat sat down") == pytest.approx(2 / 3)
    assert rouge_l("the cat sat", "a cat sat down") == pytest.approx(0.8)  # LCS 2: P = 1, R = 2/3
    # any script: [北京, 上海] vs [北京], LCS 1, P = 1/2, R = 1, F = 2/3 (rouge-score's own tokenizer drops them)
    assert rouge_l("北京 上海", "北京") == pytest.approx(2 / 3)


def test_bleu_by_hand():
    # hypothesis a b c d, reference a b c d e: every n-gram precision 1 (4/4, 3/3, 2/2, 1/1),
    # brevity penalty exp(1 - 5/4)
    assert bleu("a b c d", "a b c d e") == pytest.approx(math.exp(-0.25))
    # a b c e vs a b c d: p = 3/4, 2/3, 1/2, 0/1; exp smoothing makes the zero 1 / (2 * 1); BP = 1
    assert bleu("a b c e", "a b c d") == pytest.approx((3 / 4 * 2 / 3 * 1 / 2 * 1 / 2) ** 0.25)
    assert bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert bleu("A B C D", "a b c d") == 0.0 and bleu("A B C D", "a b c d", lowercase=True) == pytest.approx(1.0)


def test_references_list_max_and_missing():
    completions = [answer("The cat sat"), answer("cat sat"), answer("Paris"), answer("Paris"), answer("Paris")]
    solutions = [["dog", "a cat sat down"], "the dog", [None, "paris"], None, ["", "  ."]]
    assert token_f1_reward(completions, solutions) == [pytest.approx(0.8), 0.0, 1.0, None, None]
    assert exact_match_reward(completions, solutions) == [0.0, 0.0, 1.0, None, None]


def test_reference_column_for_data_files():
    # a data file's solution is one string: a list of references lives in a column of its own
    out = exact_match_reward([answer("City of Paris")], ["Paris"], reference_column="references",
                             references=[["Paris", "the city of Paris"]])
    assert out == [1.0]
    with pytest.raises(ValueError, match="no such column"):
        exact_match_reward([answer("Paris")], ["Paris"], reference_column="refs")


def test_selection_is_accuracys_and_exploits_pay_nothing():
    completions = [
        "<think>maybe <answer>cat sat down</answer></think><answer>dog</answer>",  # a draft in the reasoning
        answer("cat sat down") + "</answer>",  # the repeated closing tag hack (strict format)
        answer("the"),  # only an article
        answer("."),  # no words
        answer(""),
        answer("cat sat down"),  # truncated below: strict pays 0
    ]
    truncated = [False] * 5 + [True]
    for reward in (exact_match_reward, token_f1_reward, bleu_reward, rouge_l_reward):
        assert reward(completions, ["cat sat down"] * 6, completion_truncated=truncated) == [0.0] * 6
    assert token_f1_reward(completions[-1:], ["cat sat down"], strict=False, completion_truncated=[True]) == [1.0]
    # [final, cat, sat] vs [cat, sat, down]: p = r = 2/3, so F1 = 2/3
    assert token_f1_reward(["Final: cat sat"], ["cat sat down"], extract="last_line", strict=False) == [
        pytest.approx(2 / 3)]


def test_registered_and_scored_as_components():
    specs = [RewardSpec(name) for name in ("exact_match", "token_f1", "bleu", "rouge_l")]
    specs.append(RewardSpec("bleu", kwargs={"lowercase": True}, label="bleu_lower"))
    out = compute_rewards(specs, [answer("A B C D"), answer("x")], {"solution": ["a b c d", "y"]})
    assert out.components["token_f1"] == [1.0, 0.0] and out.components["exact_match"] == [1.0, 0.0]
    assert out.components["bleu"] == [0.0, 0.0] and out.components["bleu_lower"] == [pytest.approx(1.0), 0.0]
    assert out.components["rouge_l"] == [1.0, 0.0] and not out.errors


def test_a_missing_package_is_a_config_error_up_front(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sacrebleu" else real(name, *a))
    with pytest.raises(ConfigError, match=r"reward 'bleu' needs the sacrebleu package.*pip install 'vlmrl\[text\]'"):
        registry.check_specs([RewardSpec("token_f1"), RewardSpec("bleu")])
    with pytest.raises(ConfigError, match="vlmrl\\[text\\]"):
        bleu_reward([answer("a")], ["a"])
    registry.check_specs([RewardSpec("token_f1"), RewardSpec("rouge_l")])  # the others need nothing missing
