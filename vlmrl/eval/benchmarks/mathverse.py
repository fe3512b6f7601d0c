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
  `answer` given `question_for_eval` (step 2; with --quick_match an exact string match). vlmrl cannot call GPT-4
  here: it extracts by rules (`extract.final_answer`), and judges a multiple-choice answer by its option letter
  and a free-form one with the `accuracy` reward's math check (normalised text, numbers, then math-verify
  equivalence).
- per-category accuracy by `problem_version` (Text Dominant, Text Lite, Vision Intensive, Vision Dominant, Vision
  Only) and `subject`, as score_answer_s2.py prints them.
"""

from __future__ import annotations

from typing import Any

from vlmrl.data.files import RowError
from vlmrl.eval.benchmarks.extract import choice_letter, final_answer
from vlmrl.eval.benchmarks.registry import Benchmark, register_benchmark
from vlmrl.rewards.parsing import completion_text
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
            "subfield": metadata.get("subfield")}


def score(completions: list, solution: list, *, question_type: list, **_: Any) -> list[float | None]:
    """A multiple-choice answer's letter equals the answer's; a free-form answer is checked like `accuracy`'s math."""
    out: list[Any] = [None] * len(completions)
    free: list[int] = []
    answers = [final_answer(completion_text(c)) for c in completions]
    for i, (answer, gold, kind) in enumerate(zip(answers, solution, question_type, strict=True)):
        if kind == "multi-choice":
            target = choice_letter(str(gold), 26)
            picked = choice_letter(answer, 26)
            out[i] = None if target is None else float(picked == target)
        else:
            free.append(i)
    if free:
        values = accuracy_reward([f"<answer>{answers[i]}</answer>" for i in free], [solution[i] for i in free],
                                 answer_type=["math"] * len(free), strict=False)
        for i, value in zip(free, values, strict=True):
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
