"""Scaled-dot-product attention that keeps grouped-query heads packed for multi-token queries.

transformers' ``sdpa`` path lets PyTorch broadcast grouped key/value heads only
for a single query token; a query of w > 1 tokens with an explicit mask (every
speculative verify, every batched step) makes it ``repeat_kv`` the whole cache
(groups × slots × head_dim per layer) before attending. On a CPU with a wide
shared batched cache that copy was over half the forward (batched steps of
w = 3 tokens on ~800 slots cost 2.3–2.9× what the compacted table priced).

:func:`packed_gqa_sdpa` folds each key/value group's query heads into the
query-length axis instead: the query becomes ``[B, kv_heads, groups·w, d]``
and attends to the unrepeated ``[B, kv_heads, S, d]`` keys, with the mask
repeated per group. That is the same arithmetic (every query head still sees
its own group's keys under its own row of the mask), so outputs equal the
``sdpa`` path's to float rounding; ``tests/test_attention.py`` checks both
against each other. Anything else (one query token, no groups, a per-head
mask, extra kwargs such as sinks or softcapping) goes to transformers' own
function unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The name models are loaded with (``attn_implementation=NAME``).
NAME = "specgen_sdpa"

_UNSUPPORTED = ("s_aux", "sinks", "softcap", "position_bias")


def _packable(query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs) -> bool:
    heads, width = query.shape[1], query.shape[2]
    kv_heads = key.shape[1]
    if kv_heads == heads or heads % kv_heads or width == 1:
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

    if not _packable(query, key, attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    batch, heads, width, dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    packed = query.reshape(batch, kv_heads, groups * width, dim)  # [B, kv, groups·w, d]
    mask_batch = attention_mask.shape[0]
    mask = attention_mask[:, :, None].expand(mask_batch, 1, groups, width, slots)
    mask = mask.reshape(mask_batch, 1, groups * width, slots)  # [B or 1, 1, groups·w, S]
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask,
                                         dropout_p=dropout if module.training else 0.0, scale=scaling)
    out = out.reshape(batch, heads, width, dim)  # [B, H, w, d]
    return out.transpose(1, 2).contiguous(), None


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
