"""Score rows of a rollout batch under a model, in chunks: the one helper behind every no-grad log-prob pass.

Old log-probs (when a batch is reused), reference log-probs, critic values and evaluation passes all score the same
kind of rows (prompt index, completion ids, mask) under some model. `score_batch` runs them through
`sequence_logprobs` in the same chunks of rows as the update (`micro_batches`: at most `micro_batch` rows and
`micro_batch_tokens` padded tokens each), and `sequence_logprobs` bounds the head's memory by a chunk of tokens. So
no pass ever holds more than one chunk's activations, whatever the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.models.batch import PromptBatch
from vlmrl.models.forward import CompletionOutput, sequence_logprobs


def row_lengths(prompts: PromptBatch, prompt_index: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: its prompt's length (left padding excluded) and its completion's length, [N] and [N]."""
    return prompts.attention_mask.sum(-1)[prompt_index], mask.sum(-1)


def micro_batches(rows: Tensor, lengths: tuple[Tensor, Tensor] | None, max_rows: int = 0, max_tokens: int = 0
                  ) -> list[Tensor]:
    """Split row indices into forward/backward chunks.

    Without a token budget: consecutive chunks of `max_rows` (0 = one chunk). With `max_tokens`: rows go longest
    first (prompt + completion), and a chunk closes before its padded size, rows x (longest prompt + longest
    completion), would pass `max_tokens` or its row count `max_rows`; a row longer than the budget goes alone. Every
    row lands in exactly one chunk; the order of rows never changes the gradient (losses are normalised by the whole
    minibatch).
    """
    if not max_tokens:
        return list(rows.split(max_rows or max(len(rows), 1)))
    prompt_len, completion_len = (x[rows] for x in lengths)
    order = torch.argsort(prompt_len + completion_len, descending=True, stable=True)
    chunks, current, p_max, c_max = [], [], 0, 0
    for i in order.tolist():
        p, c = max(p_max, int(prompt_len[i])), max(c_max, int(completion_len[i]))
        if current and ((len(current) + 1) * (p + c) > max_tokens or len(current) == (max_rows or len(rows))):
            chunks.append(rows[current])
            current, p, c = [], int(prompt_len[i]), int(completion_len[i])
        current.append(i)
        p_max, c_max = p, c
    return chunks + [rows[current]]


@torch.no_grad()
def score_batch(policy, prompts: PromptBatch, prompt_index: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                temperature: float, micro_batch: int = 0, micro_batch_tokens: int = 0, hidden_fn=None
                ) -> CompletionOutput:
    """Log-probs [N, T] of every row under `policy` (a Policy: its `family` runs the forward), computed in the
    update's chunks of rows and stitched back in row order. With `hidden_fn`, `hidden` holds `hidden_fn(hidden,
    mask)` per row (e.g. a critic's values [N, T]); the [N, T, H] hidden states themselves are never kept."""
    n = completion_ids.shape[0]
    lengths = row_lengths(prompts, prompt_index, completion_mask) if micro_batch_tokens else None
    chunks = micro_batches(torch.arange(n), lengths, micro_batch, micro_batch_tokens)
    logprobs = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    extra = None
    for rows in chunks:
        if not len(rows):
            continue
        out = sequence_logprobs(policy, prompts, prompt_index[rows], completion_ids[rows], completion_mask[rows],
                                temperature, with_hidden=hidden_fn is not None)
        logprobs[rows] = out.logprobs
        if hidden_fn is not None:
            value = hidden_fn(out.hidden, completion_mask[rows])
            if extra is None:
                extra = value.new_zeros((n, *value.shape[1:]))
            extra[rows] = value
    return CompletionOutput(logprobs, None, extra)


def logprob_gap(sampled: Tensor, trained: Tensor, mask: Tensor) -> tuple[float, float, int]:
    """|sampler log-prob - training-forward log-prob| over real tokens: (sum, max, count), for the
    rollout/logprob_gap_* diagnostics (same weights: the gap is the kernels' and the precision's, not the update's)."""
    gap = (sampled.to(trained.device) - trained.detach()).abs()[mask.bool()]
    return (gap.sum().item(), gap.max().item(), gap.numel()) if gap.numel() else (0.0, 0.0, 0)
