"""A KV cache for generation that reserves room for the answer instead of growing by concatenation.

transformers' `DynamicLayer` appends each decoding step's keys and values with `torch.cat`, which copies the whole
cache of every layer at every step (with G answers per prompt, G copies of each prompt's keys). `ReservedLayer`
allocates prompt length + the answer budget once, writes each step's keys and values into the next free column, and
hands attention a view of the filled columns. The values attention reads are the same, so the answers and their
log-probs are identical to `DynamicLayer`'s (tests/test_families.py compares whole rollouts for every family,
tests/test_kv_cache.py the layers); what goes is the copy.

A row select (answers that split from their row or finished) copies only the filled columns into buffers of the
same capacity; `generate` selects only on such a token. Used by `generate`
(`family.new_cache(reserve=max_new_tokens)`); the training forward keeps `DynamicLayer`, whose
one concatenation per forward costs nothing and whose backward is the plain one.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer


class ReservedLayer(DynamicLayer):
    """One full-attention layer's cache: buffers [B, H, capacity, D]; `keys`/`values` view their first `length`
    columns. Capacity is the first update's length + `reserve`; a longer sequence regrows it (one copy)."""

    def __init__(self, reserve: int, **kwargs):
        super().__init__(**kwargs)
        self.reserve = reserve
        self.length = 0
        # attention reads at least this many columns (the ones past `length` hold zeros and are masked out): a prefill
        # of short rows then sums over as many keys as a longer call would (vlmrl.models.prefill)
        self.view_at_least = 0
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def _view(self) -> None:
        columns = max(self.length, self.view_at_least)
        self.keys = self.key_buffer[:, :, :columns]
        self.values = self.value_buffer[:, :, :columns]

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        if not self.view_at_least:
            return super().get_mask_sizes(query_length, *args, **kwargs)
        return max(self.length + query_length, self.view_at_least), 0

    def _allocate(self, capacity: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        def grown(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
            b, h, _, d = new.shape
            buffer = torch.empty(b, h, capacity, d, dtype=new.dtype, device=new.device)
            if old is not None and self.length:
                buffer[:, :, :self.length].copy_(old[:, :, :self.length])
            return buffer

        self.key_buffer = grown(self.key_buffer, key_states)
        self.value_buffer = grown(self.value_buffer, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self.key_buffer is None or self.length + new > self.key_buffer.shape[-2]:
            self._allocate(self.length + new + self.reserve, key_states, value_states)
        self.key_buffer[:, :, self.length:self.length + new].copy_(key_states)
        self.value_buffer[:, :, self.length:self.length + new].copy_(value_states)
        self.length += new
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
        self.key_buffer = self.value_buffer = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self.length = max(self.length + tokens_to_remove, 0)
            self._view()

    def _rows(self, select) -> None:
        if self.length:
            self.key_buffer, self.value_buffer = select(self.key_buffer), select(self.value_buffer)
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(lambda b: b.repeat_interleave(repeats, dim=0))

    def _select(self, indices: torch.Tensor) -> None:
        """Rows `indices` into new buffers of the same capacity, copying only the filled columns (the reserve holds
        nothing yet). The old buffers stay alive until the copy is done, so a select briefly holds two caches:
        `generate` selects only on a token where an answer split or finished. (No autograd through `out=`: this
        layer is generation's, under no_grad.)"""
        if self.length:
            def selected(old: torch.Tensor) -> torch.Tensor:
                _, h, capacity, d = old.shape
                new = torch.empty(len(indices), h, capacity, d, dtype=old.dtype, device=old.device)
                torch.index_select(old[:, :, :self.length], 0, indices.to(old.device), out=new[:, :, :self.length])
                return new

            self.key_buffer, self.value_buffer = selected(self.key_buffer), selected(self.value_buffer)
            self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def offload(self):
        self._rows(lambda b: b.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self.key_buffer is not None and self.key_buffer.device != self.device:
            self._rows(lambda b: b.to(self.device, non_blocking=True))


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """`cache.batch_select_indices(rows)` with index_select for the layers that gather with `keys[rows]`
    (transformers' DynamicLayer and its sliding-window kind): both copy the same rows, but the training forward
    backpropagates through this copy, and the backward of `keys[rows]` is index_put_(accumulate=True), which on a
    CPU with 2+ threads adds a prompt's repeated rows with atomics in a timing-dependent order; index_select's
    backward adds in index order, so a multi-thread run repeats on a busy machine too."""
    for layer in cache.layers:
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
            if layer.get_seq_length() > 0:
                layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
                layer.values = layer.values.index_select(0, rows.to(layer.values.device))
        else:
            layer.batch_select_indices(rows)


def generation_cache(config, reserve: int) -> DynamicCache:
    """transformers' DynamicCache for `config`, each plain full-attention layer a `ReservedLayer` with room for
    `reserve` more tokens after the prompt; other layer kinds (sliding windows: Gemma 3) are kept as they are."""
    cache = DynamicCache(config=config)
    if reserve > 0:
        cache.layers = [ReservedLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
