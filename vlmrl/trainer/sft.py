"""Supervised warm-start: teacher-forced cross-entropy on labelled answers, through the same forward as RL.

The embedded model starts random; real VLMs arrive instruction-tuned. SFT on a small labelled subset plays that role,
so RL starts from a policy that answers in the expected format.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.models.forward import sequence_logprobs
from vlmrl.models.policy import Policy
from vlmrl.rollout.batch import make_prompts


def target_ids(policy: Policy, texts: list[str]) -> tuple[Tensor, Tensor]:
    """Tokenised targets with the end-of-turn token appended, right-padded: (ids [N, T], mask [N, T])."""
    tok = policy.processor.tokenizer
    eos = policy.eos_token_ids[0]
    seqs = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def target_token_count(policy: Policy, samples: list[dict], target_template: str, agent=None) -> int:
    """The target tokens `sft_loss` of `samples` divides by, counted without a forward: each target (or, with an
    agent, each demonstration message) with its end-of-turn token."""
    tok = policy.processor.tokenizer
    if agent is not None and all("demonstration" in s for s in samples):
        texts = [m for s in samples for m in s["demonstration"]]
    else:
        texts = [target_template.format(**s) for s in samples]
    return sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts)


def sft_loss(policy: Policy, samples: list[dict], target_template: str, template: str = "{problem}",
             max_prompt_length: int | None = None, agent=None, forward=None, tokens: Tensor | None = None) -> Tensor:
    """Mean negative log-likelihood per target token. With `agent` (vlmrl.agent.AgentSpec), samples that carry a
    `demonstration` are trained on it, replayed through their environment (vlmrl.agent.demos): every message of
    the policy is a target, the observations between them are context.

    `forward`: the training forward to run (the RL update's, wrapped by DDP/FSDP2; default the policy's own).
    `tokens`: what to divide the summed NLL by (default these samples' target tokens; a rank's shard of a batch
    passes the whole batch's count)."""
    prompts = make_prompts(policy, samples, template, max_prompt_length)
    device = policy.model.device
    if agent is not None and all("demonstration" in s for s in samples):
        from vlmrl.agent.demos import demonstration_batch

        prompts, ids, mask = demonstration_batch(policy, agent, prompts, samples)
    else:
        ids, mask = target_ids(policy, [target_template.format(**s) for s in samples])
    args = (prompts, torch.arange(len(samples)), ids.to(device), mask.to(device), 1.0)
    logp = (forward(*args) if forward is not None else sequence_logprobs(policy, *args)).logprobs
    return -(logp.sum() / (mask.sum() if tokens is None else tokens))


def sft_step(policy: Policy, optimizer: torch.optim.Optimizer, samples: list[dict], target_template: str,
             template: str = "{problem}", max_grad_norm: float = 1.0, max_prompt_length: int | None = None,
             agent=None) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = sft_loss(policy, samples, target_template, template, max_prompt_length, agent)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in policy.model.parameters() if p.requires_grad], max_grad_norm)
    optimizer.step()
    return loss.item()
