"""Mixed SFT + RL: the supervised loss on labelled samples, added to the RL update's loss (`replay` in a recipe).

RL only improves what its reward measures; a skill the reward never sees (another task the SFT start could do) can
drift away while RL trains. Replay keeps it: on every `replay.every`-th RL step, each optimizer step of the update
also backpropagates `replay.weight` x the SFT loss (`vlmrl.trainer.sft.sft_loss`, mean negative log-likelihood per
target token) of `replay.batch_size` labelled samples drawn with the run's generator. The gradient of the step is
then grad(RL loss) + weight x grad(SFT loss on that batch); the learning rate, clipping and the non-finite guard are
the RL step's.
"""

from __future__ import annotations

import torch

from vlmrl.models.policy import Policy
from vlmrl.trainer.sft import sft_loss


class Replay:
    """Labelled samples and how much of their SFT loss each RL optimizer step adds."""

    def __init__(self, samples: list[dict], weight: float, every: int, batch_size: int, target_template: str,
                 template: str, max_prompt_length: int | None, agent=None):
        if not samples:
            raise ValueError("Replay: no labelled samples (replay.data or data.sft is empty)")
        self.samples, self.weight, self.every, self.batch_size = samples, weight, every, batch_size
        self.target_template, self.template, self.max_prompt_length = target_template, template, max_prompt_length
        self.agent = agent  # vlmrl.agent.AgentSpec: samples with a `demonstration` replay it (vlmrl.agent.demos)

    def due(self, step: int) -> bool:
        return self.weight > 0 and step % self.every == 0

    def draw(self, generator: torch.Generator) -> list[dict]:
        idx = torch.randint(len(self.samples), (self.batch_size,), generator=generator).tolist()
        return [self.samples[i] for i in idx]

    def backward(self, policy: Policy, generator: torch.Generator) -> float:
        """Accumulate weight x grad(SFT loss) of a fresh batch into the parameters' gradients; returns the SFT loss."""
        loss = sft_loss(policy, self.draw(generator), self.target_template, self.template, self.max_prompt_length,
                        self.agent)
        (self.weight * loss).backward()
        return loss.item()
