"""Pure evaluation metrics: pass@k, majority vote, marker words (reflection, backtracking). No torch, no model: lists
in, numbers out.

These follow MAYE's evaluation scheme (pass@k, mean@n, maj@n, reflection ratios) with two of its shortcuts fixed:
pass@k is the unbiased estimator over n >= k samples (not "any of k samples right"), and reflection words are
matched on word boundaries (so "await" is not "wait"). The same counter, on a second word list, measures
backtracking (self-correction): answers that abandon or revise a step ("wait", "actually", "let me re-check").
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from vlmrl.rewards.parsing import match_answer_block, normalize_text, parse_number

# MAYE's list of reflection words (matched case-insensitively, on word boundaries); `eval.reflection_words` replaces it
REFLECTION_WORDS: tuple[str, ...] = (
    "re-check", "re-evaluate", "re-examine", "re-think", "recheck", "reevaluate", "reexamine", "reevaluation",
    "rethink", "check again", "think again", "try again", "verify", "wait", "yet",
)
# markers of backtracking / self-correction (R1-style "aha" turns); `eval.backtracking_words` replaces it
BACKTRACKING_WORDS: tuple[str, ...] = (
    "wait", "actually", "hmm", "oops", "let me re-check", "let me recheck", "let me check again",
    "let me reconsider", "let me try again", "on second thought", "i made a mistake", "that's wrong",
    "that is wrong", "that's not right", "scratch that",
)


def marker_sets(reflection: Sequence[str] | None = None, backtracking: Sequence[str] | None = None
                ) -> dict[str, tuple[str, ...]]:
    """The word lists counted in every evaluation and RL step, by metric prefix; None takes the default list."""
    return {"reflection": tuple(reflection or REFLECTION_WORDS), "backtracking": tuple(backtracking or BACKTRACKING_WORDS)}


# ------------------------------------------------------------------------------------------------ pass@k, mean, maj


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that k answers drawn without replacement from the n include a correct one. Exact integer
    binomials, so no float cancellation. n == k gives 1.0 if c > 0 else 0.0 (the "any of n" rate); k > n is an error.
    """
    if not (0 <= c <= n) or k < 1:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} needs at least k samples per prompt, got n={n}; sample more (eval n)")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; `correct[i]` holds the correctness of prompt i's n answers."""
    if not correct:
        raise ValueError("mean_pass_at_k: no prompts")
    return sum(pass_at_k(len(c), sum(map(bool, c)), k) for c in correct) / len(correct)


Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: two-sided 95% intervals


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default):

        center = (p + z^2 / 2n) / (1 + z^2 / n),  half = z * sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2 / n)

    with p = successes / n. Unlike p +- z sqrt(p (1 - p) / n) it stays inside [0, 1] and is not empty at p = 0 or 1
    (Brown, Cai & DasGupta, 2001). At n = 600 its half-width is at most 4.0 points (p = 0.5)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    p, z2 = successes / n, z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def bootstrap_interval(values: Sequence[float], level: float = 0.95, resamples: int = 2000, seed: int = 0
                       ) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (one per prompt), resampling prompts with replacement;
    a fixed `seed`, so the same values always give the same interval."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("bootstrap_interval: no values")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def accuracy_interval(correct: Sequence[Sequence[bool]]) -> tuple[float, float]:
    """95% interval of accuracy (mean@n) over prompts: Wilson's binomial interval with one answer per prompt (greedy),
    else a bootstrap over prompts (a prompt's n answers are not independent draws, so they are resampled together)."""
    if not correct:
        raise ValueError("accuracy_interval: no prompts")
    if all(len(c) == 1 for c in correct):
        return wilson_interval(sum(bool(c[0]) for c in correct), len(correct))
    return bootstrap_interval([sum(map(bool, c)) / len(c) for c in correct])


def format_interval(value: float | None, low: float | None, high: float | None, digits: int = 1) -> str:
    """'65.7% [62.0, 69.4]' from fractions; the interval is left out when it is unknown."""
    if value is None:
        return "undefined"
    text = f"{100 * value:.{digits}f}%"
    return text if low is None or high is None else f"{text} [{100 * low:.{digits}f}, {100 * high:.{digits}f}]"


def answer_key(text: str, truncated: bool = False, answer_type: str | None = None) -> str | None:
    """What a completion votes for in maj@n: the content of a well-formed answer block (the strict rule the
    accuracy reward uses: one `<answer>...</answer>`, whitespace around, not truncated), normalised: a number as its
    value ("3", "3.0", "3 shapes" -> "3"), text by `normalize_text`. None (abstain) for a malformed answer."""
    if truncated:
        return None
    content = match_answer_block(text, think=None)
    if content is None or not content.strip():
        return None
    if answer_type == "number":
        value = parse_number(content)
        return None if value is None else repr(float(value))
    if answer_type == "box":
        return " ".join(content.split())
    return normalize_text(content)


