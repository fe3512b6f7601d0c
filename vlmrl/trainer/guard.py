"""The optimizer step, guarded: a non-finite loss or gradient norm never reaches the weights.

`guarded_step` clips every parameter group's gradient, then decides for all ranks together (one all-reduce of the
flags, so no rank steps while another skips):

- a non-finite loss or gradient norm on any rank skips the step on every rank and is counted (`NonfiniteGuard.total`,
  the run's `nonfinite_steps` curve); `limit` such steps in a row raise `TrainingError` naming the step;
- a parameter group whose gradient is exactly zero (every advantage 0 and nothing else in the loss) is not stepped:
  AdamW would only replay its momentum and weight decay on weights the batch says nothing about.

The caller advances the learning-rate schedule only when a policy step ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vlmrl.errors import TrainingError
from vlmrl.trainer.distributed import DistInfo, all_max

LIKELY_CAUSES = ("a learning rate too high for this model (trainer.lr); fp16 overflow (use model.dtype bfloat16 or "
                 "float32); a reward, advantage or custom loss that returns inf/NaN; a policy far from its reference "
                 "or old log-probs (a huge KL or importance ratio)")


@dataclass
class NonfiniteGuard:
    """Optimizer steps skipped for a non-finite loss or gradient norm: over the run, and in a row."""

    total: int = 0
    streak: int = 0

    def record(self, finite: bool, step: int, limit: int, detail: str) -> None:
        """Count one optimizer step; raise TrainingError when `limit` (> 0) non-finite ones came in a row."""
        if finite:
            self.streak = 0
            return
        self.total += 1
        self.streak += 1
        if limit and self.streak >= limit:
            raise TrainingError(
                f"step {step}: {self.streak} optimizer steps in a row had a non-finite loss or gradient norm "
                f"({detail}); each was skipped, and the run stops here so that no NaN reaches the weights or a "
                f"checkpoint. Likely causes: {LIKELY_CAUSES}. trainer.max_nonfinite_steps={limit} sets how many in a "
                "row are tolerated")


@dataclass
class StepOutcome:
    norms: list[float]  # gradient norm of each parameter group, before clipping
    stepped: list[bool]  # whether each group's optimizer stepped
    finite: bool  # False: the step was skipped for a non-finite loss or gradient norm


def guarded_step(groups: list[tuple[torch.optim.Optimizer, list]], loss: float, max_norm: float,
                 guard: NonfiniteGuard, dist: DistInfo, step: int, limit: int) -> StepOutcome:
    """Clip and step each (optimizer, params) group unless the step is non-finite anywhere (see the module
    docstring). `loss` is this rank's loss of the step; the gradient norms are global (DDP and FSDP2 reduce them)."""
    norms = [float(torch.nn.utils.clip_grad_norm_(params, max_norm)) for _, params in groups]
    finite = math.isfinite(loss) and all(math.isfinite(n) for n in norms)
    # one collective for every decision: [any rank non-finite, each group's norm (0 if non-finite)] by MAX
    flags = torch.tensor([0.0 if finite else 1.0] + [n if math.isfinite(n) else 0.0 for n in norms],
                         dtype=torch.float64, device=dist.device)
    flags = all_max(flags, dist).tolist()
    finite = flags[0] == 0.0
    guard.record(finite, step, limit, f"last: loss={loss:.4g}, grad_norm={', '.join(f'{n:.4g}' for n in norms)}")
    stepped = []
    for (optimizer, _), norm in zip(groups, flags[1:], strict=True):
        do = finite and norm > 0.0
        if do:
            optimizer.step()
        stepped.append(do)
    if not finite:
        for optimizer, _ in groups:
            optimizer.zero_grad(set_to_none=True)
    return StepOutcome(norms, stepped, finite)
