"""Visual-RFT's few-shot classification reward, for recipes/visual_rft_flower_4shot.yaml.

Source: Liu et al., "Visual-RFT: Visual Reinforcement Fine-Tuning" (arXiv:2503.01785); github.com/Liuziyu77/Visual-RFT,
src/virft/src/open_r1/grpo_classification.py (`accuracy_reward`) and classification/Qwen2_VL_classification_infere.py
(the same test at evaluation). The answer is the first `<answer>...</answer>` on one line (the regex has no DOTALL
flag), else the whole response; the label is the solution's `<answer>` content, else the solution; both lose their
spaces and underscores and are lower-cased; the answer is right when either contains the other. Departures: an
empty answer pays 0 here (the containment test pays it), and math-verify, which Visual-RFT tries first, is not
consulted (it cannot match a class name that the containment test misses).
"""

from __future__ import annotations

import re
from typing import Any

from vlmrl.rewards.parsing import completion_text

_ONE_LINE_ANSWER = re.compile(r"<answer>(.*?)</answer>")


def _label_text(text: str) -> str:
    match = _ONE_LINE_ANSWER.search(text)
    inner = match.group(1) if match else text
    return inner.strip().replace(" ", "").replace("_", "").lower()


def virft_accuracy(completions: list, solution: list, **_: Any) -> list[float | None]:
    """1.0 when the normalised answer and label contain one another, 0.0 otherwise; None for an empty label."""
    out: list[float | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        label = _label_text(str(sol))
        if not label:
            out.append(None)
            continue
        answer = _label_text(completion_text(completion))
        out.append(float(bool(answer) and (label in answer or answer in label)))
    return out
