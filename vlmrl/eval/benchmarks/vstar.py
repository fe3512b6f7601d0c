"""V* Bench (191 questions on high-resolution images): the zoom-in benchmark of guided visual search.

Source: Wu and Xie, "V*: Guided Visual Search as a Core Mechanism in Multimodal LLMs", CVPR 2024 (arXiv:2312.14135);
data craigwu/vstar_bench: test_questions.jsonl (split test: `image` = the image's path in the repository, e.g.
direct_attributes/sa_4690.jpg, `text` = the question with its options "(A) ..." and the instruction "Answer with the
option's letter from the given choices directly.", `category` = direct_attributes or relative_position,
`question_id`, `label` = the right letter, added to the hub copy in May 2024 by its pull request #3; 191 rows) beside
the image folders. The column names are those consumers of the file read; the `text` wording is unconfirmed. The
images are read from the repository (`image_root="repo"`: the hub snapshot, or the folder
`vlmrl data fetch craigwu/vstar_bench --files` wrote).

Protocol: the `text` column is the prompt; the answer is the option letter the response names (in the `<answer>`
block when there is one), right when it is `label`. V*'s own script (vstar_bench_eval.py) scores open models by
the likelihood of each option instead of generating; the generate-and-read-the-letter form here is the one
zoom-in agent papers (e.g. DeepEyes, Chain-of-Focus) report, and it is what lets an agent recipe's tools run (a
checkpoint trained with `agent.tools` is evaluated with them). Accuracy per category as the paper's table.
"""

from __future__ import annotations

from typing import Any

from vlmrl.data.files import RowError
from vlmrl.eval.benchmarks.extract import choice_letter, final_answer
from vlmrl.eval.benchmarks.registry import Benchmark, register_benchmark
from vlmrl.rewards.parsing import completion_text


def adapt(row: dict) -> dict:
    label = str(row["label"]).strip().strip("()")
    if len(label) != 1 or not label.isalpha():
        raise RowError(f"'label' must be one option letter, got {row['label']!r}")
    return {"id": str(row["question_id"]), "image": row["image"], "problem": str(row["text"]),
            "solution": label.upper(), "answer_type": "text", "category": row["category"]}


def score(completions: list, solution: list, **_: Any) -> list[float | None]:
    """1.0 when the response's option letter is the label (letters A-D: V* questions have 2 or 4 options)."""
    out: list[float | None] = []
    for text, label in zip(completions, solution, strict=True):
        picked = choice_letter(final_answer(completion_text(text)), 4)
        out.append(float(picked == str(label)))
    return out


VSTAR = register_benchmark(Benchmark(
    name="vstar", hub="craigwu/vstar_bench", split="test", adapt=adapt, score=score,
    columns=("image", "text", "category", "question_id", "label"), answer_type="text", categories=("category",),
    max_new_tokens=1024, image_root="repo",
    source="Wu and Xie, CVPR 2024 (arXiv:2312.14135); github.com/penghao-wu/vstar",
    notes="generated letter instead of the official option-likelihood scoring",
))
