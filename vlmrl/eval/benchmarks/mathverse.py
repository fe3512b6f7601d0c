"""MathVerse (testmini: 788 problems x 5 versions = 3,940 rows): do MLLMs see the diagrams in visual math problems?

Source: Zhang et al., "MathVerse: Does Your Multi-modal LLM Truly See the Diagrams in Visual Math Problems?",
ECCV 2024 (arXiv:2403.14624); data AI4Math/MathVerse, config "testmini", split "testmini" (`sample_index`,
`problem_index`, `problem_version`, `question`, `image`, `answer`, `question_type` "multi-choice"/"free-form",
`metadata` {split, source, subject, subfield}, `query_wo`, `query_cot`, `question_for_eval`); evaluator
github.com/ZrrSkywalker/MathVerse (evaluation/extract_answer_s1.py, evaluation/score_answer_s2.py).

Protocol followed here:
- prompt: the dataset's `query_wo` column. MathVerse's README names the "w/o" score, an accuracy over answers to
  `query_wo`, the leaderboard's primary metric; `query_cot` feeds the CoT-E partial-credit score, which vlmrl does
  not compute. A benchmark of your own can use `query_cot` instead (docs/benchmarks.md, "Adding a benchmark").
- extraction and judging: the official pipeline asks GPT-4 to extract the answer (step 1) and to judge it against
  `answer` given the question (step 2; with --quick_match an exact string match); `--extract judge` runs those two
  prompts on a judge endpoint (`vlmrl.eval.benchmarks.judged`). The offline rules extract by `extract.final_answer`
  and judge a multiple-choice answer by its option letter(s) (a gold that is an option's text, "False", names that
  option; a gold of two letters needs both), a free-form one with the `accuracy` reward's math check (normalised
  text, numbers, then math-verify equivalence), on the answer and the gold as written and with a label and a unit
  taken off ("Area $=113.1 \\mathrm{~cm}^{2}$" is 113.1), and a sentence's last number, as MathVerse's judge counts
  them.
- per-category accuracy by `problem_version` (Text Dominant, Text Lite, Vision Intensive, Vision Dominant, Vision
  Only) and `subject`, as score_answer_s2.py prints them.
"""

from __future__ import annotations

import re
from typing import Any

from vlmrl.data.files import RowError
from vlmrl.eval.benchmarks.extract import choice_letters, final_answer
from vlmrl.eval.benchmarks.registry import Benchmark, register_benchmark
from vlmrl.rewards.columns import per_sample
from vlmrl.rewards.parsing import completion_text, normalize_text
from vlmrl.rewards.verifiable import accuracy_reward

QUESTION_TYPES = ("multi-choice", "free-form")


def adapt(row: dict) -> dict:
    if row.get("question_type") not in QUESTION_TYPES:
        raise RowError(f"question_type {row.get('question_type')!r} is not one of {list(QUESTION_TYPES)}")
    metadata = row.get("metadata") or {}
    return {"id": str(row["sample_index"]), "image": row["image"], "problem": row["query_wo"],
            "solution": str(row["answer"]).strip(),
            "answer_type": "choice" if row["question_type"] == "multi-choice" else "math",
            "question_type": row["question_type"], "problem_version": row["problem_version"],
            "problem_index": str(row["problem_index"]), "subject": metadata.get("subject"),
            "subfield": metadata.get("subfield"), "mathverse_options": options_in(str(row["query_wo"])),
            "question_for_eval": str(row.get("question_for_eval") or row.get("question") or "")}


_OPTION_LINE = re.compile(r"^\s*\(?([A-Z])\)?\s*[.:\uff1a)]\s*(.+?)\s*$", flags=re.M)
_UNIT = re.compile(r"(?:\s*\\(?:mathrm|text)\s*\{[^{}]*\}.*|(?<=[\d\s}])\s*(?:square\s+)?(?:cm|mm|km|m|metres|meters|"
                   r"units?|inches|feet|ft)\b(?:\^\{?\d\}?|[\u00b2\u00b3])?)\.?$")


