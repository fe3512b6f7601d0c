"""The reference policy of the KL penalty and of DPO: the RL start, held fixed.

With full fine-tuning it is a frozen copy of the policy (or `checkpoint-0`, when resuming). Under LoRA it is the
policy itself with its adapters disabled: the base weights the adapters sit on are exactly the RL start, so no second
copy of the model is kept in memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from vlmrl.models.batch import PromptBatch
from vlmrl.models.policy import Policy, load_policy
from vlmrl.models.scoring import score_batch


class Reference:
    """`logprobs(...)` of the reference; `active()` yields it as a Policy (for code that takes one, e.g. DPO)."""

    def __init__(self, policy: Policy, frozen: Policy | None = None):
        if frozen is None and not policy.has_adapters:
            raise ValueError("a reference without a frozen copy needs a LoRA policy (adapters to disable)")
        self.policy, self.frozen = policy, frozen
        if frozen is not None:
            frozen.model.eval().requires_grad_(False)

    @classmethod
    def of(cls, policy: Policy, checkpoint: str | Path | None = None, **load_kwargs) -> Reference:
        """LoRA: the policy with adapters disabled. Otherwise a frozen copy of `policy`, or of `checkpoint` (the
        RL start when resuming a later checkpoint), loaded with `load_kwargs`."""
        if policy.has_adapters:
            return cls(policy)
        if checkpoint is not None:
            return cls(policy, load_policy(checkpoint, **load_kwargs))
        return cls(policy, policy.clone())

    @property
    def shares_weights(self) -> bool:
        return self.frozen is None

    @contextlib.contextmanager
    def active(self) -> Iterator[Policy]:
        """The reference as a Policy, in eval mode; under LoRA only inside this block (adapters back on after)."""
        if self.frozen is not None:
            yield self.frozen
            return
        model = self.policy.model
        was_training = model.training
        model.eval()
        try:
            with model.disable_adapter():
                yield self.policy
        finally:
            model.train(was_training)

    @torch.no_grad()
    def logprobs(self, prompts: PromptBatch, prompt_index: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                 temperature: float, micro_batch: int = 0, micro_batch_tokens: int = 0) -> Tensor:
        """Per-token log-probs [N, T] of the completions under the reference (0 on padding), in the update's chunks.
        Under FSDP2 with LoRA call it with full parameters (inside `gathered(forward)`): it runs the policy itself."""
        with self.active() as ref:
            return score_batch(ref, prompts, prompt_index, completion_ids, completion_mask, temperature, micro_batch,
                               micro_batch_tokens).logprobs
