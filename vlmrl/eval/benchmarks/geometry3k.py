"""Geometry3K (test, 601 problems) in the EasyR1 setting.

Source: Lu et al., "Inter-GPS", ACL 2021 (arXiv:2105.04165), as hiyouga/geometry3k packages it (read: `images`,
`problem`, `answer`; the card also lists `id`, `choices`, `ground_truth`; splits train/validation/test of 2,101 /
300 / 601 rows); protocol: EasyR1 (github.com/hiyouga/EasyR1), examples/format_prompt/math.jinja (math_format.jinja
in v0.3.0: the prompt suffix below) and examples/reward_function/math.py (score_function/math.py in v0.3.0: the
answer is the last `\\boxed{}` anywhere in the response, a `<think>` block included (mathruler's
`extract_boxed_content` is an `rfind`), graded by mathruler's `grade_answer`; the response first loses the whitespace
around `<`, `>` and `/`). vlmrl grades the boxed answer with the `accuracy` reward's
math check (normalised text, numbers, then math-verify), not mathruler; the `<image>` marker in `problem` is
removed (vlmrl's processor places the image before the text, as EasyR1's chat template does for one image).
"""

from __future__ import annotations

import re
from typing import Any

from vlmrl.data.files import RowError
from vlmrl.eval.benchmarks.registry import Benchmark, register_benchmark
from vlmrl.rewards.parsing import completion_text, extract_boxed
from vlmrl.rewards.verifiable import accuracy_reward

EASYR1_MATH_SUFFIX = (" You FIRST think about the reasoning process as an internal monologue and then provide the final "
                      "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                      "MUST BE put in \\boxed{}.")
def geometry3k_row(row: dict) -> dict:
    images = row["images"]
    if not isinstance(images, list) or not images:
        raise RowError(f"'images' must be a list of at least one image, got {type(images).__name__}")
    problem = str(row["problem"]).replace("<image>", "").strip()
    return {"images": images, "problem": problem + EASYR1_MATH_SUFFIX, "solution": str(row["answer"]),
            "answer_type": "math"}


def geometry3k_score(completions: list, solution: list, **_: Any) -> list[float | None]:
    """EasyR1's accuracy: the last `\\boxed{}` of the whole response, inside `<think>` too, graded against the answer
    (math-verify in place of mathruler)."""
    texts = [re.sub(r"\s*(<|>|/)\s*", r"\1", completion_text(c)) for c in completions]  # as EasyR1's compute_score
    boxed = [extract_boxed(t) for t in texts]  # mathruler's extract_boxed_content: text.rfind(r"\boxed{")
    return accuracy_reward([f"<answer>{b}</answer>" if b is not None else "" for b in boxed], list(solution),
                           answer_type=["math"] * len(texts), strict=False)


def easyr1_format(completions: list, **_: Any) -> list[float | None]:
    """EasyR1's format reward (examples/reward_function/math.py): 1.0 when the response is a `<think>...</think>`
    block followed by a `\\boxed{...}` answer, after its whitespace normalisation around `<`, `>` and `/`. The seed
    recipe recipes/easyr1_geometry3k.yaml weights it 0.1, as EasyR1's `format_weight`."""
    pattern = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
    texts = [re.sub(r"\s*(<|>|/)\s*", r"\1", completion_text(c)) for c in completions]
    return [1.0 if pattern.fullmatch(t) else 0.0 for t in texts]


GEOMETRY3K = register_benchmark(Benchmark(
    name="geometry3k", hub="hiyouga/geometry3k", split="test", adapt=geometry3k_row, score=geometry3k_score,
    columns=("images", "problem", "answer"), answer_type="math", max_new_tokens=2048,
    source="Lu et al., ACL 2021 (Inter-GPS); EasyR1 examples/format_prompt/math.jinja, examples/reward_function/math.py",
    notes="math-verify grades the boxed answer in place of mathruler's grade_answer",
))
