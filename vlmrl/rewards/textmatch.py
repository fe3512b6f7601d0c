"""Free-form answer rewards: exact match, token F1 (SQuAD's), BLEU (sacrebleu) and ROUGE-L (rouge-score).

Each grades the answer `accuracy` grades (the same selection: `extract`, `strict`, a truncated completion pays 0
when strict) against the `solution` column, or the column `reference_column` names: one reference, or a list of
references of which the best-matching one counts (the max over references, for BLEU too: each reference is scored
alone; a data file's `solution` is one string, so put lists in a column of their own). Values lie in [0, 1]. An answer
with no word left after normalisation pays 0 (a policy cannot score by answering "the" or "."); a sample whose
references are all missing or empty gives None (fix the data).

Normalisation (`normalize_answer`, SQuAD's, used by exact_match, token_f1 and rouge_l): Unicode NFKC, ASCII digits,
casefold; a whole-answer `\\boxed{}`/`\\text{}`/`$...$` unwrapped; punctuation deleted ("don't" -> "dont",
"U.S." -> "us", and also "3.5" -> "35"); the articles a/an/the removed (kept when nothing else is left);
whitespace collapsed. Tokens are the words that remain. BLEU is sacrebleu's sentence BLEU on the raw texts (its
13a tokenizer, case-sensitive unless `lowercase`), so its values are the ones sacrebleu reports, divided by 100.

sacrebleu and rouge-score are the `text` extra; `registry.check_specs` names it up front when one is missing.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from vlmrl.rewards.parsing import _LATEX_WRAPPER, completion_text, to_ascii_digits
from vlmrl.rewards.registry import missing_requirement, register_reward
from vlmrl.rewards.verifiable import _select_answer, is_missing, per_sample

TEXT_EXTRA = "pip install 'vlmrl[text]'"
TEXT_TYPES = ("text", "number", "math", "choice")  # answers these compare as text (a box is coordinates: iou)
_ARTICLES = frozenset({"a", "an", "the"})
_ROUGE_SCORER: Any = None


def _is_punctuation(ch: str) -> bool:
    """Unicode punctuation (categories P*) and the ASCII symbols SQuAD's `string.punctuation` also removes."""
    return unicodedata.category(ch).startswith("P") or ch in "$+<=>^`|~"


def normalize_answer(text: str) -> str:
    """SQuAD-style normal form (see the module docstring), in SQuAD's order (punctuation, then articles):
    "The Cat, sat." -> "cat sat", "U.S.A." -> "usa"."""
    s = to_ascii_digits(unicodedata.normalize("NFKC", text)).casefold().strip()
    while wrapped := _LATEX_WRAPPER.fullmatch(s):
        s = (wrapped.group(1) if wrapped.group(1) is not None else wrapped.group(2)).strip()
    words = "".join(ch for ch in s if not _is_punctuation(ch)).split()
    return " ".join([w for w in words if w not in _ARTICLES] or words)


