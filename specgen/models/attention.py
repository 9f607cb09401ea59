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

A ragged batched step (:class:`specgen.models.batch_kv.BatchKV`) feeds the model the
real tokens of its B rows flat, ``[1, T]``, with a :class:`BatchRows` argument
(``batch_rows=``, which transformers hands to every attention call with the model's
other keyword arguments): each call appends its layer's new keys/values to the batch-B
cache the argument names, w slots a row (w = the longest row's feed; a shorter row's
extra slots hold zeros nobody attends to), and attends each row's queries to its own
batch entry, in a call of its own (one call over every row where all feeds are as long).
So no padding reaches a linear layer or an attention call, and a row's outputs are the
arithmetic of a padded call's real rows. What it saves: docs/benchmarks.md, "Batching".

:func:`set_per_query` switches a model to the batch-invariant path (``invariant_verify=true``):
every query token, also a single-token step's, attends in a call of its own to the keys it
sees, so its output is the same whichever tokens it is fed with (:func:`_per_query`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: The name models are loaded with (``attn_implementation=NAME``).
NAME = "specgen_sdpa"

_UNSUPPORTED = ("s_aux", "sinks", "softcap", "position_bias")
#: The attribute :func:`set_per_query` sets on a model's modules.
PER_QUERY = "specgen_per_query"

#: The keyword a batched forward passes its :class:`BatchRows` as (``model(..., batch_rows=rows)``).
ROWS = "batch_rows"


@dataclass(frozen=True)
class BatchRows:
    """The rows of a ragged batched forward fed flat (see the module docstring).

    cache: the batch-B transformers cache the rows share ([B, kv, S, d] keys/values a layer);
    lengths: row j's tokens fed this forward (at least one each), the model's T = sum(lengths)
    inputs holding row j's after row j - 1's. The attention mask is [B, 1, w, S + w]
    (w = max(lengths)): row j's query i < lengths[j] over its S cached slots and w new ones."""

    cache: object
    lengths: Sequence[int]

    @property
    def width(self) -> int:
        return max(self.lengths)

    def padded(self, flat: torch.Tensor) -> torch.Tensor:
        """[1, heads, T, d] flat rows -> [B, heads, w, d], row j's first lengths[j] entries its own, the rest zero."""
        out = flat.new_zeros(len(self.lengths), flat.shape[1], self.width, flat.shape[3])
        start = 0
        for j, n in enumerate(self.lengths):
            out[j, :, :n] = flat[0, :, start:start + n]
            start += n
        return out


def _packable(query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs, ragged: bool = False) -> bool:
    """Whether :func:`_grouped` serves the call (ragged: each row's own call, grouped or not)."""
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
    (additive float or boolean keep-mask). With ``batch_rows`` (a :class:`BatchRows`): query,
    key, value are the rows' new tokens flat, [1, H, T, d] and [1, kv, T, d], appended to the
    rows' cache here; returns ``([1, T, H, d], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = kwargs.pop(ROWS, None)
    if rows is not None:
        return _rows(module, query, key, value, attention_mask, dropout, scaling, rows, kwargs), None
    if getattr(module, PER_QUERY, False):
        out = _per_query(module, query, key, value, attention_mask, dropout, scaling, kwargs)  # [B, w, H, d]
        return out, None
    if not _packable(query, key, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = _grouped(query, key, value, attention_mask, dropout if module.training else 0.0, scaling)  # [B, H, w, d]
    return out.transpose(1, 2).contiguous(), None


def _rows(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor, dropout: float, scaling: float | None, rows: BatchRows,
          kwargs) -> torch.Tensor:
    """A :class:`BatchRows` forward's attention: query [1, H, T, d] and key, value [1, kv, T, d] flat;
    attention_mask [B or 1, 1, w, S + w]. Appends the new keys/values to ``rows.cache`` ([B, kv, w, d]
    each, :meth:`BatchRows.padded`), then attends each row's queries to its batch entry; -> [1, T, H, d]."""
    keys, values = rows.cache.update(rows.padded(key), rows.padded(value), module.layer_idx)  # [B, kv, S + w, d]
    heads, total, dim = query.shape[1], query.shape[2], query.shape[3]
    width, batch = rows.width, len(rows.lengths)
    if min(rows.lengths) == width:  # no row shorter: one call over the batch, as an unpadded batch makes
        together = query[0].reshape(heads, batch, width, dim).transpose(0, 1)  # [B, H, w, d]
        out, _ = packed_gqa_sdpa(module, together, keys, values, attention_mask, dropout, scaling, **kwargs)
        return out.reshape(1, total, heads, dim)  # [B, w, H, d] -> [1, T, H, d]
    out = query.new_empty(1, total, heads, dim)  # [1, T, H, d]
    shared, start = attention_mask.shape[0] == 1, 0
    packable = not getattr(module, PER_QUERY, False) and _packable(query, key, attention_mask, kwargs, ragged=True)
    for j, n in enumerate(rows.lengths):
        mask = attention_mask[0 if shared else j, None, :, :n]  # [1, 1, n, S + w]
        mine = query[:, :, start:start + n]  # [1, H, n, d]
        if packable:
            row = _grouped(mine, keys[j, None], values[j, None], mask, dropout if module.training else 0.0,
                           scaling).transpose(1, 2)  # [1, n, H, d]
        else:
            row, _ = packed_gqa_sdpa(module, mine, keys[j, None], values[j, None], mask, dropout, scaling, **kwargs)
        out[0, start:start + n] = row[0]
        start += n
    return out


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
