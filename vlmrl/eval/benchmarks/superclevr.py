"""SuperCLEVR counting (200 problems) as R1-V evaluates it.

Source: R1-V (github.com/Deep-Agent/R1-V), src/eval/test_qwen2vl_counting_superclevr.py with
prompts/superclevr_test200_counting_problems.jsonl (`image_path`, `question`, `ground_truth`): greedy decoding, 256
new tokens, the question followed by the template below, the answer the first integer inside `<answer>...</answer>`
(`<answer>\\s*(\\d+)\\s*</answer>`), right when it equals `ground_truth` (all checked at R1-V commit bbbbe3d). The
dataset form read here is that file with its images, as jigsaw-r1/super_clevr packages it: one parquet file as split
test, with the columns `image`, `question`, `ground_truth` that Jigsaw-R1's utils/utils.py reads. Its feature types
are unconfirmed (the card lists no features, only a text modality: `image` may hold encoded bytes, which vlmrl
reads, and `ground_truth` an integer or its text, both accepted here), as is its row count (under 1K on the card).
Images: Li et al., "Super-CLEVR", CVPR 2023.
"""

from __future__ import annotations

import re
from typing import Any

from vlmrl.data.files import RowError
from vlmrl.eval.benchmarks.registry import Benchmark, register_benchmark
from vlmrl.rewards.parsing import completion_text

R1V_COUNTING_TEMPLATE = ("{question} First output the thinking process in <think> </think> and final answer (number) in "
                         "<answer> </answer> tags.")
_R1V_ANSWER = re.compile(r"<answer>\s*(\d+)\s*</answer>")


def superclevr_row(row: dict) -> dict:
    truth = row["ground_truth"]
    if isinstance(truth, str) and truth.strip().isdigit():  # R1-V's jsonl has ints; a parquet copy may hold text
        truth = int(truth)
    if isinstance(truth, bool) or not isinstance(truth, int):
        raise RowError(f"'ground_truth' must be an integer count, got {truth!r}")
    return {"image": row["image"], "problem": R1V_COUNTING_TEMPLATE.format(question=row["question"]),
            "solution": str(truth), "answer_type": "number"}


def superclevr_score(completions: list, solution: list, **_: Any) -> list[float | None]:
    """R1-V's `extract_number_answer`: the first `<answer> N </answer>` holding only an integer, equal to the count."""
    out: list[float | None] = []
    for text, truth in zip(completions, solution, strict=True):
        match = _R1V_ANSWER.search(completion_text(text))
        out.append(float(match is not None and int(match.group(1)) == int(truth)))
    return out


SUPERCLEVR = register_benchmark(Benchmark(
    name="superclevr", hub="jigsaw-r1/super_clevr", split="test", adapt=superclevr_row, score=superclevr_score,
    columns=("image", "question", "ground_truth"), answer_type="number", max_new_tokens=256,
    source="R1-V (github.com/Deep-Agent/R1-V) src/eval/test_qwen2vl_counting_superclevr.py; Li et al., Super-CLEVR, "
           "CVPR 2023",
))