def answer_tokens(text: str) -> list[str]:
    """The words of `normalize_answer(text)`."""
    return normalize_answer(text).split()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1: with c = the number of tokens the two share (as multisets), precision p = c / |prediction|,
    recall r = c / |reference|, F1 = 2pr / (p + r); 0 when they share none (or either has no tokens)."""
    pred, ref = answer_tokens(prediction), answer_tokens(reference)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _require(fn: Callable[..., Any], what: str) -> None:
    missing = missing_requirement(fn, what)
    if missing is not None:
        raise missing


def bleu(prediction: str, reference: str, tokenize: str = "13a", lowercase: bool = False,
         smooth_method: str = "exp") -> float:
    """sacrebleu's sentence BLEU / 100: the geometric mean of the modified n-gram precisions p_1..p_4 (an n-gram
    counts at most as often as in the reference) times the brevity penalty BP = min(1, exp(1 - |ref| / |pred|)).
    `smooth_method` "exp" (sacrebleu's default for sentences) replaces the k-th zero precision by 1 / (2^k total)."""
    score = _bleu_metric(tokenize, lowercase, smooth_method).sentence_score(prediction, [reference]).score
    return min(1.0, score / 100.0)  # sacrebleu's 100 for a perfect match can come out as 100.00000000000004


@lru_cache(maxsize=8)
def _bleu_metric(tokenize: str, lowercase: bool, smooth_method: str) -> Any:
    from sacrebleu.metrics import BLEU

    # effective_order: a short sentence is scored on the n-gram orders it has (sacrebleu's sentence_bleu default)
    return BLEU(tokenize=tokenize, lowercase=lowercase, smooth_method=smooth_method, effective_order=True)


class _AnswerTokens:
    """rouge-score's tokenizer interface over `answer_tokens` (its own keeps only ASCII letters and digits)."""

    def tokenize(self, text: str) -> list[str]:
        return answer_tokens(text)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (rouge-score) over `answer_tokens`: with L the length of the longest common subsequence,
    P = L / |prediction|, R = L / |reference|, F = 2PR / (P + R). Unlike token F1, word order counts."""
    global _ROUGE_SCORER
    if _ROUGE_SCORER is None:
        from rouge_score.rouge_scorer import RougeScorer

        _ROUGE_SCORER = RougeScorer(["rougeL"], tokenizer=_AnswerTokens())
    return float(_ROUGE_SCORER.score(reference, prediction)["rougeL"].fmeasure)


def _references(value: Any) -> list[str]:
    """The usable references of one sample: each element of a list (or the one value), missing and empty ones
    left out."""
    refs = value if isinstance(value, (list, tuple)) else [value]
    return [str(r) for r in refs if not is_missing(r) and normalize_answer(str(r))]


def score_answers(completions: list[Any], references: list[Any], score: Callable[[str, str], float], *,
                  extract: str = "tag", strict: bool = True,
                  completion_truncated: list[bool] | None = None) -> list[float | None]:
    """Per completion: max over the sample's references (one value or a list) of `score(answer, reference)`; 0.0
    for an answer with no words; None without a usable reference. The answer is selected as in `accuracy`."""
    truncated = per_sample(completion_truncated, len(completions), False)
    scores: list[float | None] = []
    for completion, value, trunc in zip(completions, per_sample(references, len(completions), None), truncated,
                                        strict=True):
        refs = _references(value)
        if not refs:
            scores.append(None)
            continue
        answer = _select_answer(completion_text(completion), bool(trunc), extract, strict)
        if not answer or not normalize_answer(answer):
            scores.append(0.0)
            continue
        scores.append(max(score(answer, ref) for ref in refs))
    return scores


def _reference_values(solution: Any, reference_column: str, columns: dict[str, Any]) -> Any:
    """The references column: `solution`, or the column `reference_column` names (a list of references per row
    in a data file, whose `solution` must be one string)."""
    if reference_column == "solution":
        return solution
    if reference_column not in columns:
        raise ValueError(f"reference_column={reference_column!r}: the data has no such column; columns: "
                         f"{sorted(k for k in columns if not k.startswith('completion_'))}")
    return columns[reference_column]


@register_reward("exact_match", inline=True, grades=TEXT_TYPES)
def exact_match_reward(completions: list[Any], solution: list[Any] | None = None, *, reference_column: str = "solution",
                       extract: str = "tag", strict: bool = True, completion_truncated: list[bool] | None = None,
                       **columns: Any) -> list[float | None]:
    """1.0 if the answer equals a reference after `normalize_answer` ("The Eiffel Tower." == "eiffel tower"),
    else 0.0. References: the `reference_column` column (default `solution`), one string or a list per sample."""
    return score_answers(completions, _reference_values(solution, reference_column, columns),
                         lambda a, r: float(normalize_answer(a) == normalize_answer(r)), extract=extract,
                         strict=strict, completion_truncated=completion_truncated)


@register_reward("token_f1", inline=True, grades=TEXT_TYPES)
def token_f1_reward(completions: list[Any], solution: list[Any] | None = None, *, reference_column: str = "solution",
                    extract: str = "tag", strict: bool = True, completion_truncated: list[bool] | None = None,
                    **columns: Any) -> list[float | None]:
    """SQuAD's token F1 of the answer against the best reference (`token_f1`): partial credit for overlapping
    words, in any order. "the cat sat" vs "a cat sat down": 2 shared of 2 and 3 tokens, F1 = 0.8."""
    return score_answers(completions, _reference_values(solution, reference_column, columns), token_f1,
                         extract=extract, strict=strict, completion_truncated=completion_truncated)


@register_reward("bleu", inline=True, requires={"sacrebleu": TEXT_EXTRA}, grades=TEXT_TYPES)
def bleu_reward(completions: list[Any], solution: list[Any] | None = None, *, reference_column: str = "solution",
                extract: str = "tag", strict: bool = True, tokenize: str = "13a", lowercase: bool = False,
                smooth_method: str = "exp", completion_truncated: list[bool] | None = None,
                **columns: Any) -> list[float | None]:
    """Sentence BLEU (sacrebleu, in [0, 1]) of the answer against the best reference (`bleu`); `tokenize`,
    `lowercase` and `smooth_method` are sacrebleu's options."""
    _require(bleu_reward, "the bleu reward")

    def score(answer: str, reference: str) -> float:
        return bleu(answer, reference, tokenize, lowercase, smooth_method)

    return score_answers(completions, _reference_values(solution, reference_column, columns), score,
                         extract=extract, strict=strict, completion_truncated=completion_truncated)


@register_reward("rouge_l", inline=True, requires={"rouge_score": TEXT_EXTRA}, grades=TEXT_TYPES)
def rouge_l_reward(completions: list[Any], solution: list[Any] | None = None, *, reference_column: str = "solution",
                   extract: str = "tag", strict: bool = True, completion_truncated: list[bool] | None = None,
                   **columns: Any) -> list[float | None]:
    """ROUGE-L F-measure (rouge-score) of the answer against the best reference (`rouge_l`). Its cost is
    |answer| x |reference| per pair (the LCS table): fine for answers, slow for pages."""
    _require(rouge_l_reward, "the rouge_l reward")
    return score_answers(completions, _reference_values(solution, reference_column, columns), rouge_l,
                         extract=extract, strict=strict, completion_truncated=completion_truncated)
