"""The training forward: log-probs of completion tokens given their prompt, through the same embeddings as rollout."""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.models.qwen_vl import PromptEmbeds


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[token], as logit[token] - logsumexp(logits): no full log-softmax tensor is kept."""
    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


def completion_logprobs(family, prompt: PromptEmbeds, completion_ids: Tensor, completion_mask: Tensor,
                        temperature: float = 1.0, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs [N, T] of `completion_ids` after each (already group-expanded) prompt row.

    Completion tokens continue the prompt's M-RoPE positions, exactly as during generation; logits are divided by
    the sampling temperature (temperature 0 = greedy counts as 1). Padding positions hold 0.
    """
    n, t = completion_ids.shape
    embeds = torch.cat([prompt.embeds, family.embed_tokens(completion_ids)], dim=1)
    mask = torch.cat([prompt.attention_mask, completion_mask.to(prompt.attention_mask.dtype)], dim=1)
    offsets = torch.arange(t, device=embeds.device)
    completion_pos = (prompt.next_position[:, None] + offsets).unsqueeze(0).expand(3, n, t)
    positions = torch.cat([prompt.position_ids, completion_pos], dim=2)
    hidden = family.forward_hidden(embeds, mask, positions)
    length = prompt.embeds.shape[1]
    logits = family.lm_head(hidden[:, length - 1: length + t - 1])
    if temperature > 0:
        logits = logits / temperature
    logprobs = token_logprobs(logits, completion_ids) * completion_mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits) * completion_mask
    return logprobs, entropy
