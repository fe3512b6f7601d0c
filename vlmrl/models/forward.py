"""The training forward: log-probs of completion tokens given their prompt, through the same embeddings as rollout.

Memory is bounded by a chunk of tokens, not by the batch: the language-model head, the float32 log-softmax and the
entropy run on at most `chunk_tokens` completion tokens at a time (only real tokens, never padding), so no
`[rows, T, vocab]` tensor is ever held. With gradients, each chunk's logits are recomputed in backward
(activation checkpointing of the head) instead of being kept; a batch that fits in one chunk skips the recompute.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from vlmrl.models.batch import ConversationBatch, PromptBatch, PromptEmbeds

# float32 logits per chunk (2**25 = 128 MiB): 220 tokens of a 151,936-token vocabulary, the whole batch of a tiny one
LOGITS_CHUNK_ELEMENTS = 2**25


def chunk_tokens_for(vocab_size: int, elements: int = LOGITS_CHUNK_ELEMENTS) -> int:
    """Completion tokens per head chunk so that one chunk's float32 logits hold at most `elements` values."""
    return max(1, elements // max(vocab_size, 1))


def _head_chunk(lm_head, hidden: Tensor, tokens: Tensor, temperature: float, with_entropy: bool,
                entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    """Log-prob of `tokens` [M] and the entropy under softmax(float32(lm_head(hidden)) / temperature).

    The logits are upcast before the temperature is applied, exactly as the sampler does, so a bf16 model gives the
    same log-probs in sampling and in training."""
    logits = lm_head(hidden).float()
    if temperature > 0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return logprobs, entropy


def token_scores(lm_head, hidden: Tensor, tokens: Tensor, mask: Tensor, temperature: float = 1.0,
                 with_entropy: bool = False, entropy_grad: bool = False, chunk_tokens: int = 0
                 ) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs [N, T] (and entropies) of `tokens` [N, T] predicted from `hidden` [N, T, H], computed
    only where `mask` is 1 (0 elsewhere), in chunks of `chunk_tokens` tokens (0 = all at once).

    temperature 0 (greedy) counts as 1. The entropy is detached unless `entropy_grad`."""
    n, t = tokens.shape
    where = mask.reshape(-1).nonzero().squeeze(-1)
    # no real token (e.g. every answer overlong-filtered): one position at weight 0, so the head still runs and the
    # result stays in the autograd graph (a backward, and FSDP2's collectives, need it)
    empty = len(where) == 0
    if empty:
        where = torch.zeros(1, dtype=torch.long, device=tokens.device)
    flat_hidden = hidden.reshape(n * t, -1).index_select(0, where)
    flat_tokens = tokens.reshape(-1).index_select(0, where)
    size = chunk_tokens or max(len(where), 1)
    recompute = torch.is_grad_enabled() and flat_hidden.requires_grad and len(where) > size
    parts = []
    for start in range(0, len(where), size):
        args = (lm_head, flat_hidden[start:start + size], flat_tokens[start:start + size], temperature, with_entropy,
                entropy_grad)
        parts.append(checkpoint(_head_chunk, *args, use_reentrant=False) if recompute else _head_chunk(*args))
    weight = 0.0 if empty else 1.0
    zeros = torch.zeros(n, t, dtype=torch.float32, device=hidden.device)
    place = (where // t, where % t)  # (a fresh tensor, not a view: FSDP2 hooks the outputs of the training forward)
    logprobs = zeros.index_put(place, torch.cat([p[0] for p in parts]) * weight)
    entropy = zeros.index_put(place, torch.cat([p[1] for p in parts]) * weight) if with_entropy else None
    return logprobs, entropy


class CompletionOutput(NamedTuple):
    logprobs: Tensor  # [N, T] log-prob of each completion token (0 on padding)
    entropy: Tensor | None  # [N, T] entropy of the next-token distribution, when asked for
    hidden: Tensor | None  # [N, T, H] final hidden states that predicted each token (for a value head)


def head_chunk_tokens(family) -> int:
    """Tokens per head chunk for this model's vocabulary (`LOGITS_CHUNK_ELEMENTS` float32 logits)."""
    head = family.model.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    return chunk_tokens_for(vocab)


def distinct_answers(rows: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(first, inverse): the first row of each distinct (prompt, answer tokens) and, for every row, its distinct
    answer's position in `first` (rows[first][inverse] == rows, and the same for the masked tokens)."""
    key = torch.cat([rows[:, None].to(completion_ids.dtype), completion_ids * completion_mask, completion_mask], 1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    count = int(inverse.max()) + 1
    first = torch.full((count,), len(rows), dtype=torch.long, device=rows.device)
    first = first.scatter_reduce(0, inverse, torch.arange(len(rows), device=rows.device), "amin")
    return first, inverse


def completion_logprobs(family, prompt: PromptEmbeds, completion_ids: Tensor, completion_mask: Tensor,
                        temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                        with_hidden: bool = False, rows: Tensor | None = None,
                        chunk_tokens: int | None = None) -> CompletionOutput:
    """Per-token log-probs [N, T] of `completion_ids` after their prompts.

    `prompt` holds one row per completion, or, with `rows`, one row per distinct prompt and `rows[n]` the prompt of
    completion n: each prompt then goes through the decoder once, with gradients, and its KV cache is shared by its
    completions (as in generation), instead of being recomputed for each of its G answers. An answer that is the
    same tokens as an earlier answer to its prompt is scored once: its outputs are copies, whose backward adds the
    copies' gradients (`distinct_answers`).

    Completion tokens continue the prompt's positions (M-RoPE or 1-D), exactly as during generation, and the
    family's prompt extras (Qwen3-VL deepstack, Gemma 3 image-block attention) apply as in the prefill; logits are
    upcast to float32 and divided by the sampling temperature (temperature 0 = greedy counts as 1) in chunks of
    `chunk_tokens` tokens (None: `head_chunk_tokens(family)`). Padding positions hold 0. The entropy is detached
    unless `entropy_grad` (an entropy bonus needs its gradient).
    """
    n, t = completion_ids.shape
    if rows is not None and n > 1:  # the same answer to the same prompt is one sequence: scored once, copied
        first, inverse = distinct_answers(rows, completion_ids, completion_mask)
        if len(first) < n:
            out = completion_logprobs(family, prompt, completion_ids[first], completion_mask[first], temperature,
                                      with_entropy, entropy_grad, with_hidden, rows[first], chunk_tokens)
            # copied with index_select, whose backward adds in a fixed order (PromptEmbeds.select)
            return CompletionOutput(*(None if x is None else x.index_select(0, inverse) for x in out))
    if rows is None:
        embeds = torch.cat([prompt.embeds, family.embed_tokens(completion_ids)], dim=1)
        mask = torch.cat([prompt.attention_mask, completion_mask.to(prompt.attention_mask.dtype)], dim=1)
        positions = torch.cat([prompt.position_ids, prompt.completion_positions(0, t)], dim=2)
        hidden = family.forward_hidden(embeds, mask, positions, extras=prompt.extras)
        length = prompt.embeds.shape[1]
        hidden = hidden[:, length - 1: length + t - 1]
    else:
        from vlmrl.models.kv_cache import select_rows  # transformers' cache classes, as family.new_cache

        # prefill once per prompt; the hidden state of its last token predicts every answer's first token
        cache = family.new_cache()
        last = family.forward_hidden(prompt.embeds, prompt.attention_mask, prompt.position_ids, cache,
                                     prompt.extras)[:, -1]
        hidden = last.index_select(0, rows).unsqueeze(1)  # a fixed-order backward (PromptEmbeds.select)
        if t > 1:  # tokens 0..t-2 predict tokens 1..t-1, attending to their prompt's (shared) keys and values
            select_rows(cache, rows)
            expanded = prompt.select(rows)
            mask = torch.cat([expanded.attention_mask, completion_mask[:, :-1].to(expanded.attention_mask.dtype)], 1)
            tail = family.forward_hidden(family.embed_tokens(completion_ids[:, :-1]), mask,
                                         expanded.completion_positions(0, t - 1), cache)
            hidden = torch.cat([hidden, tail], dim=1)
    chunk = head_chunk_tokens(family) if chunk_tokens is None else chunk_tokens
    logprobs, entropy = token_scores(family.lm_head, hidden, completion_ids, completion_mask, temperature,
                                     with_entropy or entropy_grad, entropy_grad, chunk)
    return CompletionOutput(logprobs, entropy, hidden if with_hidden else None)


def conversation_logprobs(family, conversation: PromptEmbeds, completion_tokens: Tensor, completion_ids: Tensor,
                          completion_mask: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                          entropy_grad: bool = False, with_hidden: bool = False,
                          chunk_tokens: int | None = None) -> CompletionOutput:
    """Per-token log-probs [N, T] of `completion_ids`, the last `completion_tokens[n]` tokens of conversation row n
    (a ConversationBatch's embeddings, one row per completion): the whole row goes through the decoder once, and
    completion token j, at column L - c_n + j, is predicted by the column before it. Only tokens where
    `completion_mask` is 1 are scored (a trajectory's own tokens; its observations are context, never scored)."""
    n, t = completion_ids.shape
    hidden = family.forward_hidden(conversation.embeds, conversation.attention_mask, conversation.position_ids,
                                   extras=conversation.extras)
    length = hidden.shape[1]
    c = completion_tokens.to(hidden.device)
    cols = (length - 1 - c[:, None] + torch.arange(t, device=hidden.device)[None, :]).clamp(0, length - 1)
    hidden = hidden.gather(1, cols.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    chunk = head_chunk_tokens(family) if chunk_tokens is None else chunk_tokens
    logprobs, entropy = token_scores(family.lm_head, hidden, completion_ids, completion_mask, temperature,
                                     with_entropy or entropy_grad, entropy_grad, chunk)
    return CompletionOutput(logprobs, entropy, hidden if with_hidden else None)


def shared_prompts(batch: ConversationBatch) -> tuple[list[int], list[int], list[int]]:
    """(groups, first, prompt_lengths): for each conversation row, the index of its prompt among the distinct
    prompts (same sample, same prompt tokens: a group's G trajectories), each distinct prompt's first row, and each
    row's prompt length (its real tokens before its last `completion_tokens`)."""
    real = batch.attention_mask.sum(-1).tolist()
    lengths = [r - c for r, c in zip(real, batch.completion_tokens, strict=True)]
    width = batch.input_ids.shape[1]
    seen: dict[tuple, int] = {}
    groups, first = [], []
    for n, (sid, p, c) in enumerate(zip(batch.sample_ids, lengths, batch.completion_tokens, strict=True)):
        key = (sid, tuple(batch.input_ids[n, width - c - p: width - c].tolist()))
        if key not in seen:
            seen[key] = len(first)
            first.append(n)
        groups.append(seen[key])
    return groups, first, lengths


class SharedPrefill(NamedTuple):
    cache: object  # the KV cache of every row's prompt and tail (tail columns right-padded)
    first: Tensor  # [N, H] the hidden state of each row's last prompt token (predicts its tail's first token)
    tail: Tensor | None  # [N, width, H] the hidden states of each row's first `width` tail tokens
    attention_mask: Tensor  # [N, P + width] the cache's columns: the prompt (left-padded), the tail (right-padded)
    last: Tensor | None = None  # [N, H] each row's last tail token's hidden state, when `tail` is not kept


def shared_prefill(family, batch: ConversationBatch, conversation: PromptEmbeds, width: int,
                   reserve: int = 0) -> SharedPrefill:
    """Each distinct prompt of `batch` through the decoder once for all the rows (trajectories) that start from it,
    its keys and values then copied to those rows, and each row's first `width` tail tokens (its turns and
    observations, image features in place, at the positions its whole row has) after them. `conversation` holds
    every row's embeddings and positions (`family.prompt_embeds(batch)`, no extras); `reserve`: columns the cache
    keeps free after the tail (generation's answer budget). The same math as running every whole row; rounding
    differs. Generation (`reserve`, no gradient) runs the tails in buckets of similar length
    (`vlmrl.models.prefill.bucketed_tails`): the same values bit for bit, with `last` in place of `tail`."""
    from vlmrl.models.kv_cache import select_rows  # transformers' cache classes, as family.new_cache

    device = conversation.embeds.device
    groups, first, lengths = shared_prompts(batch)
    full, hid = conversation.embeds.shape[1], conversation.embeds.shape[-1]
    c = torch.tensor(batch.completion_tokens, device=device)
    # the distinct prompts, left-padded: prompt row g is the columns before row first[g]'s tail
    p_width = max(lengths[r] for r in first)
    p_cols = (full - c[first][:, None] - p_width + torch.arange(p_width, device=device)[None]).clamp(min=0)
    p_real = torch.arange(p_width, device=device)[None] >= (p_width - torch.tensor([lengths[r] for r in first],
                                                                                    device=device))[:, None]
    firsts = torch.tensor(first, device=device)
    p_embeds = conversation.embeds.index_select(0, firsts).gather(1, p_cols[..., None].expand(-1, -1, hid))
    p_mask = p_real.to(conversation.attention_mask.dtype)
    p_pos = conversation.position_ids.index_select(1, firsts).gather(2, p_cols[None].expand(3, -1, -1)) * p_real
    cache = family.new_cache(reserve=width + reserve) if reserve else family.new_cache()
    last = family.forward_hidden(p_embeds, p_mask, p_pos, cache)[:, -1]
    rows = torch.tensor(groups, device=device)
    mask, tail = p_mask.index_select(0, rows), None
    if width > 0:
        j = torch.arange(width, device=device)[None]
        cols = (full - c[:, None] + j).clamp(max=full - 1)
        embeds = conversation.embeds.gather(1, cols[..., None].expand(-1, -1, hid))
        positions = conversation.position_ids.gather(2, cols[None].expand(3, -1, -1))
        if reserve:  # generation: tails of similar length together, when that pads less
            from vlmrl.models.prefill import bucketed_tails

            out = bucketed_tails(family, cache, rows, mask, embeds, positions, list(batch.completion_tokens), reserve)
            if out is not None:
                return SharedPrefill(out[0], last.index_select(0, rows), None, out[1], out[2])
        tail_mask = (j < c[:, None]).to(p_mask.dtype)
        select_rows(cache, rows)
        mask = torch.cat([mask, tail_mask], dim=1)
        tail = family.forward_hidden(embeds, mask, positions, cache)
    return SharedPrefill(cache, last.index_select(0, rows), tail, mask)


def shared_conversation_logprobs(family, batch: ConversationBatch, conversation: PromptEmbeds,
                                 completion_ids: Tensor, completion_mask: Tensor, temperature: float = 1.0,
                                 with_entropy: bool = False, entropy_grad: bool = False, with_hidden: bool = False,
                                 chunk_tokens: int | None = None) -> CompletionOutput:
    """`conversation_logprobs` with each prompt through the decoder once for all the trajectories that start from it
    (a group's G rows, `shared_prefill`), as single-turn training shares a prompt (`completion_logprobs` with
    `rows`). `conversation` holds every row's embeddings."""
    t = completion_ids.shape[1]
    shared = shared_prefill(family, batch, conversation, t - 1)
    hidden = shared.first.unsqueeze(1)  # predicts each trajectory's first completion token
    if shared.tail is not None:  # completion tokens 0..t-2 predict tokens 1..t-1
        hidden = torch.cat([hidden, shared.tail], dim=1)
    chunk = head_chunk_tokens(family) if chunk_tokens is None else chunk_tokens
    logprobs, entropy = token_scores(family.lm_head, hidden, completion_ids, completion_mask, temperature,
                                     with_entropy or entropy_grad, entropy_grad, chunk)
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
    family = policy.family
    embeds = family.prompt_embeds(sub)
    # transformers turns the KV cache off under gradient checkpointing: no shared prompt then
    checkpointed = getattr(policy.model, "is_activation_checkpointing", False)
    if isinstance(sub, ConversationBatch):  # multi-turn trajectories: each row is its own conversation
        if checkpointed or embeds.extras or rows.tolist() != list(range(len(sub))):  # (extras: per whole row)
            return conversation_logprobs(family, embeds.select(rows), torch.tensor(sub.completion_tokens)[rows.cpu()],
                                         completion_ids, completion_mask, temperature, **kwargs)
        return shared_conversation_logprobs(family, sub, embeds, completion_ids, completion_mask, temperature,
                                            **kwargs)
    # one answer per prompt: nothing to share, unless every forward must run the same modules (FSDP2: then the
    # shared path always, its tail included)
    if checkpointed or (len(used) == len(rows) and not family.uniform_calls):
        embeds, rows = embeds.select(rows), None
    full = completion_ids.shape[1]
    live = completion_mask.any(0).nonzero()
    width = int(live.max()) + 1 if len(live) else 1
    if family.uniform_calls:
        width = max(width, min(2, full))
    out = completion_logprobs(family, embeds, completion_ids[:, :width], completion_mask[:, :width],
                              temperature, rows=rows, **kwargs)
    if width == full:
        return out
    pad = full - width
    return CompletionOutput(F.pad(out.logprobs, (0, pad)), None if out.entropy is None else F.pad(out.entropy, (0, pad)),
                            None if out.hidden is None else F.pad(out.hidden, (0, 0, 0, pad)))
