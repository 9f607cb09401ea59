"""Packed grouped-query attention equals transformers' sdpa path (specgen/models/attention.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specgen.models.attention import NAME, BatchRows, attention_implementation, packed_gqa_sdpa
from specgen.models.tiny import build_tiny_model


def _module(groups: int) -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    module.is_causal = True
    return module.eval()


def _ragged_mask(batch: int, width: int, slots: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, 1, width, slots] boolean keep-mask: random holes, every query row keeps slot 0."""
    keep = torch.rand(batch, 1, width, slots, generator=generator) > 0.4
    keep[..., 0] = True
    return keep


@pytest.mark.parametrize("batch,kv_heads,groups,width,slots", [
    (1, 2, 2, 3, 17), (4, 1, 3, 5, 40), (3, 2, 4, 2, 9), (2, 3, 1, 4, 12), (2, 2, 2, 1, 11),
])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_packed_equals_sdpa(batch, kv_heads, groups, width, slots, kind):
    generator = torch.Generator().manual_seed(batch * 100 + width * 10 + slots)
    dim = 8
    query = torch.randn(batch, kv_heads * groups, width, dim, generator=generator)  # [B, H, w, d]
    key = torch.randn(batch, kv_heads, slots, dim, generator=generator)  # [B, kv, S, d]
    value = torch.randn(batch, kv_heads, slots, dim, generator=generator)
    keep = _ragged_mask(batch, width, slots, generator)
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    module = _module(groups)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim ** -0.5)
    got, _ = packed_gqa_sdpa(module, query, key, value, mask, scaling=dim ** -0.5)
    assert got.shape == expected.shape == (batch, width, kv_heads * groups, dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_mask_shared_by_the_batch_is_repeated_per_row():
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(3, 4, 5, 8, generator=generator)
    key, value = torch.randn(2, 3, 2, 21, 8, generator=generator)
    mask = _ragged_mask(1, 5, 21, generator)  # [1, 1, w, S]
    module = _module(2)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask)
    got, _ = packed_gqa_sdpa(module, query, key, value, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_unsupported_inputs_go_to_transformers():
    module = _module(2)
    query = torch.randn(1, 4, 3, 8)
    key = value = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="softcap"):
        packed_gqa_sdpa(module, query, key, value, torch.ones(1, 1, 3, 6, dtype=torch.bool), softcap=1.0)
    no_mask, _ = packed_gqa_sdpa(module, query, key, value, None)  # causal, handled by sdpa itself
    expected, _ = sdpa_attention_forward(module, query, key, value, None)
    torch.testing.assert_close(no_mask, expected)


def test_models_load_with_it_and_match_sdpa_on_a_tree_mask(monkeypatch):
    from specgen.models import attention

    packed_calls = []
    packable = attention._packable
    monkeypatch.setattr(attention, "_packable", lambda *a: packed_calls.append(packable(*a)) or packed_calls[-1])
    assert attention_implementation() == NAME
    model = build_tiny_model(seed=5, vocab_size=16, num_heads=4, num_kv_heads=2)
    assert model.config._attn_implementation == NAME
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    # a prefix of 5 tokens, then a 3-node tree: node 1 and node 2 are siblings under node 0
    keep = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    keep[7, 6] = False
    mask = torch.zeros(1, 1, 8, 8).masked_fill(~keep, torch.finfo(torch.float32).min)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 6]])
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert packed_calls == [True, True]  # both layers took the packed path
        model.set_attn_implementation("sdpa")
        reference = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-5)


def _flat(tensor: torch.Tensor, lengths: list[int], start: int) -> torch.Tensor:
    """[B, heads, S, d] -> [1, heads, T, d]: row j's lengths[j] entries from slot ``start``, row after row."""
    return torch.cat([tensor[j, None, :, start:start + n] for j, n in enumerate(lengths)], dim=2)


@pytest.mark.parametrize("kv_heads,groups", [(2, 2), (3, 1)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_batch_rows_attend_each_rows_real_queries_only(kv_heads, groups, kind):
    """Fed flat with BatchRows, each row's real queries get what transformers' padded call gives
    them (grouped or not), and the rows' cache gains each row's new keys/values in its own slots,
    zeros in a shorter row's extra ones (the padded call's keys there are zeros too)."""
    generator = torch.Generator().manual_seed(11 + groups)
    batch, width, cached, dim = 3, 5, 9, 8
    slots, lengths = cached + width, [5, 1, 3]
    query = torch.randn(batch, kv_heads * groups, width, dim, generator=generator)  # [B, H, w, d]
    key = torch.randn(batch, kv_heads, slots, dim, generator=generator)  # [B, kv, S + w, d]
    value = torch.randn(batch, kv_heads, slots, dim, generator=generator)
    keep = _ragged_mask(batch, width, slots, generator)
    for j, n in enumerate(lengths):  # no real token sees a padded slot; padded slots hold zeros
        keep[j, :, :, cached + n:] = False
        key[j, :, cached + n:] = value[j, :, cached + n:] = 0
    mask = keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    module = _module(groups)
    module.layer_idx = 0
    expected, _ = sdpa_attention_forward(module, query, key, value, mask)  # [B, w, H, d]
    cache = DynamicCache()
    cache.update(key[:, :, :cached].clone(), value[:, :, :cached].clone(), 0)
    got, _ = packed_gqa_sdpa(module, _flat(query, lengths, 0), _flat(key, lengths, cached),
                             _flat(value, lengths, cached), mask, batch_rows=BatchRows(cache, lengths))
    assert got.shape == (1, sum(lengths), kv_heads * groups, dim)  # [1, T, H, d]
    start = 0
    for j, n in enumerate(lengths):
        torch.testing.assert_close(got[0, start:start + n], expected[j, :n], rtol=1e-5, atol=1e-6)
        start += n
    assert torch.equal(cache.layers[0].keys, key) and torch.equal(cache.layers[0].values, value)
    wrong = DynamicCache()
    wrong.update(key[:, :, :cached].clone(), value[:, :, :cached].clone(), 0)
    shifted, _ = packed_gqa_sdpa(module, _flat(query, lengths, 0), _flat(key, lengths, cached),
                                 _flat(value, lengths, cached), mask, batch_rows=BatchRows(wrong, [3, 1, 5]))
    assert not torch.allclose(shifted, got), "the lengths decide which row a token attends in"


def test_batch_rows_skip_attention_calls_over_padding(monkeypatch):
    """Only a ragged batch is attended row by row; uniform lengths keep the one batched call."""
    from specgen.models import attention

    calls = []
    grouped = attention._grouped
    monkeypatch.setattr(attention, "_grouped", lambda q, *a: calls.append(tuple(q.shape[::2])) or grouped(q, *a))
    module = _module(2)
    module.layer_idx = 0
    for lengths in ([3, 3], [3, 2]):
        total = sum(lengths)
        query, key = torch.randn(1, 4, total, 8), torch.randn(1, 2, total, 8)  # [1, H, T, d], [1, kv, T, d]
        mask = torch.ones(2, 1, 3, 3, dtype=torch.bool)
        out, _ = packed_gqa_sdpa(module, query, key, key, mask, batch_rows=BatchRows(DynamicCache(), lengths))
        assert out.shape == (1, total, 4, 8)
    assert calls == [(2, 3), (1, 3), (1, 2)]  # (rows, queries) per call
