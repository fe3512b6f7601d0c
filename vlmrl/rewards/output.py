"""`RewardOutput`: the scores of one batch, as `compute_rewards` returns them, and their step metrics.

Two kinds of missing value, kept apart (the reward contract in `vlmrl.rewards.registry`):

- not applicable: the reward returned None for the sample; the component is None and the sample's total simply
  leaves it out, as designed;
- failed: the reward could not score the sample (an exception, a timeout, a wrong-length return, a NaN/inf or a
  `RewardFailure`, e.g. a judge request that gave up). The component is None too, and `failed[i]` is True when a
  component with a non-zero weight failed: the total is then missing a term, so it is not a score. The trainer gives
  such a sample advantage 0 and no loss, leaves it out of its group's statistics, and dynamic sampling does not take
  the gap for signal; it is counted in `reward/failed_samples`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a tensor is built, so reward worker processes start fast
    import torch


@dataclass
class RewardOutput:
    """Scores of one batch.

    total: float32 [N], sum over components of weight * value, skipping None; a sample where every component is
        None or failed gets 0.0 and is counted in `no_reward`.
    components: per component key, the N values (None = not applicable or failed; `failed` tells which).
    failures: per component key, how many of the N values were lost to a failure (an exception or a wrong-length
        return loses all N; a NaN/inf/non-number loses one).
    errors: per component key, the first failure's message (absent when it did not fail).
    failed: bool [N], True where a component with a non-zero weight failed, so `total` is not a score (None: no
        sample failed; `scored()` is the complement either way).
    graded: per sample, whether a component with a positive weight that grades answers gave it a value; False
        means only shaping rewards (format, length) or none scored it: nothing paid a right answer.
    """

    total: torch.Tensor
    components: dict[str, list[float | None]]
    failures: dict[str, int]
    no_reward: int
    errors: dict[str, str] = field(default_factory=dict)
    extra: dict[str, dict[str, float]] = field(default_factory=dict)  # per component: RewardBatch.metrics
    details: dict[str, list[Any]] = field(default_factory=dict)  # per component: RewardBatch.details
    seconds: dict[str, float] = field(default_factory=dict)  # per component: wall time of its call
    failed: torch.Tensor | None = None
    graded: list[bool] | None = None  # per sample: a weighted reward that grades answers applied (None: unknown)

    def scored(self) -> torch.Tensor:
        """bool [N]: the samples whose total is a score (no weighted component failed)."""
        import torch

        if self.failed is None:
            return torch.ones(self.total.shape, dtype=torch.bool)
        return ~self.failed

    def select(self, rows: list[int]) -> RewardOutput:
        """The samples at `rows` (e.g. the groups dynamic sampling keeps); call-level counters are kept as they are."""
        return RewardOutput(self.total[rows], {k: [v[i] for i in rows] for k, v in self.components.items()},
                            self.failures, self.no_reward, self.errors, self.extra,
                            {k: [v[i] for i in rows] for k, v in self.details.items()}, self.seconds,
                            None if self.failed is None else self.failed[rows],
                            None if self.graded is None else [self.graded[i] for i in rows])

    @staticmethod
    def concat(outputs: list[RewardOutput]) -> RewardOutput:
        """Several batches' scores as one; failure counts, reported counters and seconds are summed."""
        import torch

        first = outputs[0]

        def summed(attr):
            return {k: sum(getattr(o, attr).get(k, 0) for o in outputs) for k in getattr(first, attr)}

        failed = None
        if any(o.failed is not None for o in outputs):
            failed = torch.cat([~o.scored() for o in outputs])
        return RewardOutput(torch.cat([o.total for o in outputs]),
                            {k: [v for o in outputs for v in o.components[k]] for k in first.components},
                            summed("failures"), sum(o.no_reward for o in outputs),
                            {k: v for o in outputs for k, v in o.errors.items()},
                            {k: {n: sum(o.extra.get(k, {}).get(n, 0.0) for o in outputs) for n in first.extra[k]}
                             for k in first.extra},
                            {k: [v for o in outputs for v in o.details.get(k, [])] for k in first.details},
                            summed("seconds"), failed,
                            None if any(o.graded is None for o in outputs) else [g for o in outputs for g in o.graded])

    def metrics(self) -> dict[str, float]:
        """Flat metrics: reward/{key}/mean, /std (population std over non-None values; 0.0 when there are none),
        /count (non-None values), /failures, plus any reward/{key}/{name} the reward reported in a RewardBatch;
        reward/total/mean and /std over the scored samples (a failed one has no total); reward/failure_rate (failed
        values / (N * components)); reward/failed_samples (samples left out of training because a weighted
        component failed); reward/no_reward; time/reward/{key} (seconds)."""
        out: dict[str, float] = {}
        for key, values in self.components.items():
            present = [v for v in values if v is not None]
            mean, std = _mean_std(present)
            out[f"reward/{key}/mean"] = mean
            out[f"reward/{key}/std"] = std
            out[f"reward/{key}/count"] = float(len(present))
            out[f"reward/{key}/failures"] = float(self.failures.get(key, 0))
            out.update({f"reward/{key}/{name}": float(v) for name, v in self.extra.get(key, {}).items()})
            if key in self.seconds:
                out[f"time/reward/{key}"] = self.seconds[key]
        scored = self.scored()
        mean, std = _mean_std(self.total[scored].tolist())
        out["reward/total/mean"] = mean
        out["reward/total/std"] = std
        calls = self.total.numel() * len(self.components)
        out["reward/failure_rate"] = sum(self.failures.values()) / calls if calls else 0.0
        out["reward/failed_samples"] = float((~scored).sum())
        out["reward/no_reward"] = float(self.no_reward)
        return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
