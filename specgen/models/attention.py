"""Scaled-dot-product attention that keeps grouped-query heads packed for multi-token queries.

transformers' ``sdpa`` path lets PyTorch broadcast grouped key/value heads only
for a single query token; a query of w > 1 tokens with an explicit mask (every
speculative verify, every batched step) makes it ``repeat_kv`` the whole cache
(groups × slots × head_dim per layer) before attending.

:func:`packed_gqa_sdpa` folds each key/value group's query heads into the
query-length axis instead: the query becomes ``[B, kv_heads, groups·w, d]``
and attends to the unrepeated ``[B, kv_heads, S, d]`` keys, with the mask
repeated per group. That is the same arithmetic (every query head still sees
its own group's keys under its own row of the mask), so outputs equal the
``sdpa`` path's to float rounding; ``tests/test_attention.py`` checks both
against each other. Anything else (one query token, no groups, a per-head
mask, extra kwargs such as sinks or softcapping) goes to transformers' own
function unchanged.

A ragged batched step pads every row's feed to the widest (:mod:`specgen.batch`).
Within :func:`row_lengths` each row's query is cut to its own real tokens and
attended in a call of its own (views, no copies), so the padding costs no
attention; a row's real outputs are the same arithmetic as in the padded call.
What both save: docs/benchmarks.md, "Batching".

:func:`set_per_query` switches a model to the batch-invariant path (``invariant_verify=true``):
every query token, also a single-token step's, attends in a call of its own to the keys it
sees, so its output is the same whichever tokens it is fed with (:func:`_per_query`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

#: The name models are loaded with (``attn_implementation=NAME``).
NAME = "specgen_sdpa"

_UNSUPPORTED = ("s_aux", "sinks", "softcap", "position_bias")
#: The attribute :func:`set_per_query` sets on a model's modules.
PER_QUERY = "specgen_per_query"

#: Set by :func:`row_lengths`: each batch row's real query tokens (a prefix of the row).
_LENGTHS: ContextVar[tuple[int, ...] | None] = ContextVar("specgen_row_lengths", default=None)


@contextmanager
def row_lengths(lengths: Sequence[int] | None) -> Iterator[None]:
    """Within this context a packed attention call over a batch of ``len(lengths)`` rows
    attends only row j's first ``lengths[j]`` queries (the rest are padding, left at zero:
    the caller must neither read them nor let a real token see their keys). None, lengths
    of another batch, or no padding at all: every query is attended, as outside the context."""
    token = _LENGTHS.set(None if lengths is None else tuple(int(n) for n in lengths))
    try:
        yield
    finally:
        _LENGTHS.reset(token)


def _packable(query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs, ragged: bool = False) -> bool:
    heads, width = query.shape[1], query.shape[2]
    kv_heads = key.shape[1]
    if (kv_heads == heads and not ragged) or heads % kv_heads or width == 1:
        return False
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return False
    return not any(kwargs.get(name) is not None for name in _UNSUPPORTED)


def packed_gqa_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns ``([B, w, H, d], None)``.

    query: [B, H, w, d]; key, value: [B, kv, S, d]; attention_mask: [B or 1, 1, w, S]
    (additive float or boolean keep-mask).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, PER_QUERY, False):
        out = _per_query(module, query, key, value, attention_mask, dropout, scaling, kwargs)  # [B, w, H, d]
        return out, None
    lengths = _LENGTHS.get()
    if lengths is not None and (len(lengths) != query.shape[0] or max(lengths) > query.shape[2]
                                or min(lengths) == query.shape[2]):
        lengths = None  # not this call's batch, or no padding
    if not _packable(query, key, attention_mask, kwargs, lengths is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    dropout = dropout if module.training else 0.0
    if lengths is None:
        out = _grouped(query, key, value, attention_mask, dropout, scaling)  # [B, H, w, d]
        return out.transpose(1, 2).contiguous(), None
    batch, heads, width, dim = query.shape
    out = query.new_zeros(batch, width, heads, dim)  # [B, w, H, d]; padding stays zero
    shared = attention_mask.shape[0] == 1
    for j, n in enumerate(lengths):
        mask = attention_mask[0 if shared else j, None, :, :n]  # [1, 1, n, S]
        row = _grouped(query[j, None, :, :n], key[j, None], value[j, None], mask, dropout, scaling)  # [1, H, n, d]
        out[j, :n] = row[0].transpose(0, 1)
    return out, None


def _grouped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
             dropout: float, scaling: float | None) -> torch.Tensor:
    """query [B, H, w, d], key/value [B, kv, S, d], mask [B or 1, 1, w, S] -> [B, H, w, d]."""
    batch, heads, width, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    packed = query.reshape(batch, kv_heads, groups * width, dim)  # [B, kv, groups·w, d]
    mask_batch = attention_mask.shape[0]
    mask = attention_mask[:, :, None].expand(mask_batch, 1, groups, width, slots)
    mask = mask.reshape(mask_batch, 1, groups * width, slots)  # [B or 1, 1, groups·w, S]
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, width, dim)


def set_per_query(model: torch.nn.Module, enabled: bool) -> None:
    """Switch :func:`packed_gqa_sdpa`'s per-query path on or off for every attention module of ``model``."""
    for module in model.modules():
        setattr(module, PER_QUERY, bool(enabled))


def _per_query(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float, scaling: float | None, kwargs) -> torch.Tensor:
    """Each query token attends in a call of its own, unmasked, to a copy of the keys its mask row
    lets it see: the call a single-token step makes for that token, so its output does not depend
    on the tokens fed with it. A query that sees no key (padding) stays zero.
    query: [B, H, w, d]; key, value: [B, kv, S, d]; -> [B, w, H, d]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, width, dim = query.shape
    slots = key.shape[2]
    seen = _visible(attention_mask, batch, width, slots, query.device)  # [B, w, S] bool
    out = query.new_zeros(batch, width, heads, dim)  # [B, w, H, d]
    for b in range(batch):
        for i in range(width):
            keep = seen[b, i].nonzero().squeeze(1)  # [S_i]
            if not keep.numel():
                continue
            keys, values = key[b: b + 1], value[b: b + 1]  # [1, kv, S, d]
            if keep.numel() < slots:
                keys, values = keys.index_select(2, keep), values.index_select(2, keep)  # [1, kv, S_i, d]
            row, _ = sdpa_attention_forward(module, query[b: b + 1, :, i: i + 1], keys, values, None,
                                            dropout=dropout, scaling=scaling, is_causal=False, **kwargs)
            out[b, i] = row[0, 0]  # [H, d]
    return out


def _visible(attention_mask: torch.Tensor | None, batch: int, width: int, slots: int,
             device: torch.device) -> torch.Tensor:
    """[B, w, S] bool: which keys each query sees, from a boolean keep-mask or an additive
    mask [B or 1, 1, w, S]; None: causal, the w queries being the last w of the S slots."""
    if attention_mask is None:
        last = torch.arange(slots - width, slots, device=device)  # [w]
        return (torch.arange(slots, device=device)[None] <= last[:, None]).expand(batch, width, slots)
    mask = attention_mask[:, 0, -width:, -slots:]  # [B or 1, w, S]
    seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return seen.expand(batch, width, slots)


def attention_implementation() -> str:
    """Register :func:`packed_gqa_sdpa` (and sdpa's mask builder) with transformers; returns NAME.

    The mask must be registered too: transformers builds no mask at all for an
    implementation name it does not know.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, packed_gqa_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