def options_in(query: str) -> list[str]:
    """The option texts of a multiple-choice query, in letter order ("Choices:\\nA:2\\nB:..." -> ["2", ...]); []
    when the options are not in the text (Vision Only versions show them in the image)."""
    if not re.search(r"\bchoices?\b", query, flags=re.I):
        return []
    found: dict[str, str] = {}
    for letter, text in _OPTION_LINE.findall(query.split("Choice", 1)[-1]):
        found.setdefault(letter, text)
    letters = [chr(ord("A") + i) for i in range(len(found))]
    return [found[x] for x in letters] if list(found) == letters else []


def bare_value(text: str) -> str:
    """An answer without its label and unit: "Area $=113.1 \\mathrm{~cm}^{2}$" -> "113.1", "Area = 113.1 cm^2" ->
    "113.1", "$5=s$" -> "5"; other text as it is (an equation such as "y+3=2x" keeps both sides)."""
    value = text.replace("$", "").strip()
    sides = value.split("=")
    if len(sides) == 2:
        left, right = sides[0].strip(), sides[1].strip()
        if re.fullmatch(r"[A-Za-z][A-Za-z ]*", left):
            value = right
        elif re.fullmatch(r"[A-Za-z]", right):
            value = left
    return _UNIT.sub("", value).strip() or value


def last_number(answer: str) -> str:
    """The last number of a sentence ("the distance d is approximately 22.3 meters." -> "22.3"), as MathVerse's
    extraction reads one; the answer itself when it holds no number or is already one expression."""
    numbers = re.findall(r"-?\d+(?:,\d{3})*(?:\.\d+)?", answer)
    return numbers[-1].replace(",", "") if numbers and " " in answer.strip() else answer


def gold_letters(gold: str, options: list[str]) -> frozenset[str]:
    """The option letters a multiple-choice gold names: "B", "(C)", "C\\nD", or an option's text ("False")."""
    if re.fullmatch(r"\s*\(?[A-Z]\)?(?:\s*(?:,|/|&|\band\b|\s)\s*\(?[A-Z]\)?)*\s*", gold):
        return frozenset(re.findall(r"[A-Z]", gold))
    norm = normalize_text(gold)
    return frozenset(chr(ord("A") + i) for i, option in enumerate(options) if normalize_text(option) == norm)


def score(completions: list, solution: list, *, question_type: list, mathverse_options: list | None = None,
          **_: Any) -> list[float | None]:
    """A multiple-choice answer names the gold's option letter(s); a free-form answer (or a multiple-choice gold
    that names no option) is checked like `accuracy`'s math, also without labels and units on either side."""
    n = len(completions)
    option_lists = per_sample(mathverse_options, n, None)
    out: list[Any] = [None] * n
    free: list[int] = []
    answers = [final_answer(completion_text(c)) for c in completions]
    for i, (answer, gold, kind) in enumerate(zip(answers, solution, question_type, strict=True)):
        options = list(option_lists[i] or [])
        target = gold_letters(str(gold), options) if kind == "multi-choice" else frozenset()
        if target:
            picked = choice_letters(answer, 26) or gold_letters(answer, options) if answer else frozenset()
            out[i] = float(picked == target)
        else:
            free.append(i)
    if free:
        golds = [sorted({str(solution[i]), bare_value(str(solution[i]))}) for i in free]
        for form in (lambda a: a, bare_value, last_number):
            values = accuracy_reward([f"<answer>{form(answers[i])}</answer>" for i in free], golds,
                                     answer_type=["math"] * len(free), strict=False)
            for i, value in zip(free, values, strict=True):
                if out[i] is None or value == 1.0:
                    out[i] = value
    return out


MATHVERSE = register_benchmark(Benchmark(
    name="mathverse", hub="AI4Math/MathVerse", config="testmini", split="testmini", adapt=adapt, score=score,
    columns=("sample_index", "problem_index", "problem_version", "image", "answer", "question_type", "metadata",
             "query_wo"),
    answer_type="math", categories=("problem_version", "subject"), max_new_tokens=2048,
    source="Zhang et al., ECCV 2024 (arXiv:2403.14624); github.com/ZrrSkywalker/MathVerse evaluation/",
    notes="the query_wo prompt (the 'w/o' score); GPT-4 extraction and judging replaced by rules and "
          "math-verify",
))
