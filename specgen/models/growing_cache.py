"""A DynamicCache whose full-attention layers append in place instead of concatenating.

transformers' DynamicLayer grows its keys and values with ``torch.cat`` on every
forward, copying the whole cache into a freshly allocated tensor each step.
:class:`GrowingLayer` keeps each tensor as the prefix view
``[B, heads, length, head_dim]`` of a buffer ``[B, heads, capacity, head_dim]`` and
writes new entries after the view, reallocating (with headroom) only when the buffer
is full or the view is no longer its prefix.

Writes only ever land past the current view, so a view no longer than it (a
transaction's snapshot) still reads what it read before; only entries already
cropped away are overwritten. Anything that replaces ``keys``/``values`` with a
tensor of its own (compaction, tree ``keep_rows``, batch reshuffles) is adopted
into a new buffer on the next append. The entries read back are bit-equal to those
concatenation would hold (tests/test_growing_cache.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

#: Buffers grow to the needed length plus a quarter, rounded up to a multiple of this.
ROUND = 128


def _append(view: torch.Tensor | None, store: torch.Tensor | None, new: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``view`` + ``new`` along dim -2; -> (the result, a prefix view of its buffer; the buffer).

    view: [B, heads, n, d] (or an empty placeholder); new: [B, heads, m, d].
    """
    n = view.shape[-2] if view is not None and view.dim() == 4 else 0
    m = new.shape[-2]
    if (store is not None and n and view.data_ptr() == store.data_ptr() and view.stride() == store.stride()
            and view.shape[:2] == store.shape[:2] == new.shape[:2] and n + m <= store.shape[-2]
            and view.dtype == store.dtype == new.dtype):
        store[:, :, n:n + m] = new
        return store[:, :, :n + m], store
    need = n + m
    capacity = -(-(need + need // 4) // ROUND) * ROUND
    store = new.new_empty(*new.shape[:2], capacity, new.shape[-1])  # [B, heads, capacity, d]
    if n:
        store[:, :, :n] = view
    store[:, :, n:need] = new
    return store[:, :, :need], store


class GrowingLayer(DynamicLayer):
    """A DynamicLayer appending into spare capacity (see the module docstring)."""

    _key_store: torch.Tensor | None = None
    _value_store: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._key_store = _append(self.keys, self._key_store, key_states)
        self.values, self._value_store = _append(self.values, self._value_store, value_states)
        return self.keys, self.values

    def reset(self) -> None:
        self._key_store = self._value_store = None
        super().reset()


def growing_cache(config) -> DynamicCache:
    """A DynamicCache for ``config`` whose plain full-attention layers are :class:`GrowingLayer`
    (sliding-window and other layer kinds keep transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
