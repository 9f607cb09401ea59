"""The quantized forward's bucketed attention: a query's keys are its position + 1 rounded up to a span of
KEY_BUCKET slots (the rest masked), so the queries of a verify that share a span go in one call. Exactness
rests on a query's shapes depending on its position only: checked across span boundaries, with stale and
grown cache slots, and against a negative control whose single steps attend over exactly their keys."""

from __future__ import annotations

import pytest
import torch

from specgen.models import load_quantized
from specgen.models.quantized import model

TINY_SOURCE = dict(kind="tiny", seed=0, vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   context_length=512, init_scale=1.0)
IDS = [(7 * i + 3) % 16 for i in range(64)]


def _lm(quant="int4"):
    return load_quantized(TINY_SOURCE, name="target", quant=quant, progress=False).lm


def _singles(lm, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    cache = lm.new_cache()
    lm.forward(cache, prefix, keep=1)
    return torch.cat([lm.forward(cache, [t], keep=1) for t in tokens])  # [len(tokens), vocab]


def _verify(lm, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    cache = lm.new_cache()
    lm.forward(cache, prefix, keep=1)
    return lm.forward(cache, tokens, keep=len(tokens))  # [len(tokens), vocab]


def test_spans_group_a_feeds_queries_by_their_rounded_up_key_count():
    net = _lm().net
    spans = net._spans(model.Feed(net.new_buffers(), start=14, n=5, keep=1))
    assert [(span.row, span.rows, span.mask.shape[-1]) for span in spans] == [(0, 2, 16), (2, 3, 32)]
    mask = spans[1].mask  # positions 16, 17, 18 over 32 slots
    assert mask.shape == (3, 1, 1, 32) and spans[1].keys.shape == (2, 3, 2, 32, 8)  # [layers, rows, kv, span, hd]
    assert [int(torch.isfinite(mask[i, 0, 0]).sum()) for i in range(3)] == [17, 18, 19]
    assert net._span(net.context_length - 1) == net.context_length


@pytest.mark.parametrize("quant", ["int8", "int4", "w8a8"])
@pytest.mark.parametrize("start", [9, 14, 15, 16, 31])  # verifies inside one span and across a boundary
def test_verify_across_span_boundaries_equals_single_steps(quant, start):
    lm = _lm(quant)
    tokens = IDS[start:start + 9]
    assert torch.equal(_verify(lm, IDS[:start], tokens), _singles(lm, IDS[:start], tokens))


def test_stale_slots_past_a_sequence_do_not_change_its_logits():
    """Slots past the length hold what earlier, cropped tokens wrote; masked, they add exact zeros."""
    lm = _lm()
    fresh = _verify(lm, IDS[:20], IDS[20:26])
    cache = lm.new_cache()
    lm.forward(cache, IDS[:40], keep=1)
    cache.crop(20)
    cache.buffers.keys[:, 20:].fill_(1e4)
    cache.buffers.values[:, 20:].fill_(-1e4)
    assert torch.equal(lm.forward(cache, IDS[20:26], keep=6), fresh)


def test_grown_buffers_start_zeroed(monkeypatch):
    monkeypatch.setattr(model, "FIRST_CAPACITY", 16)
    lm = _lm()
    cache = lm.new_cache()
    lm.forward(cache, IDS[:20], keep=1)
    assert cache.buffers.keys.shape[1] >= 32
    assert not cache.buffers.keys[:, 20:].any() and not cache.buffers.values[:, 20:].any()


def test_negative_control_single_steps_over_exact_key_counts_differ_from_a_bucketed_verify(monkeypatch):
    """Single steps attending over exactly position + 1 keys (KEY_BUCKET 1, the shapes of per-query
    attention) against a verify over spans of 16: the same attention in other shapes, which the
    measurement tells apart (w8a8 feeds the attention's float32 output to its kernel unrounded); with
    the same spans on both sides it is exact."""
    lm = _lm("w8a8")
    ids = [(7 * i + 3) % 16 for i in range(120)]
    prefix, tokens = ids[:100], ids[100:116]
    verify = _verify(lm, prefix, tokens)
    monkeypatch.setattr(model, "KEY_BUCKET", 1)
    exact_lengths = _singles(lm, prefix, tokens)
    assert float((verify - exact_lengths).abs().max()) > 0.0
    monkeypatch.setattr(model, "KEY_BUCKET", 16)
    assert torch.equal(_singles(lm, prefix, tokens), verify)


def test_spans_stop_at_a_context_length_off_the_bucket_grid():
    """context 40: positions 32..39 attend over the 40 slots there are (not 48), fed together or alone."""
    source = dict(TINY_SOURCE, context_length=40)
    lm = load_quantized(source, name="target", quant="int8", progress=False).lm
    assert lm.net._span(39) == 40 and lm.net._span(31) == 32
    ids = IDS[:40]
    assert torch.equal(_verify(lm, ids[:30], ids[30:]), _singles(lm, ids[:30], ids[30:]))
    with pytest.raises(ValueError, match="exceed"):
        lm.forward(lm.new_cache(), IDS[:41], keep=1)
