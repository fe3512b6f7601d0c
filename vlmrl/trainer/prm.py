"""Process reward models: step-labelled answers, the loss a PRM is fitted with, and its step-level evaluation.

    answer ──► steps (vlmrl.rewards.reasoning.step_spans) ──► p_j = sigmoid(head(h after step j's last token))
    L = mean over steps of BCE(p_j, label_j)

A step-labelled row is a sample (the prompt, its images, the gold `solution`) with a `completion` and its `labels`,
one per reasoning step, in [0, 1]: 1 = the step is right (or, from `vlmrl.trainer.prm_labels`, the share of
continuations from it that reach a right answer). Rows come from a file (`vlmrl rm train data.steps={path: FILE}`),
written by hand or by `vlmrl rm label`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from vlmrl.errors import DataError
from vlmrl.models.reward_model import RewardModel
from vlmrl.rewards.reasoning import step_spans
from vlmrl.rewards.reward_model import text_step_logits


def process_loss(logits: list[Tensor], labels: list[list[float]]) -> Tensor:
    """Binary cross-entropy of every step's logit against its label (soft labels allowed), averaged over all steps of
    the batch: L = -mean_j [y_j log sigmoid(z_j) + (1 - y_j) log(1 - sigmoid(z_j))]; dL/dz_j = (sigmoid(z_j) - y_j)/S
    for S steps in all."""
    z = torch.cat(logits)
    y = torch.tensor([v for row in labels for v in row], dtype=z.dtype, device=z.device)
    return F.binary_cross_entropy_with_logits(z, y)


def check_step_rows(rows: list[dict], split: str, think_tag: str, skip: bool = False) -> tuple[list[dict], int]:
    """(usable rows, rows skipped): each row needs a string `completion` and `labels`, one number in [0, 1] per step
    of the completion as the PRM splits it. A bad row is a DataError naming it, or skipped and counted (`skip`)."""
    good, skipped = [], 0
    for row in rows:
        try:
            completion, labels = row.get("completion"), row.get("labels")
            if not isinstance(completion, str):
                raise DataError("needs a string 'completion' (the answer whose steps are labelled)")
            steps = step_spans(completion, split, think_tag)
            if not steps:
                raise DataError(f"its completion has no reasoning steps when split by {split!r} ({completion!r:.80})")
            if (not isinstance(labels, list) or len(labels) != len(steps)
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
                               for v in labels)):
                raise DataError(f"needs 'labels': {len(steps)} numbers in [0, 1], one per step "
                                f"({[completion[a:b] for a, b in steps]!r:.120}), got {labels!r:.80}")
        except DataError as e:
            if not skip:
                raise DataError(f"step-labelled row {row.get('id')!r}: {e}; fix the row or set "
                                "data.on_error=skip") from None
            skipped += 1
            continue
        good.append({**row, "labels": [float(v) for v in labels]})
    return good, skipped


def row_logits(rm: RewardModel, rows: list[dict]) -> list[Tensor]:
    """The PRM's step logits of each row's completion (its prompt's images encoded once per row)."""
    return text_step_logits(rm, rm.prompts(rows), torch.arange(len(rows)), [r["completion"] for r in rows])


def step_classification(probabilities: list[float], labels: list[float]) -> dict[str, float]:
    """Step-level agreement with labels read as right (>= 0.5) or wrong: accuracy, and precision, recall and F1 of
    finding the wrong steps (p < 0.5), the PRM's job when it selects or guards."""
    pred_wrong = [p < 0.5 for p in probabilities]
    wrong = [y < 0.5 for y in labels]
    tp = sum(a and b for a, b in zip(pred_wrong, wrong, strict=True))
    fp = sum(a and not b for a, b in zip(pred_wrong, wrong, strict=True))
    fn = sum(b and not a for a, b in zip(pred_wrong, wrong, strict=True))
    precision = tp / (tp + fp) if tp + fp else math.nan
    recall = tp / (tp + fn) if tp + fn else math.nan
    f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else math.nan
    right = sum(a == b for a, b in zip(pred_wrong, wrong, strict=True))
    return {"step_accuracy": right / len(labels) if labels else math.nan, "error_precision": precision,
            "error_recall": recall, "error_f1": f1, "steps": float(len(labels)),
            "wrong_steps": float(sum(wrong))}


@torch.no_grad()
def evaluate_steps(rm: RewardModel, rows: list[dict], batch_size: int = 16,
                   teacher: Tensor | None = None) -> dict[str, float]:
    """The PRM on step-labelled rows: its loss, and `step_classification` of all their steps; with `teacher` (a
    distillation teacher's logit of every step, in order), how often the two call a step the same way
    (`teacher_agreement`) and the teacher's own step accuracy against the labels."""
    rm.train(False)
    probabilities, labels, losses = [], [], []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        logits = row_logits(rm, chunk)
        chunk_labels = [r["labels"] for r in chunk]
        losses.append(process_loss(logits, chunk_labels).item() * sum(map(len, chunk_labels)))
        probabilities += torch.sigmoid(torch.cat(logits)).tolist()
        labels += [v for row in chunk_labels for v in row]
    out = {"loss": sum(losses) / len(labels), **step_classification(probabilities, labels)}
    if teacher is not None:
        ours, theirs = torch.tensor(probabilities) >= 0.5, torch.sigmoid(teacher.float()) >= 0.5
        out["teacher_agreement"] = float((ours == theirs).float().mean())
        out["teacher_step_accuracy"] = float((theirs == (torch.tensor(labels) >= 0.5)).float().mean())
    return out
