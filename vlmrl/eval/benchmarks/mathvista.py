"""MathVista (testmini, 1,000 problems): mathematical reasoning in visual contexts.

Source: Lu et al., "MathVista: Evaluating Mathematical Reasoning of Foundation Models in Visual Contexts", ICLR 2024
(arXiv:2310.02255); data AI4Math/MathVista; evaluator github.com/lupantech/MathVista, evaluation/
(build_query.py, extract_answer.py, calculate_score.py).

Protocol followed here:
- prompt: the dataset's `query` column, which is build_query.py's zero-shot "solution" query (the question, its unit,
  the choices as "(A) ...", and the hint naming the answer format);
- extraction: extract_answer.py's rules first (a multiple-choice response that is an option's text, a response
  that is an integer or a float), then its quick rule (`The answer is "X".`), then, where the official code asks
  GPT-4, vlmrl's rules (`extract.final_answer`; for a free-form answer the last number in it);
- normalisation and scoring exactly as calculate_score.py: a letter (also "(B) text") becomes its option's text,
  any other multiple-choice answer the option nearest by edit distance; an integer answer `str(int(float(x)))`, a
  float `str(round(float(x), precision))`, a list `str(x)`; right when that string equals the `answer` column.
- per-category accuracy by the metadata calculate_score.py reports: task (as `mathvista_task`), context, grade, skills (a problem
  counts in each of its skills), question_type, answer_type, source, language.
"""

from __future__ import annotations

import re
from typing import Any

from vlmrl.data.files import RowError
from vlmrl.eval.benchmarks.extract import choice_letter, final_answer, levenshtein
from vlmrl.eval.benchmarks.registry import Benchmark, register_benchmark
from vlmrl.rewards.columns import per_sample
from vlmrl.rewards.parsing import completion_text, to_ascii_digits

METADATA = ("task", "context", "grade", "skills", "source", "language", "category")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?|-?\.\d+")


def adapt(row: dict) -> dict:
    """A MathVista row (its published schema) as a vlmrl row: the `query` as the prompt, the metadata flattened."""
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise RowError(f"'metadata' must be a struct of {list(METADATA)}, got {type(metadata).__name__}")
    if row.get("question_type") not in ("multi_choice", "free_form"):
        raise RowError(f"question_type {row.get('question_type')!r} is neither 'multi_choice' nor 'free_form'")
    return {"id": str(row["pid"]), "image": row["decoded_image"], "problem": row["query"],
            "solution": str(row["answer"]), "answer_type": "choice" if row["question_type"] == "multi_choice"
            else ("number" if row["answer_type"] in ("integer", "float") else "text"),
            "question_type": row["question_type"], "mathvista_answer_type": row["answer_type"],
            "choices": list(row["choices"] or []), "precision": row.get("precision"), "unit": row.get("unit"),
            **{f"mathvista_{key}" if key == "task" else key: metadata.get(key) for key in METADATA}}


def extract(response: str, question_type: str, answer_type: str, choices: list[str],
            rules_only: bool = False) -> str | None:
    """extract_answer.py's answer of `response` (its rules, then vlmrl's rules where it asks GPT-4). rules_only:
    None where it would ask GPT-4 (before its optional quick rule, off by default there), for `judged`."""
    if response == "":
        return ""
    if question_type == "multi_choice" and response in choices:
        return response
    if answer_type == "integer":
        try:
            return str(int(response))
        except ValueError:
            pass
    if answer_type == "float":
        try:
            return str(float(response))
        except ValueError:
            pass
    if rules_only:
        return None
    quick = re.search(r'The answer is "(.*)"\.', response)
    if quick:
        return quick.group(1)
    answer = final_answer(response)
    if question_type == "free_form" and answer_type in ("integer", "float"):
        numbers = _NUMBER.findall(to_ascii_digits(answer))
        return numbers[-1].replace(",", "") if numbers else answer
    if answer_type == "list" and not answer.startswith("["):  # "between 2007 and 2008" -> "[2007, 2008]", as GPT-4
        numbers = [n.replace(",", "") for n in _NUMBER.findall(to_ascii_digits(answer))]
        return f"[{', '.join(numbers)}]" if len(numbers) > 1 else answer
    if question_type == "multi_choice" and answer not in choices:
        return choice_letter(answer, len(choices)) or leading_option(answer, choices) or answer
    return answer


def leading_option(answer: str, choices: list[str]) -> str | None:
    """The longest option whose text begins the answer as a word ("No, Indian Red has the lowest value." -> "No"),
    as GPT-4's extraction reads such a response; None when none does."""
    lowered = answer.casefold()
    starts = [c for c in choices if c and re.match(re.escape(c.casefold()) + r"(?![\w])", lowered)]
    return max(starts, key=len) if starts else None


def normalize(extraction: str, choices: list[str], question_type: str, answer_type: str,
              precision: Any) -> str | None:
    """calculate_score.py's `normalize_extracted_answer`."""
    if question_type == "multi_choice":
        extraction = str(extraction).strip()
        letter = re.findall(r"\(([a-zA-Z])\)", extraction)
        if letter:
            extraction = letter[0].upper()
        options = [chr(ord("A") + i) for i in range(len(choices))]
        if extraction in options:
            return choices[options.index(extraction)]
        distances = [levenshtein(extraction, choice) for choice in choices]
        return choices[distances.index(min(distances))] if choices else None
    try:
        if answer_type == "integer":
            return str(int(float(extraction)))
        if answer_type == "float":
            return str(round(float(extraction), int(precision or 0)))
    except (ValueError, OverflowError):
        return None
    return str(extraction) if answer_type == "list" else extraction


def score(completions: list, solution: list, *, question_type: list, mathvista_answer_type: list, choices: list,
          precision: list | None = None, **_: Any) -> list[float | None]:
    """1.0 when the normalised extraction equals the `answer` string (calculate_score.py's `safe_equal`)."""
    n = len(completions)
    precisions = per_sample(precision, n, None)
    out: list[float | None] = []
    for text, answer, qtype, atype, options, digits in zip(completions, solution, question_type,
                                                           mathvista_answer_type, choices, precisions, strict=True):
        response = completion_text(text).strip()
        prediction = normalize(extract(response, qtype, atype, list(options or [])), list(options or []), qtype,
                               atype, digits)
        out.append(float(prediction is not None and prediction == str(answer)))
    return out


MATHVISTA = register_benchmark(Benchmark(
    name="mathvista", hub="AI4Math/MathVista", split="testmini", adapt=adapt, score=score,
    columns=("pid", "decoded_image", "query", "answer", "question_type", "answer_type", "choices", "precision",
             "metadata"),
    answer_type="text", categories=("mathvista_task", "skills", "context", "grade", "question_type", "mathvista_answer_type"),
    max_new_tokens=1024,
    source="Lu et al., ICLR 2024 (arXiv:2310.02255); github.com/lupantech/MathVista evaluation/ (build_query.py, "
           "extract_answer.py, calculate_score.py)",
    notes="answers are read by rules where the official evaluator asks GPT-4 (extract.final_answer)",
))
