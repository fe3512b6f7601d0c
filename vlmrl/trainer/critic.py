"""The learned value function for PPO with GAE (`algorithm.advantage: gae`).

Two layouts, chosen by `algorithm.critic`:
- "head": a linear value head on the policy's final hidden states; one forward serves log-probs and values, and the
  value loss (times `vf_coef`) joins the policy loss.
- "separate": a copy of the starting policy with its own value head and optimizer (PPO-RLHF's critic).

Under torchrun (DDP or FSDP2) the critic's parameters (the head; for "separate", its trunk too) are a full copy on
every rank, outside the policy's wrapper: each optimizer step first averages their gradients over the ranks
(`average_gradients`, one all-reduce), so N ranks take the step one process takes on the same global batch. A
separate critic is therefore not sharded: it costs a full model's weights, gradients and optimizer state per rank.
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

    def parameters(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def average_gradients(self, info) -> None:
        """Every critic gradient averaged over the ranks (a rank whose chunks held only padding adds zeros): the
        losses are already normalised by the global token count, so the mean over ranks is one process's gradient,
        as DDP and FSDP2 average the policy's. One flat all-reduce."""
        import torch.distributed as dist

        params = self.parameters()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        device = str(info.device)
        flat = flat.to(device if device.startswith("cuda") else "cpu")
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=info.group)
        flat = flat / info.world
        at = 0
        for p in params:
            p.grad = flat[at:at + p.numel()].view_as(p).to(p.device, p.dtype).clone()
            at += p.numel()

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
