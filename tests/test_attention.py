"""The CPU decoding attention (vlmrl/models/attention.py) computes transformers' SDPA attention, and is used."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlmrl.models import load_policy
from vlmrl.models.attention import NAME, decode_sdpa


def module_with(groups: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.num_key_value_groups, m.is_causal = groups, True
    return m


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("masked", [True, False])
def test_decode_step_equals_sdpa(heads, kv_heads, masked):
    """One query token per row, each query head reading its own KV head (h // groups): the same output as
    transformers' SDPA path, with left padding masked or no mask at all."""
    torch.manual_seed(0)
    rows = 6
    q, k, v = torch.randn(rows, heads, 1, 8), torch.randn(rows, kv_heads, 9, 8), torch.randn(rows, kv_heads, 9, 8)
    v[:, :, 0] = 100.0  # a masked column that would dominate the output if it leaked through
    mask = None
    if masked:
        mask = torch.ones(rows, 1, 1, 9, dtype=torch.bool)
        mask[:, :, :, 0] = False
        mask[0, :, :, :3] = False  # one row padded further
    module = module_with(heads // kv_heads)
    with torch.no_grad():
        expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
        out, weights = decode_sdpa(module, q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == expected.shape == (rows, 1, heads, 8)
    assert torch.allclose(out, expected, atol=1e-5)
    if masked:
        assert out.abs().max() < 50  # the masked column did not leak


def test_everything_but_a_cpu_decoding_step_takes_sdpa(monkeypatch):
    """Prefill (several query tokens) and any forward with gradients go to transformers' own SDPA; a decoding step
    without gradients does not."""
    import vlmrl.models.attention as attention

    taken = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **kw: taken.append(a[1].shape[2]) or (0, None))
    module = module_with(2)
    k = v = torch.randn(3, 2, 5, 8)
    with torch.no_grad():
        decode_sdpa(module, torch.randn(3, 4, 5, 8), k, v, None)  # prefill
        out, _ = decode_sdpa(module, torch.randn(3, 4, 1, 8), k, v, None)  # a decoding step: the grouped products
    decode_sdpa(module, torch.randn(3, 4, 1, 8), k, v, None)  # gradients on
    assert taken == [5, 1] and out.shape == (3, 1, 4, 8)


def test_the_policys_language_model_decodes_with_it(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    lm = policy.family.language_model
    assert lm.config._attn_implementation == NAME
    assert all(layer.self_attn.config._attn_implementation == NAME for layer in lm.layers)
