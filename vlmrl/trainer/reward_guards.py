"""Guards that end a run trained against a learned reward before it games it (docs/rewards.md, "Guards").

A learned reward (an outcome or process RM, the LLM judge) can be pleased by answers that are not right: the
proxy keeps rising while the gold falls, and the further the policy drifts from its start, the more (Gao et al.
2023 measured both against KL from the start). Two guards a recipe can turn on, each ending the run after the step
that trips it, with a checkpoint and a held-out evaluation of that step, and saying why:

- `trainer.kl_budget`: the mean per-token KL from the RL start (the `kl` metric, `algorithm.kl_estimator`) over the
  last `KLBudget.WINDOW` steps exceeds the budget. The RL start is loaded as a reference for it when
  `algorithm.beta` is 0 (a second copy of the weights, and one more forward per step);
- `trainer.stop_on_overoptimisation`: `OverOptimisationWatch` fires (a learned reward rose on the held-out set while
  held-out accuracy fell below its peak's interval), so it acts on every `trainer.eval_every` evaluation.

A third, the ensemble's disagreement as a penalty, is a reward setting (`reward_model` with a list of paths and
`disagreement_coef`), not a stop.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vlmrl.config import Config


@dataclass
class GuardStop:
    """Why and where a guard ended the run, and the held-out evaluation of that step (None until it has run)."""

    step: int
    reason: str
    held_out: dict | None = None


class KLBudget:
    """Feed it every RL step's metrics; `update` returns why the run must end once the mean `kl` of the last WINDOW
    steps exceeds `trainer.kl_budget` (None while within it, or without a budget)."""

    WINDOW = 10

    def __init__(self, cfg: Config):
        self.budget = cfg.trainer.kl_budget
        self.recent: deque[float] = deque(maxlen=self.WINDOW)

    def update(self, step: int, metrics: dict) -> str | None:
        if self.budget is None or metrics.get("kl") is None:
            return None
        self.recent.append(float(metrics["kl"]))
        mean = sum(self.recent) / len(self.recent)
        if len(self.recent) < self.WINDOW or mean <= self.budget:
            return None
        return (f"step {step}: the mean per-token KL from the RL start over the last {self.WINDOW} steps, "
                f"{mean:.4f}, exceeds trainer.kl_budget={self.budget}: the run ends here (a larger budget, or "
                f"algorithm.beta > 0 to hold the policy nearer its start, lets it go on)")
