"""ReservedLayer (vlmrl/models/kv_cache.py) holds what transformers' DynamicLayer holds after every kind of update:
prefill, decoding steps, a regrow past the reserve, rows repeated and selected, a crop."""

import torch
from transformers.cache_utils import DynamicLayer

from vlmrl.models.kv_cache import ReservedLayer


def states(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def same(ours: ReservedLayer, theirs: DynamicLayer) -> None:
    assert ours.get_seq_length() == theirs.get_seq_length()
    assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_reserved_layer_holds_what_the_concatenating_layer_holds():
    ours, theirs = ReservedLayer(reserve=2), DynamicLayer()
    for layer in (ours, theirs):
        out = layer.update(*states(3, 5, 0))  # the prompt
    same(ours, theirs)
    assert torch.equal(out[0], ours.keys)
    buffer = ours.key_buffer
    for layer in (ours, theirs):
        layer.batch_repeat_interleave(2)
    same(ours, theirs)
    for step in range(4):  # two steps fit the reserve, the third regrows the buffers
        for layer in (ours, theirs):
            k, v = layer.update(*states(6, 1, 10 + step))
        same(ours, theirs)
        assert torch.equal(k, ours.keys) and torch.equal(v, ours.values)
    assert ours.key_buffer.shape[-2] >= 9 and ours.key_buffer is not buffer
    rows = torch.tensor([5, 0, 2])
    for layer in (ours, theirs):
        layer.batch_select_indices(rows)
    same(ours, theirs)
    for layer in (ours, theirs):
        layer.crop(-2)
    same(ours, theirs)
    for layer in (ours, theirs):
        layer.update(*states(3, 1, 99))
    same(ours, theirs)


def test_decoding_inside_the_reserve_writes_in_place():
    layer = ReservedLayer(reserve=3)
    layer.update(*states(2, 4, 0))
    buffer = layer.key_buffer
    for step in range(3):
        layer.update(*states(2, 1, step + 1))
    assert layer.key_buffer is buffer and layer.get_seq_length() == 7
    assert layer.keys.data_ptr() == buffer.data_ptr()  # a view of the buffer, not a copy


def test_a_row_select_copies_only_the_filled_columns(monkeypatch):
    """Issue 41 item 4: selecting rows (answers that split or finished) copies the `length` filled columns into
    buffers of the same capacity, not the whole reserve, and holds what DynamicLayer holds."""
    ours, theirs = ReservedLayer(reserve=50), DynamicLayer()
    for layer in (ours, theirs):
        layer.update(*states(3, 5, 0))
        layer.update(*states(3, 1, 1))
    capacity = ours.key_buffer.shape[-2]
    copied, select = [], torch.index_select

    def counted(x, dim, index, **kwargs):
        copied.append(x.shape)
        return select(x, dim, index, **kwargs)

    monkeypatch.setattr(torch, "index_select", counted)
    rows = torch.tensor([2, 2, 0, 1])
    for layer in (ours, theirs):
        layer.batch_select_indices(rows)
    monkeypatch.undo()
    same(ours, theirs)
    assert copied and all(shape[-2] == 6 for shape in copied)  # keys and values: 6 columns of 55
    assert ours.key_buffer.shape == (4, 2, capacity, 4) and ours.value_buffer.shape == (4, 2, capacity, 4)
    for layer in (ours, theirs):  # decoding goes on in place, inside the same reserve
        layer.update(*states(4, 1, 2))
    same(ours, theirs)
    assert ours.keys.data_ptr() == ours.key_buffer.data_ptr()
