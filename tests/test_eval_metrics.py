"""The evaluation metrics against numbers worked by hand: pass@k, maj@n, reflection and backtracking words and ratios,
the reasoning chain, token efficiency and compute per 1,000 rollouts."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vlmrl.eval.metrics import (
    BACKTRACKING_WORDS,
    ReflectionCounts,
    answer_key,
    majority_vote,
    mean_pass_at_k,
    pass_at_k,
    reflection_words_in,
)
from vlmrl.eval.reasoning import chain_metrics, compute_metrics, reasoning_tokens, rollout_metrics, split_reasoning
from vlmrl.rewards.parsing import strip_think


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (4, 1, 1, 1 / 4),  # pass@1 is c/n
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5) = 11/12
    (8, 0, 3, 0.0),
    (5, 4, 2, 1.0),  # n - c < k: every draw of 2 holds a right answer
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_with_n_equal_k_is_any_of_n():
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(1, 1, 1) == 1.0


def test_pass_at_k_is_not_any_of_the_first_k():
    """MAYE's any-of-k scores [wrong, wrong, wrong, right, right] at k=2 as 0 (the first two are wrong); the unbiased
    estimator gives the chance that 2 of the 5 drawn at random include a right one: 1 - C(3,2)/C(5,2) = 0.7."""
    answers = [False, False, False, True, True]
    assert float(any(answers[:2])) == 0.0
    assert mean_pass_at_k([answers], 2) == pytest.approx(0.7)


def test_pass_at_k_rejects_k_above_n_and_bad_counts():
    with pytest.raises(ValueError, match="k=5 needs at least k samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_mean_pass_at_k_averages_prompts():
    # prompt 1: 1 of 4 right -> 1 - C(3,2)/C(4,2) = 1/2; prompt 2: 2 of 4 -> 1 - C(2,2)/C(4,2) = 5/6
    got = mean_pass_at_k([[True, False, False, False], [True, True, False, False]], 2)
    assert got == pytest.approx((1 / 2 + 5 / 6) / 2)
    # exact even where float products would cancel: n = 200, c = 1, k = 100 -> 1 - C(199,100)/C(200,100) = 1/2
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5, abs=1e-15)
    assert math.isclose(pass_at_k(200, 1, 1), 1 / 200)


def test_answer_key_normalises_well_formed_answers_only():
    assert answer_key("<answer>3</answer>", answer_type="number") == answer_key(" <answer>3.0</answer>", False,
                                                                                "number") == "3.0"
    assert answer_key("<answer>The Red.</answer>", answer_type="text") == "red"
    assert answer_key("<answer>3</answer></answer>", answer_type="number") is None  # the end-token hack abstains
    assert answer_key("<answer>3</answer>", truncated=True, answer_type="number") is None
    assert answer_key("3", answer_type="number") is None


def test_majority_vote():
    assert majority_vote(["3", "4", "3", None], [True, False, True, False]) is True
    assert majority_vote(["4", "3", None, None], [False, True, False, False]) is False  # a tie: the first key wins
    assert majority_vote(["3", "4", "4"], [True, False, False]) is False
    assert majority_vote([None, None], [False, False]) is False  # all abstain: wrong


def test_reflection_words_match_on_word_boundaries():
    words = ("wait", "yet", "check again", "re-check", "verify")
    assert reflection_words_in("I await the answer", words) == {}
    assert reflection_words_in("Yesterday was fine; waiting... a yeti", words) == {}
    assert reflection_words_in("Wait, WAIT. check\n again, yet", words) == {"wait": 2, "check again": 1, "yet": 1}
    assert reflection_words_in("let me re-check", words) == {"re-check": 1}


CRAFTED = [  # (answer, correct): worked out by hand below
    ("Wait, let me check again. <answer>3</answer>", True),  # reflective (wait, check again)
    ("I await the answer <answer>4</answer>", False),  # "await" is not "wait": not reflective
    ("Let me re-check: yet another look, yet <answer>2</answer>", False),  # reflective (re-check, yet x2)
    ("Yesterday was fine; waiting... <answer>5</answer>", True),  # not reflective
    ("VERIFY <answer>1</answer>", True),  # reflective (case-insensitive)
]


def test_reflection_ratios_on_a_crafted_set():
    counts = ReflectionCounts()
    flags = counts.add([t for t, _ in CRAFTED[:2]], [c for _, c in CRAFTED[:2]])
    flags += counts.add([t for t, _ in CRAFTED[2:]], [c for _, c in CRAFTED[2:]])  # pooled across batches
    assert flags == [True, False, True, False, True]
    # answers 5, correct 3, reflective 3, reflective and correct 2
    assert counts.counts() == {"answers": 5, "correct": 3, "reflective": 3, "reflective_correct": 2}
    r = counts.ratios()
    assert r["share"] == pytest.approx(3 / 5)
    assert r["share_correct"] == pytest.approx(2 / 3)
    assert r["share_incorrect"] == pytest.approx(1 / 2)
    assert r["accuracy_reflective"] == pytest.approx(2 / 3)
    assert r["accuracy_nonreflective"] == pytest.approx(1 / 2)
    freq = counts.frequencies()
    assert freq["yet"] == {"occurrences": 2, "answers": 1, "share": 1 / 5}
    assert freq["wait"]["occurrences"] == 1 and freq["check again"]["answers"] == 1 and freq["verify"]["answers"] == 1


def test_pooled_ratios_differ_from_averaged_batch_ratios():
    """Pooling counts, not averaging per-batch ratios: batch A has 1 reflective answer of 1, batch B 0 of 3.
    Pooled share 1/4; the mean of batch shares would be (1 + 0) / 2 = 1/2."""
    counts = ReflectionCounts(("wait",))
    counts.add(["wait"], [True])
    counts.add(["a", "b", "c"], [True, False, False])
    assert counts.ratios()["share"] == pytest.approx(1 / 4)


def test_empty_denominators_are_undefined_not_zero():
    counts = ReflectionCounts(("wait",))
    counts.add(["<answer>1</answer>", "<answer>2</answer>"], [True, True])
    r = counts.ratios()
    assert r["share"] == 0.0 and r["share_correct"] == 0.0
    assert r["share_incorrect"] is None  # no incorrect answers
    assert r["accuracy_reflective"] is None  # no reflective answers
    assert r["accuracy_nonreflective"] == 1.0
    assert all(v is None for v in ReflectionCounts().ratios().values())


# ------------------------------------------------------------------------------------------------ reasoning, compute


def words(texts):  # a stand-in tokenizer: one token per whitespace-separated word
    return [len(t.split()) for t in texts]


CHAINS = [  # (answer, correct, generated tokens): reasoning worked out by hand below
    ("<think>I see 3 red. Wait, one is orange.</think><answer>2</answer>", True, 20),  # 8 words, backtracks
    ("<think>count them</think> <answer>4</answer>", False, 10),  # 2 words
    ("<answer>5</answer>", False, 6),  # no reasoning block
    ("Actually it is<think>unclosed reasoning about shapes", False, 30),  # unclosed: 4 words, backtracks
    ("three red</think><answer>3</answer>", True, 8),  # block opened by the prompt's template: 2 words
]


def test_split_reasoning_finds_every_kind_of_block():
    assert split_reasoning(CHAINS[0][0]) == ("I see 3 red. Wait, one is orange.", "<answer>2</answer>")
    assert split_reasoning(CHAINS[2][0]) == (None, "<answer>5</answer>")
    assert split_reasoning(CHAINS[3][0]) == ("unclosed reasoning about shapes", "Actually it is")
    assert split_reasoning(CHAINS[4][0]) == ("three red", "<answer>3</answer>")
    assert split_reasoning("<think>a</think>x<think>b c</think>y") == ("a\nb c", "xy")
    assert split_reasoning("<think> </think><answer>1</answer>") == ("", "<answer>1</answer>")  # empty block: 0


@given(st.lists(st.sampled_from(["<think>", "</think>", "a", " b", "<answer>", "\n"]), max_size=12))
def test_split_reasoning_leaves_no_tag_in_what_rewards_parse(parts):
    """For any arrangement of tags, the answer part (what strip_think gives the rewards) holds no think tag, the
    reasoning is None exactly when there is no tag, and a text without tags is all answer."""
    text = "".join(parts)
    reasoning, rest = split_reasoning(text)
    assert rest == strip_think(text) and "<think>" not in rest and "</think>" not in rest
    assert (reasoning is None) == ("<think>" not in text and "</think>" not in text)
    if reasoning is None:
        assert rest == text


def test_chain_metrics_on_crafted_answers():
    texts, correct, lengths = [t for t, _, _ in CHAINS], [c for _, c, _ in CHAINS], [n for _, _, n in CHAINS]
    tokens = reasoning_tokens(texts, words)
    assert tokens == [8, 2, None, 4, 2]
    assert reasoning_tokens(["<think> </think>x", "y", "<think>a b</think>"], words) == [0, None, 2]  # empty: 0
    m = chain_metrics(tokens, lengths, correct)
    assert m["reasoning/length"] == pytest.approx((8 + 2 + 4 + 2) / 4)  # over the 4 answers with a block
    assert m["reasoning/block_share"] == pytest.approx(4 / 5)
    assert m["tokens_per_correct"] == pytest.approx((20 + 10 + 6 + 30 + 8) / 2)  # 74 tokens, 2 right
    none = chain_metrics([None, None], [5, 7], [False, False])
    assert none == {"reasoning/length": None, "reasoning/block_share": 0.0, "tokens_per_correct": None}
    with pytest.raises(ValueError, match="one of each per answer"):
        chain_metrics([1], [1, 2], [True])


def test_backtracking_ratios_on_crafted_answers():
    """Backtracking is the reflection counter on its own word list: A ("Wait") and D ("Actually") backtrack."""
    counts = ReflectionCounts(BACKTRACKING_WORDS)
    flags = counts.add([t for t, _, _ in CHAINS], [c for _, c, _ in CHAINS])
    assert flags == [True, False, False, True, False]
    r = counts.ratios()
    assert r["share"] == pytest.approx(2 / 5)
    assert r["share_correct"] == pytest.approx(1 / 2)  # A of {A, E}
    assert r["share_incorrect"] == pytest.approx(1 / 3)  # D of {B, C, D}
    assert r["accuracy_reflective"] == pytest.approx(1 / 2)  # A of {A, D}
    assert r["accuracy_nonreflective"] == pytest.approx(1 / 3)  # E of {B, C, E}
    assert reflection_words_in("Hmm, let me  re-check. I'm awaiting; that's wrong", BACKTRACKING_WORDS) == {
        "hmm": 1, "let me re-check": 1, "that's wrong": 1}


def test_compute_per_thousand_rollouts():
    assert compute_metrics(12.0, 480) == {"compute/seconds_per_1k_rollouts": pytest.approx(25.0)}
    assert compute_metrics(12.0, 480, gpus=4)["compute/gpu_seconds_per_1k_rollouts"] == pytest.approx(100.0)
    assert compute_metrics(1.0, 0) == {}


def test_rollout_metrics_pool_counts_over_ranks():
    """Two ranks with the same answers (reduce doubles every count): the ratios stay, the rollouts double, so the
    wall seconds per 1,000 halve; GPU-seconds = wall x 2 GPUs."""
    texts, correct, lengths = [t for t, _, _ in CHAINS], [c for _, c, _ in CHAINS], [n for _, _, n in CHAINS]
    markers = {"backtracking": BACKTRACKING_WORDS}
    one = rollout_metrics(texts, correct, lengths, words, markers, seconds=0.5)
    assert one["backtracking/share"] == pytest.approx(2 / 5) and one["reasoning/length"] == pytest.approx(4.0)
    assert one["compute/seconds_per_1k_rollouts"] == pytest.approx(100.0)  # 1000 * 0.5 / 5
    two = rollout_metrics(texts, correct, lengths, words, markers, seconds=0.5, gpus=2,
                          reduce=lambda xs: [2 * x for x in xs])
    assert two["tokens_per_correct"] == pytest.approx(37.0) and two["backtracking/share"] == pytest.approx(2 / 5)
    assert two["compute/seconds_per_1k_rollouts"] == pytest.approx(50.0)  # 1000 * 0.5 / 10
    assert two["compute/gpu_seconds_per_1k_rollouts"] == pytest.approx(100.0)  # 1000 * 0.5 * 2 / 10


def test_eval_table_prints_rates_as_percent_and_counts_as_integers():
    from vlmrl.eval.report import MARKER_SETS, REFLECTION_RATIOS
    from vlmrl.eval.tables import eval_table

    metrics = {"accuracy": 0.5, "mean_length": 6.0, "reward/accuracy/failures": 3.0, "reward_failed_samples": 0.0,
               "n": 8}
    result = {"metrics": metrics, "per_task": {}, **{m: {"ratios": dict.fromkeys(REFLECTION_RATIOS)}
                                                       for m in MARKER_SETS}}
    rows = {line.split()[0]: line.split()[1] for line in eval_table({"T=0": result}).splitlines()[2:] if line.strip()}
    assert rows["accuracy"] == "50.0%" and rows["mean_length"] == "6.00"
    assert rows["reward/accuracy/failures"] == "3" and rows["reward_failed_samples"] == "0" and rows["n"] == "8"


def test_every_printed_accuracy_carries_its_interval():
    from vlmrl.eval.report import MARKER_SETS, REFLECTION_RATIOS, before_after
    from vlmrl.eval.tables import eval_table

    metrics = {"accuracy": 0.3, "accuracy_ci_low": 0.2189, "accuracy_ci_high": 0.3959, "n": 100}
    per_task = {"a": dict(metrics), "b": {"accuracy": 0.5, "accuracy_ci_low": 0.4, "accuracy_ci_high": 0.6}}
    result = {"metrics": metrics, "per_task": per_task, **{m: {"ratios": dict.fromkeys(REFLECTION_RATIOS)}
                                                           for m in MARKER_SETS}}
    text = eval_table({"T=0": result})
    assert "30.0% [21.9, 39.6]" in text and "50.0% [40.0, 60.0]" in text  # the set, and each task
    assert "ci_low" not in text  # folded into the accuracy cell, not rows of their own

    class FakeRun:
        def __init__(self, rows):
            self.rows = rows

        def evals(self):
            return self.rows

    start = {"greedy/accuracy": 0.3, "greedy/accuracy_ci_low": 0.25, "greedy/accuracy_ci_high": 0.35}
    end = {"greedy/accuracy": 0.7, "greedy/accuracy_ci_low": 0.66, "greedy/accuracy_ci_high": 0.74}
    (row,) = before_after([FakeRun([start, end])])
    assert row == ("greedy/accuracy", "30.0 [25.0, 35.0]", "70.0 [66.0, 74.0]", "+40.0")
    (row,) = before_after([FakeRun([start, end]), FakeRun([start, end])])
    assert row[2] == "70.0 ± 0.0 (95% CI ±4.0 per run)"


def test_seeds_table_shows_the_per_run_interval_beside_the_spread():
    from vlmrl.eval.tables import seeds_table_text

    stats = lambda mean, std=None: {"mean": mean, "std": std, "max": mean}  # noqa: E731
    seeds = {"seeds": [0, 1], "metrics": {"final/greedy/accuracy": stats(0.65, 0.02),
                                          "final/greedy/accuracy_ci_low": stats(0.61),
                                          "final/greedy/accuracy_ci_high": stats(0.69)}}
    row = seeds_table_text(seeds).splitlines()[2].split()
    assert row == ["final", "65.0", "±", "2.0", "±4.0", "65.0"]
