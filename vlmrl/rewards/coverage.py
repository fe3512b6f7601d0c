"""Every answer type in the data has a reward that grades it, checked before any work.

A reward returns None for a sample it does not apply to, and that component is left out of the sample's total, by
design. When no weighted reward grades an answer type (a box answer under `accuracy` alone, say), its prompts are
trained on what is left: the shaping rewards (`format`, `length`) or nothing, and the policy learns "be short" on
them while the run looks healthy. `check_coverage` refuses such a recipe up front, naming the answer type, a sample
and the reward to add; during training the answers no weighted grading reward scored are counted per task
(`task/<task>/ungraded_answers`, `vlmrl.trainer.watch.UngradedWatch`), which also catches a user reward or a
solution that gives None where the declaration said it would grade.

What a reward grades is declared where it is registered (`register_reward(grades=...)`, read by `graded_types`).
A reward without a declaration (a user's own function, `process`) is trusted to grade every answer type up front,
and measured during training.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmrl.errors import ConfigError
from vlmrl.rewards.registry import RewardSpec, answer_type_of, graded_types, resolve_reward

SUGGESTED = {"box": "iou", "number": "accuracy", "text": "accuracy", "math": "accuracy", "choice": "accuracy"}


def grading_specs(specs: Sequence[RewardSpec], kind: str) -> list[RewardSpec]:
    """The components with a positive weight that grade answers of type `kind` (or may: undeclared)."""
    out = []
    for spec in specs:
        grades = graded_types(resolve_reward(spec.name))
        if spec.weight > 0 and (grades is None or kind in grades):
            out.append(spec)
    return out


def check_coverage(specs: Sequence[RewardSpec], samples: Sequence[dict], where: str = "data.train") -> None:
    """ConfigError naming the first answer type in `samples` that no weighted reward grades, with a sample of it
    and the reward to add."""
    first: dict[str, dict] = {}
    counts: dict[str, int] = {}
    for s in samples:
        kind = answer_type_of(s) or "text"
        first.setdefault(kind, s)
        counts[kind] = counts.get(kind, 0) + 1
    for kind, sample in first.items():
        if grading_specs(specs, kind):
            continue
        weighted = ", ".join(f"{s.key} ({s.weight:g})" for s in specs) or "none"
        add = SUGGESTED.get(kind, "accuracy")
        raise ConfigError(
            f"{where}: {counts[kind]} of {len(samples)} samples have answer_type {kind} (e.g. sample "
            f"{sample.get('id')!r} of task {sample.get('task')!r}, solution {sample.get('solution')!r}), and no "
            f"reward with a positive weight grades {kind} answers (rewards: {weighted}): their prompts would be "
            f"trained on shaping rewards alone. Add {{name: {add}, weight: 1.0}} to rewards (docs/rewards.md, "
            f"\"Every sample has a reward that applies\"), or remove those samples")
