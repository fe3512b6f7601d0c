"""Generation's prefill of multi-turn conversations, rows of similar length together.

At a later turn of a multi-turn rollout each trajectory prefills its tail (its turns and observations so far) after
its group's prompt (`vlmrl.models.forward.shared_prefill`). One call pads every tail to the longest: in the zoom
recipe a turn's 64 tails of 45-130 tokens filled 60% of a 64 x 99 call. Here the rows are sorted by tail length and
cut into a few buckets (`length_buckets`: the fewest padded tokens, each further call counted as `CALL_TOKENS`
tokens), each bucket's tails run after a copy of their prompts' keys and values, and the buckets' caches are
stacked into the one cache that decoding reads, in the layout the single call gives: the prompt left-padded to the
same width, each tail from the same column, zeros in the columns a shorter bucket did not fill (masked out; attention
gives them weight exactly 0).

Each row's keys, values and hidden states are what the single call computes for it, to float rounding: a row's
matrix products do not depend on the rows beside it, and the columns a bucket leaves out are masked padding after
the row's last token. On an Intel Xeon the whole rollouts were the same bit for bit; on an AMD EPYC the CPU's
matrix-product kernels, picked by shape, rounded a log-prob differently by ~1e-6 (the same tokens): what
tests/test_agent_turn_cost.py checks (tokens, truncation and texts exactly, log-probs within 1e-5; the rollouts
of the zoom recipe were also compared with the single call's). Only for caches of `ReservedLayer`s (generation's
full-attention layers), without gradients and on the CPU, where that was checked; an accelerator's matrix-product
libraries may pick kernels by shape more freely, so other calls take the single call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlmrl.models.kv_cache import ReservedLayer

# PyTorch's CPU attention takes the queries in blocks of 32 (64 from 192 queries, 256 from 768), and a block of one
# query (a call of 33, 65, ... queries) rounds that query differently: a bucket is never such a call unless the
# single call is too
LONE_QUERY_BLOCK = 32
CALL_TOKENS = 128  # what one more tail call costs, in padded tokens (a decoder call's fixed work on CPU)
MAX_BUCKETS = 4


def length_buckets(lengths: list[int], call_tokens: int | None = None, max_buckets: int = MAX_BUCKETS
                   ) -> list[list[int]]:
    """Rows grouped by length (each group's rows in ascending length), minimising the padded tokens (rows x the
    group's longest) plus `call_tokens` (None: `CALL_TOKENS`) per group, with at most `max_buckets` groups."""
    call_tokens = CALL_TOKENS if call_tokens is None else call_tokens
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    sizes = [lengths[i] for i in order]
    n, inf = len(order), float("inf")
    # best[k][j]: the cost of the first j rows (in length order) in k groups; cut[k][j]: where the last group starts
    best = [[inf] * (n + 1) for _ in range(max_buckets + 1)]
    cut = [[0] * (n + 1) for _ in range(max_buckets + 1)]
    best[0][0] = 0.0
    for k in range(1, max_buckets + 1):
        for j in range(1, n + 1):
            for i in range(j):
                cost = best[k - 1][i] + (j - i) * sizes[j - 1] + call_tokens
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    k = min(range(1, max_buckets + 1), key=lambda b: (best[b][n], b)) if n else 1
    groups, j = [], n
    while j > 0:
        i = cut[k][j]
        groups.append(order[i:j])
        j, k = i, k - 1
    return groups[::-1]


def bucketed_tails(family, prompt_cache, rows: Tensor, prompt_mask: Tensor, embeds: Tensor, positions: Tensor,
                   lengths: list[int], reserve: int) -> tuple[object, Tensor, Tensor] | None:
    """The tails after their prompts, a bucket of similar lengths per call (module docstring). `prompt_cache`: the
    distinct prompts' cache (left-padded to P columns); `rows` [N]: each row's prompt; `prompt_mask` [N, P];
    `embeds` [N, W, H] and `positions` [3, N, W]: the tails, right-padded to W = the longest; `lengths`: each tail's
    tokens; `reserve`: columns to keep free after the W (the answer budget). Returns (cache, attention mask
    [N, P + W], hidden [N, H] of each row's last tail token), or None when one call is as good or the cache is not
    made of `ReservedLayer`s."""
    if (torch.is_grad_enabled() or embeds.device.type != "cpu"
            or not all(type(layer) is ReservedLayer for layer in prompt_cache.layers)):
        return None
    buckets = length_buckets(lengths)
    if len(buckets) < 2:
        return None
    n, width = len(lengths), embeds.shape[1]
    device = embeds.device
    p_len = prompt_cache.layers[0].length
    c = torch.tensor(lengths, device=device)
    tail_mask = (torch.arange(width, device=device)[None] < c[:, None]).to(prompt_mask.dtype)
    mask = torch.cat([prompt_mask, tail_mask], dim=1)
    hidden_last = embeds.new_empty(n, embeds.shape[-1])
    stacked = [(layer.key_buffer.new_zeros(n, layer.key_buffer.shape[1], p_len + width + reserve,
                                           layer.key_buffer.shape[-1]),
                layer.value_buffer.new_zeros(n, layer.value_buffer.shape[1], p_len + width + reserve,
                                             layer.value_buffer.shape[-1])) for layer in prompt_cache.layers]
    for bucket in buckets:
        idx = torch.tensor(bucket, device=device)
        w = max(lengths[i] for i in bucket)
        if w < width and w % LONE_QUERY_BLOCK == 1:  # never a query alone in its block where the single call has more
            w += 1
        cache = family.new_cache(reserve=w)
        for layer, source in zip(cache.layers, prompt_cache.layers, strict=True):
            _fill(layer, source, rows.index_select(0, idx), p_len + width)
        hidden = family.forward_hidden(embeds.index_select(0, idx)[:, :w], mask.index_select(0, idx),
                                       positions.index_select(1, idx)[:, :, :w], cache)
        hidden_last.index_copy_(0, idx, hidden[torch.arange(len(bucket), device=device), c.index_select(0, idx) - 1])
        for (keys, values), layer in zip(stacked, cache.layers, strict=True):
            keys[:, :, :p_len + width].index_copy_(0, idx, layer.keys)
            values[:, :, :p_len + width].index_copy_(0, idx, layer.values)
    out = family.new_cache(reserve=reserve)
    for layer, (keys, values) in zip(out.layers, stacked, strict=True):
        layer.device, layer.is_initialized = keys.device, True
        layer.key_buffer, layer.value_buffer, layer.length = keys, values, p_len + width
        layer._view()
    return out, mask, hidden_last


def _fill(layer: ReservedLayer, source: ReservedLayer, rows: Tensor, columns: int) -> None:
    """`layer` holds `source`'s filled columns for rows `rows`, then zeros up to `columns`, all of which attention
    reads (`view_at_least`), as it reads the single call's."""
    keys, values = source.key_buffer, source.value_buffer
    layer.key_buffer = keys.new_zeros(len(rows), keys.shape[1], columns, keys.shape[-1])
    layer.value_buffer = values.new_zeros(len(rows), values.shape[1], columns, values.shape[-1])
    torch.index_select(keys[:, :, :source.length], 0, rows, out=layer.key_buffer[:, :, :source.length])
    torch.index_select(values[:, :, :source.length], 0, rows, out=layer.value_buffer[:, :, :source.length])
    layer.device, layer.is_initialized, layer.length = keys.device, True, source.length
    layer.view_at_least = columns
    layer._view()
