"""Offline DPO for VLMs: preference rows {image, prompt, chosen, rejected}, reference log-probs computed once.

`vlmrl train` runs this instead of the RL loop when the recipe sets `data.preferences`. Online DPO (pairs from the
policy's own groups) is `algorithm.policy_loss: dpo` in the RL loop (`vlmrl/trainer/update.py`).

Under torchrun every rank draws the same pairs for a step and trains its own contiguous share of them through the
update's wrapped forward, the loss summed over the share and divided by the step's whole pair count (times the
number of ranks: DDP and FSDP2 average the ranks' gradients), so N ranks take the step one process takes; the
non-finite guard decides with every rank, and the logged loss, margin and accuracy are the whole step's.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from vlmrl.algorithms.losses import dpo_loss
from vlmrl.config import Config
from vlmrl.errors import DataError
from vlmrl.models.forward import sequence_logprobs
from vlmrl.models.policy import Policy
from vlmrl.rollout.batch import make_prompts
from vlmrl.trainer.distributed import DistInfo, all_sum, shard
from vlmrl.trainer.guard import NonfiniteGuard, guarded_step
from vlmrl.trainer.sft import target_ids


def synthetic_preferences(samples: list[dict], target_template: str, seed: int = 0) -> list[dict]:
    """Preference pairs from labelled samples: chosen = the labelled answer; rejected = a wrong one (a number off
    by one for numeric answers, another sample's different answer otherwise)."""
    rng = random.Random(seed)
    answers = sorted({s["solution"] for s in samples})
    out = []
    for s in samples:
        if s.get("answer_type") == "number" and s["solution"].lstrip("-").isdigit():
            value = int(s["solution"])
            wrong = str(value + 1 if value == 0 or rng.random() < 0.5 else value - 1)
        else:
            others = [a for a in answers if a != s["solution"]]
            if not others:
                continue
            wrong = rng.choice(others)
        out.append({**s, "chosen": target_template.format(**s), "rejected": target_template.format(
            **{**s, "solution": wrong})})
    return out


class OfflineDPO:
    """DPO on a fixed preference set; the reference (the starting policy) is evaluated once, at construction."""

    def __init__(self, policy: Policy, reference: Policy, pairs: list[dict], cfg: Config):
        for s in pairs:
            if not isinstance(s.get("chosen"), str) or not isinstance(s.get("rejected"), str):
                raise DataError(f"preference sample {s.get('id')!r}: needs string 'chosen' and 'rejected' answers")
        self.policy, self.pairs, self.cfg = policy, pairs, cfg
        self.guard, self.steps = NonfiniteGuard(), 0  # optimizer steps skipped for a NaN/inf; steps taken
        with torch.no_grad():
            reference.model.eval()
            ref = [self._logprobs(reference, pairs[i:i + 64]) for i in range(0, len(pairs), 64)]
        self.ref_chosen = torch.cat([r[0] for r in ref])
        self.ref_rejected = torch.cat([r[1] for r in ref])

    def _logprobs(self, policy: Policy, pairs: list[dict], forward=None) -> tuple[Tensor, Tensor]:
        """Sequence log-probs (sum over answer tokens, end token included) of chosen and rejected answers, through
        `forward` (the update's training forward; default the policy's own)."""
        d = self.cfg.data
        prompts = make_prompts(policy, pairs, d.prompt_template, d.max_prompt_length)
        ids, mask = target_ids(policy, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs])
        args = (prompts, torch.arange(len(pairs)).repeat(2), ids, mask, 1.0)
        out = forward(*args) if forward is not None else sequence_logprobs(policy, *args)
        logp = out.logprobs.sum(-1)
        return logp[:len(pairs)], logp[len(pairs):]

    def step(self, rows: list[int], optimizer: torch.optim.Optimizer, scheduler, forward=None,
             dist: DistInfo | None = None) -> dict[str, float]:
        """One optimizer step on the pairs `rows` (guarded: a non-finite loss or gradient norm is skipped and
        counted; the schedule advances only after a step). `forward`, `dist`: the update's training forward and this
        rank's DistInfo under torchrun (module docstring)."""
        algo, t, dist = self.cfg.algorithm, self.cfg.trainer, dist or DistInfo()
        optimizer.zero_grad(set_to_none=True)
        start, end = shard(len(rows), dist) if dist.active else (0, len(rows))
        mine = rows[start:end]
        chosen, rejected = self._logprobs(self.policy, [self.pairs[i] for i in mine], forward)
        idx = torch.tensor(mine)
        losses, margin = dpo_loss(chosen, rejected, self.ref_chosen[idx], self.ref_rejected[idx], algo.dpo_beta,
                                  algo.dpo_label_smoothing)
        (losses.sum() / len(rows) * dist.world).backward()  # the mean over all ranks' pairs (one process: .mean())
        sums = all_sum(torch.stack([losses.detach().sum(), margin.detach().sum(), (margin > 0).float().sum()]), dist)
        loss, mean_margin, accuracy = (sums / len(rows)).tolist()
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.steps += 1
        out = guarded_step([(optimizer, params)], loss, t.max_grad_norm, self.guard, dist, self.steps,
                           t.max_nonfinite_steps)
        if out.stepped[0]:
            scheduler.step()
        return {"loss": loss, "dpo/margin": mean_margin, "dpo/accuracy": accuracy, "grad_norm": out.norms[0],
                "optimizer_steps": float(out.stepped[0]), "nonfinite_steps": float(self.guard.total),
                "lr": scheduler.get_last_lr()[0]}
