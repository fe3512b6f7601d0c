"""Mixed SFT + RL: the supervised loss on labelled samples, added to the RL update's loss (`replay` in a recipe).

RL only improves what its reward measures; a skill the reward never sees (another task the SFT start could do) can
drift away while RL trains. Replay keeps it: on every `replay.every`-th RL step, each optimizer step of the update
also backpropagates `replay.weight` x the SFT loss (`vlmrl.trainer.sft.sft_loss`, mean negative log-likelihood per
target token) of `replay.batch_size` labelled samples drawn with the run's generator. The gradient of the step is
then grad(RL loss) + weight x grad(SFT loss on that batch); the learning rate, clipping and the non-finite guard are
the RL step's.

Under torchrun every rank draws the same batch (the run's generator is the same on every rank) and trains its own
contiguous share of it through the update's wrapped forward, the NLL summed over the share and divided by the whole
batch's target tokens, so N ranks add the gradient one process adds (DDP and FSDP2 average over ranks: each rank's
share is scaled by the number of ranks). `replay.batch_size` must then be a multiple of the number of processes.
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

    def backward(self, policy: Policy, generator: torch.Generator, forward=None, dist=None) -> float:
        """Accumulate weight x grad(SFT loss) of a fresh batch into the parameters' gradients, through `forward`
        (the update's training forward; default the policy's own); returns the batch's SFT loss. `dist`: this
        rank's DistInfo under torchrun (module docstring)."""
        batch = self.draw(generator)
        if dist is None or not dist.active:
            loss = sft_loss(policy, batch, self.target_template, self.template, self.max_prompt_length, self.agent,
                            forward)
            (self.weight * loss).backward()
            return loss.item()
        from vlmrl.trainer.distributed import all_sum, shard
        from vlmrl.trainer.sft import target_token_count

        total = target_token_count(policy, batch, self.target_template, self.agent)
        start, end = shard(len(batch), dist)
        loss = sft_loss(policy, batch[start:end], self.target_template, self.template, self.max_prompt_length,
                        self.agent, forward, tokens=torch.tensor(float(total)))
        (self.weight * dist.world * loss).backward()  # DDP/FSDP2 average the ranks' gradients
        return float(all_sum(loss.detach(), dist))
