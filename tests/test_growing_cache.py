"""GrowingLayer appends in place and reads exactly what concatenation would (specgen/models/growing_cache.py)."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from specgen.models.growing_cache import GrowingLayer, growing_cache
from specgen.models.tiny import build_tiny_model


def _entries(generator: torch.Generator, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, m, 4, generator=generator), torch.randn(2, 3, m, 4, generator=generator)


def test_appends_crops_and_replacements_match_concatenation():
    generator = torch.Generator().manual_seed(0)
    growing = GrowingLayer()
    reference = None
    buffers = []  # each buffer the layer wrote into, in order
    for step, m in enumerate([5, 1, 3, 2, 200, 2, 1]):
        keys, values = _entries(generator, m)
        got_k, got_v = growing.update(keys, values)
        reference = (keys, values) if reference is None else tuple(
            torch.cat([old, new], dim=-2) for old, new in zip(reference, (keys, values)))
        torch.testing.assert_close(got_k, reference[0], rtol=0, atol=0)
        torch.testing.assert_close(got_v, reference[1], rtol=0, atol=0)
        if not buffers or growing._key_store is not buffers[-1]:
            buffers.append(growing._key_store)
        if step == 2:  # a crop keeps the buffer; a view no longer than the cropped one stays untouched
            growing.crop(-5)
            reference = tuple(t[..., :-5, :] for t in reference)
            kept = growing.keys
            snapshot = kept.clone()
        if step == 3:  # appended in place, right after the cropped view
            assert growing._key_store is buffers[-1] and len(buffers) == 1
            torch.testing.assert_close(kept, snapshot, rtol=0, atol=0)
        if step == 5:  # something else replaces the tensors (compaction, keep_rows): adopted on the next append
            growing.keys = growing.keys.index_select(-2, torch.tensor([0, 2, 4]))
            growing.values = growing.values.index_select(-2, torch.tensor([0, 2, 4]))
            reference = tuple(t.index_select(-2, torch.tensor([0, 2, 4])) for t in reference)
    assert len(buffers) == 3  # the first append, growing past capacity (the 200), adopting the replacement


def test_in_place_appends_reuse_the_buffer():
    generator = torch.Generator().manual_seed(1)
    layer = GrowingLayer()
    layer.update(*_entries(generator, 10))
    store = layer._key_store
    for _ in range(20):
        layer.update(*_entries(generator, 1))
    assert layer._key_store is store and layer.keys.shape[-2] == 30
    assert layer.keys.data_ptr() == store.data_ptr()


def test_a_model_decodes_the_same_with_it():
    model = build_tiny_model(seed=2, vocab_size=16)
    cache = growing_cache(model.config)
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    reference_cache = DynamicCache(config=model.config)
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([[1, 5, 2, 7, 3]])
    with torch.no_grad():
        ours = [model(input_ids=ids, **{kwarg: cache}).logits]
        theirs = [model(input_ids=ids, **{kwarg: reference_cache}).logits]
        for token in [4, 9, 1]:
            step = torch.tensor([[token]])
            ours.append(model(input_ids=step, **{kwarg: cache}).logits)
            theirs.append(model(input_ids=step, **{kwarg: reference_cache}).logits)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
