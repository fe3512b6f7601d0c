"""Decoding attention on the CPU: one new token per row, its query heads grouped by KV head, as two batched products.

A decoding step asks attention for one query per row over the row's cache. PyTorch's CPU SDPA kernel handles that
shape poorly: for the quickstart's 64-prompt rollout call (512 rows, 4 query heads on 2 KV heads, 37 keys) it took
1.23 ms per layer and step against 0.35 ms for `q @ k^T`, softmax, `@ v` (benchmarks/decode_attention.py), and the
nine decoding attentions were ~15% of the call. The math is the same as SDPA's (up to float summation order).

`decode_sdpa` is registered with transformers as the attention implementation "vlmrl_sdpa", with SDPA's mask
function, and the families set it on their language model where transformers chose "sdpa". Everything but a CPU
decoding step without gradients (prefill, the training forward, scoring passes, any accelerator, dropout, a softcap
or an additive mask) goes to transformers' own `sdpa_attention_forward` unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "vlmrl_sdpa"


def decode_sdpa(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention signature: query [B, H, Q, D], key/value [B, KV, S, D], mask [B, 1, Q, S] (bool, True
    = attend) or None; returns ([B, Q, H, D], None)."""
    b, heads, q_len, d = query.shape
    kv_heads = key.shape[1]
    plain = (query.device.type != "cpu" or q_len != 1 or dropout or torch.is_grad_enabled() or heads % kv_heads
             or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
             or (attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.shape[1] != 1)))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # query head h reads KV head h // (heads / kv_heads), the order of transformers' repeat_kv
    grouped = query.reshape(b, kv_heads, heads // kv_heads, d)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(d**-0.5 if scaling is None else scaling)
    if attention_mask is not None:  # [B, 1, 1, S] over [B, KV, groups, S]
        scores.masked_fill_(~attention_mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1), value)  # [B, KV, groups, D]
    return out.reshape(b, 1, heads, d), None


AttentionInterface.register(NAME, decode_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_attention(config) -> None:
    """Switch a language model's config from "sdpa" to `decode_sdpa` (another implementation is left as it is)."""
    if getattr(config, "_attn_implementation", None) == "sdpa":
        config._attn_implementation = NAME
