"""The training forward: log-probs of completion tokens given their prompt, through the same embeddings as rollout."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from vlmrl.models.batch import PromptBatch, PromptEmbeds


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[token], as logit[token] - logsumexp(logits): no full log-softmax tensor is kept."""
    logits = logits.float()
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per position."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


class CompletionOutput(NamedTuple):
    logprobs: Tensor  # [N, T] log-prob of each completion token (0 on padding)
    entropy: Tensor | None  # [N, T] entropy of the next-token distribution, when asked for
    hidden: Tensor | None  # [N, T, H] final hidden states that predicted each token (for a value head)


def completion_logprobs(family, prompt: PromptEmbeds, completion_ids: Tensor, completion_mask: Tensor,
                        temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                        with_hidden: bool = False, rows: Tensor | None = None) -> CompletionOutput:
    """Per-token log-probs [N, T] of `completion_ids` after their prompts.

    `prompt` holds one row per completion, or, with `rows`, one row per distinct prompt and `rows[n]` the prompt of
    completion n: each prompt then goes through the decoder once, with gradients, and its KV cache is shared by its
    completions (as in generation), instead of being recomputed for each of its G answers.

    Completion tokens continue the prompt's positions (M-RoPE or 1-D), exactly as during generation, and the
    family's prompt extras (Qwen3-VL deepstack, Gemma 3 image-block attention) apply as in the prefill; logits are
    divided by the sampling temperature (temperature 0 = greedy counts as 1). Padding positions hold 0. The entropy is
    detached unless `entropy_grad` (an entropy bonus needs its gradient).
    """
    n, t = completion_ids.shape
    if rows is None:
        embeds = torch.cat([prompt.embeds, family.embed_tokens(completion_ids)], dim=1)
        mask = torch.cat([prompt.attention_mask, completion_mask.to(prompt.attention_mask.dtype)], dim=1)
        positions = torch.cat([prompt.position_ids, prompt.completion_positions(0, t)], dim=2)
        hidden = family.forward_hidden(embeds, mask, positions, extras=prompt.extras)
        length = prompt.embeds.shape[1]
        hidden = hidden[:, length - 1: length + t - 1]
    else:
        # prefill once per prompt; the hidden state of its last token predicts every answer's first token
        cache = family.new_cache()
        last = family.forward_hidden(prompt.embeds, prompt.attention_mask, prompt.position_ids, cache,
                                     prompt.extras)[:, -1]
        hidden = last[rows].unsqueeze(1)
        if t > 1:  # tokens 0..t-2 predict tokens 1..t-1, attending to their prompt's (shared) keys and values
            cache.batch_select_indices(rows)
            expanded = prompt.select(rows)
            mask = torch.cat([expanded.attention_mask, completion_mask[:, :-1].to(expanded.attention_mask.dtype)], 1)
            tail = family.forward_hidden(family.embed_tokens(completion_ids[:, :-1]), mask,
                                         expanded.completion_positions(0, t - 1), cache)
            hidden = torch.cat([hidden, tail], dim=1)
    logits = family.lm_head(hidden)
    if temperature > 0:
        logits = logits / temperature
    logprobs = token_logprobs(logits, completion_ids) * completion_mask
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = token_entropy(logits) * completion_mask
    return CompletionOutput(logprobs, entropy, hidden if with_hidden else None)


def sequence_logprobs(policy, prompts: PromptBatch, prompt_index: Tensor, completion_ids: Tensor,
                      completion_mask: Tensor, temperature: float, **kwargs) -> CompletionOutput:
    """`completion_logprobs` for rows of `prompts` chosen by `prompt_index`: each prompt's images go through the
    vision tower once, and its tokens through the decoder once, for all of its answers in this call (only the prompts
    that are used are encoded).

    Only the columns up to the last masked-in completion token are computed (causal attention: later columns cannot
    change earlier ones); the outputs are zero-padded back to the full width."""
    used = sorted(set(prompt_index.tolist()))
    sub = prompts.subset(used) if used != list(range(len(prompts))) else prompts
    local = {p: i for i, p in enumerate(used)}
    rows = torch.tensor([local[p] for p in prompt_index.tolist()], device=completion_ids.device)
    embeds = policy.family.prompt_embeds(sub)
    # one answer per prompt: nothing to share; transformers turns the KV cache off under gradient checkpointing
    if len(used) == len(rows) or getattr(policy.model, "is_activation_checkpointing", False):
        embeds, rows = embeds.select(rows), None
    full = completion_ids.shape[1]
    live = completion_mask.any(0).nonzero()
    width = int(live.max()) + 1 if len(live) else 1
    out = completion_logprobs(policy.family, embeds, completion_ids[:, :width], completion_mask[:, :width],
                              temperature, rows=rows, **kwargs)
    if width == full:
        return out
    pad = full - width
    return CompletionOutput(F.pad(out.logprobs, (0, pad)), None if out.entropy is None else F.pad(out.entropy, (0, pad)),
                            None if out.hidden is None else F.pad(out.hidden, (0, 0, 0, pad)))