def majority_vote(keys: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """maj@n for one prompt: whether the most frequent non-None answer key is correct.

    A tie goes to the key that appears first. The voted answer's correctness is that of its first occurrence (equal
    keys are graded equally). Every answer abstaining (None) counts as wrong.
    """
    if len(keys) != len(correct):
        raise ValueError(f"majority_vote: {len(keys)} keys for {len(correct)} correctness flags")
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return False
    best = max(counts.values())
    winner = next(k for k in keys if k is not None and counts[k] == best)
    return bool(correct[keys.index(winner)])


def weighted_vote(keys: Sequence[str | None], scores: Sequence[float | None], correct: Sequence[bool]) -> bool:
    """A reward model's weighted majority vote for one prompt (self-consistency weighted by a verifier, as Li et al.
    2023 and Math-Shepherd select): each distinct answer key gets the sum of its answers' scores (which must not be
    negative: a PRM's probabilities), and the key with the largest sum wins; ties go to the key seen first.
    Abstaining (None) keys and unscored answers add nothing; nothing left counts as wrong."""
    if not len(keys) == len(scores) == len(correct):
        raise ValueError(f"weighted_vote: {len(keys)} keys, {len(scores)} scores, {len(correct)} flags")
    totals: dict[str, float] = {}
    for key, score in zip(keys, scores, strict=True):
        if key is not None and score is not None and score == score:
            if score < 0:
                raise ValueError(f"weighted_vote: a negative score ({score}); weigh with probabilities")
            totals[key] = totals.get(key, 0.0) + score
    if not totals:
        return False
    best = max(totals.values())
    winner = next(k for k in keys if k in totals and totals[k] == best)
    return bool(correct[keys.index(winner)])


def best_of_n(scores: Sequence[float | None], correct: Sequence[bool]) -> bool:
    """Best-of-n selection for one prompt: whether the answer a reward model scores highest is correct. A tie goes
    to the first; an answer the model could not score (None) is never picked, and if none could be, it counts as
    wrong (as maj@n counts every answer abstaining)."""
    if len(scores) != len(correct):
        raise ValueError(f"best_of_n: {len(scores)} scores for {len(correct)} correctness flags")
    scored = [(s, -i) for i, s in enumerate(scores) if s is not None and s == s]  # NaN (a RewardFailure) is None
    return bool(correct[-max(scored)[1]]) if scored else False


# ------------------------------------------------------------------------------------------------ reflection


def reflection_pattern(words: Sequence[str]) -> re.Pattern:
    """One case-insensitive regex matching any of `words` on word boundaries: not preceded or followed by a letter,
    digit or underscore. A space inside a phrase matches any whitespace ("check  again")."""
    return _pattern(tuple(words))


@functools.lru_cache(maxsize=64)  # built once per word list: every RL step matches it against every answer
def _pattern(words: tuple[str, ...]) -> re.Pattern:
    if not words:
        raise ValueError("reflection words: the list is empty; give at least one word or phrase")
    parts = [r"\s+".join(re.escape(p) for p in w.strip().split()) for w in sorted(set(words), key=len, reverse=True)]
    return re.compile(r"(?<!\w)(?:" + "|".join(parts) + r")(?!\w)", re.IGNORECASE)


def reflection_words_in(text: str, words: Sequence[str]) -> Counter:
    """Occurrences of each word of `words` in `text` (word-boundary, case-insensitive), keyed by the listed word."""
    found = reflection_pattern(words).findall(text)
    if not found:
        return Counter()
    canon = {" ".join(w.lower().split()): w for w in words}
    return Counter(canon[" ".join(m.lower().split())] for m in found)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


@dataclass
class ReflectionCounts:
    """Pooled counts over answers; add batches with `add`, read the ratios with `ratios` (never averaged per batch).

    reflective = the answer contains at least one word of `words`: MAYE's reflection words by default; with
    `BACKTRACKING_WORDS` the same counts and ratios measure backtracking."""

    words: tuple[str, ...] = REFLECTION_WORDS
    answers: int = 0
    correct: int = 0
    reflective: int = 0
    reflective_correct: int = 0
    occurrences: Counter = field(default_factory=Counter)  # word -> total matches
    answers_with: Counter = field(default_factory=Counter)  # word -> answers containing it

    def add(self, texts: Sequence[str], correct: Sequence[bool]) -> list[bool]:
        """Count a batch; returns whether each answer is reflective."""
        if len(texts) != len(correct):
            raise ValueError(f"reflection counts: {len(texts)} answers for {len(correct)} correctness flags")
        flags = []
        for text, ok in zip(texts, correct, strict=True):
            found = reflection_words_in(text, self.words)
            self.occurrences.update(found)
            self.answers_with.update(found.keys())
            r = bool(found)
            self.answers += 1
            self.correct += bool(ok)
            self.reflective += r
            self.reflective_correct += r and bool(ok)
            flags.append(r)
        return flags

    def ratios(self) -> dict[str, float | None]:
        """MAYE's five ratios from the pooled counts; None where the denominator is empty (undefined, not 0):

        share            = reflective / answers
        share_correct    = reflective∧correct / correct
        share_incorrect  = reflective∧incorrect / incorrect
        accuracy_reflective     = reflective∧correct / reflective
        accuracy_nonreflective  = non-reflective∧correct / non-reflective
        """
        incorrect = self.answers - self.correct
        nonreflective = self.answers - self.reflective
        return {
            "share": _ratio(self.reflective, self.answers),
            "share_correct": _ratio(self.reflective_correct, self.correct),
            "share_incorrect": _ratio(self.reflective - self.reflective_correct, incorrect),
            "accuracy_reflective": _ratio(self.reflective_correct, self.reflective),
            "accuracy_nonreflective": _ratio(self.correct - self.reflective_correct, nonreflective),
        }

    def frequencies(self) -> dict[str, dict[str, float | int | None]]:
        """Per word: total occurrences, answers containing it, and that as a share of all answers."""
        return {w: {"occurrences": self.occurrences[w], "answers": self.answers_with[w],
                    "share": _ratio(self.answers_with[w], self.answers)} for w in self.words}

    def counts(self) -> dict[str, int]:
        return {"answers": self.answers, "correct": self.correct, "reflective": self.reflective,
                "reflective_correct": self.reflective_correct}
