"""The learned value function for PPO with GAE (`algorithm.advantage: gae`).

Two layouts, chosen by `algorithm.critic`:
- "head": a linear value head on the policy's final hidden states; one forward serves log-probs and values, and the
  value loss (times `vf_coef`) joins the policy loss.
- "separate": a copy of the starting policy with its own value head and optimizer (PPO-RLHF's critic).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vlmrl.models.batch import PromptBatch
from vlmrl.models.forward import sequence_logprobs
from vlmrl.models.policy import Policy
from vlmrl.models.scoring import score_batch
from vlmrl.optim import adamw


class Critic:
    def __init__(self, policy: Policy, mode: str = "head", lr: float = 1e-3):
        if mode not in ("head", "separate"):
            raise ValueError(f"algorithm.critic must be 'head' or 'separate', got {mode!r}")
        self.mode = mode
        self.trunk = policy
        if mode == "separate":
            self.trunk = policy.clone()  # (its family keeps the policy's autocast setting)
        hidden = policy.model.config.text_config.hidden_size
        self.head = nn.Linear(hidden, 1).to(policy.model.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        params = list(self.head.parameters())
        if mode == "separate":
            params += [p for p in self.trunk.model.parameters() if p.requires_grad]
        self.optimizer = adamw(params, lr)

    def values_from_hidden(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """V_t [N, T] from the hidden states that predict token t (0 on padding)."""
        return self.head(hidden.float()).squeeze(-1) * mask

    def values(self, prompts: PromptBatch, prompt_index: Tensor, ids: Tensor, mask: Tensor,
               temperature: float, micro_batch: int = 0, micro_batch_tokens: int = 0) -> Tensor:
        """A forward of the critic's trunk (the policy itself in "head" mode); with gradients for the separate
        critic's update, else (no grad) in the update's chunks of rows."""
        if torch.is_grad_enabled():
            out = sequence_logprobs(self.trunk, prompts, prompt_index, ids, mask, temperature, with_hidden=True)
            return self.values_from_hidden(out.hidden, mask)
        return score_batch(self.trunk, prompts, prompt_index, ids, mask, temperature, micro_batch, micro_batch_tokens,
                           hidden_fn=self.values_from_hidden).hidden

    def state_dict(self) -> dict:
        state = {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.mode == "separate":
            state["trunk"] = self.trunk.model.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        if self.mode == "separate":
            self.trunk.model.load_state_dict(state["trunk"])
        self.optimizer.load_state_dict(state["optimizer"])
