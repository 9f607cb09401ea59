"""Compiled, static-shape target forwards (``compile=true``).

A compiled forward needs fixed shapes, so two things are made static:

* the KV cache: a transformers ``StaticCache`` whose capacity (key slots) is
  fixed; it starts at :data:`FIRST_CAPACITY` slots and doubles when a request
  outgrows it (each new capacity is one more compile per bucket);
* the number of new tokens: a forward of n tokens runs in the smallest bucket
  of :data:`BUCKETS` that holds n. The n real rows come first, padding rows
  after; padding rows attend only causally to real keys, write their keys and
  values past the cache's logical end (where no later query is allowed to look
  and the next forward overwrites them) and are cut from the output. Shapes
  outside the buckets (the prefill, n > 16) run the same decoder eagerly on the
  same static cache.

Every forward passes an explicit additive attention mask over all capacity
slots, [1, 1, bucket, capacity], so a slot beyond the logical length never
contributes, whatever stale keys it holds; that is what lets ``crop`` be a
bookkeeping change and keeps rollback exact.

Compilation uses ``torch.compile(dynamic=False)``; on CUDA the mode is
``"reduce-overhead"`` (CUDA graphs), on CPU the default mode. Compile time is
paid once per process and (bucket, capacity); inductor's FX graph cache (on by
default, under ``torch._inductor`` 's cache directory) keeps the generated
kernels across processes, so a second process skips code generation and pays
only Dynamo tracing.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

#: Verify shapes (new tokens per forward) that run compiled; others run eagerly.
BUCKETS = (1, 2, 4, 8, 16)
#: Key slots of a fresh static cache; doubled when a request needs more.
FIRST_CAPACITY = 256
#: Dynamo's per-code-object recompile limit while compile=true: buckets x capacities x feature flag.
RECOMPILE_LIMIT = 64


def bucket_for(num_tokens: int) -> int | None:
    """The smallest bucket holding ``num_tokens``, or None (run eagerly)."""
    return next((b for b in BUCKETS if b >= num_tokens), None)


def new_static_cache(config, capacity: int) -> StaticCache:
    return StaticCache(config=config, max_cache_len=capacity)


def capacity(cache: StaticCache) -> int:
    return int(cache.layers[0].max_cache_len)


@torch.inference_mode()  # the static tensors are inference tensors (allocated in a forward)
def grown(cache: StaticCache, config, length: int, needed: int, limit: int) -> StaticCache:
    """``cache`` itself if it has ``needed`` slots, else a larger static cache
    (capacity doubled until it fits, at most ``limit``) holding the first
    ``length`` cached positions. ValueError if ``needed > limit``."""
    if needed <= capacity(cache):
        return cache
    if needed > limit:
        raise ValueError(f"a static KV cache of {limit} slots cannot hold {needed} positions")
    size = capacity(cache)
    while size < needed:
        size *= 2
    bigger = new_static_cache(config, min(size, limit))
    for old, new in zip(cache.layers, bigger.layers, strict=True):
        if old.is_initialized:
            new.lazy_initialization(old.keys, old.values)
            new.keys[:, :, :length].copy_(old.keys[:, :, :length])  # [B, heads, length, head_dim]
            new.values[:, :, :length].copy_(old.values[:, :, :length])
    return bigger


@torch.inference_mode()
def keep_static_rows(cache: StaticCache, prefix: int, rows: list[int]) -> None:
    """Move the entries at slots ``prefix + r`` (r in ``rows``, increasing) to
    slots ``prefix, prefix + 1, ...`` in place (the static addresses stay)."""
    where: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        device = layer.keys.device
        if device not in where:
            where[device] = torch.tensor([prefix + r for r in rows], device=device)  # [len(rows)]
        end = prefix + len(rows)
        layer.keys[:, :, prefix:end].copy_(layer.keys.index_select(2, where[device]))  # [B, heads, len(rows), hd]
        layer.values[:, :, prefix:end].copy_(layer.values.index_select(2, where[device]))


class CompiledDecoder:
    """Runs a causal LM's decoder (the model without its LM head) on a static
    cache: compiled per bucket, eager outside the buckets.

    decoder: ``model.get_decoder()``; cache_kwarg: its cache keyword.
    """

    def __init__(self, decoder: torch.nn.Module, cache_kwarg: str, device: torch.device):
        self.decoder = decoder
        self.cache_kwarg = cache_kwarg
        self.mode = "reduce-overhead" if device.type == "cuda" else None
        self.compiled: dict[tuple[int, bool], object] = {}  # (bucket, hidden states?) -> compiled decoder
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    def _compiled(self, bucket: int, all_hidden: bool):
        key = (bucket, all_hidden)
        if key not in self.compiled:
            self.compiled[key] = torch.compile(self.decoder, dynamic=False, mode=self.mode)
        return self.compiled[key]

    def run(self, cache: StaticCache, ids: list[int] | torch.Tensor, positions: list[int], allowed: torch.Tensor,
            start: int, all_hidden: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """One forward of the n tokens ``ids`` (a list, or a [n] long tensor on the device)
        at rotary ``positions``, written to
        slots ``start .. start + n - 1``.

        allowed: [n, start + n] bool, True where a new row may attend to a key slot.
        Returns (last hidden state [n, d], hidden_states tuple of [1, n, d] or None).
        The cache must have ``start + bucket`` slots (see :func:`grown`).
        """
        n = len(ids)
        bucket = bucket_for(n)
        width = n if bucket is None else bucket
        slots = capacity(cache)
        device = allowed.device
        full = torch.zeros(width, slots, dtype=torch.bool, device=device)  # [width, capacity]
        full[:n, : start + n] = allowed
        if width > n:  # padding rows: causal over the real keys and themselves, never read back
            causal = torch.ones(width - n, start + width, dtype=torch.bool, device=device).tril(start + n)
            full[n:, : start + width] = causal  # [width - n, start + width]
        dtype = next(self.decoder.parameters()).dtype
        mask = torch.zeros(full.shape, dtype=dtype, device=device).masked_fill_(~full, torch.finfo(dtype).min)
        pad = [positions[-1] + 1 + i for i in range(width - n)]
        for layer in cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(start)
        decoder = self.decoder if bucket is None else self._compiled(bucket, all_hidden)
        if isinstance(ids, torch.Tensor):  # [n] long on the device, not read back
            input_ids = torch.cat([ids, ids[-1:].expand(width - n)]).reshape(1, width)
        else:
            input_ids = torch.tensor([ids + [ids[-1]] * (width - n)], device=device)  # [1, width]
        out = decoder(input_ids=input_ids,  # [1, width]
                      position_ids=torch.tensor([positions + pad], device=device),  # [1, width]
                      attention_mask=mask[None, None],  # [1, 1, width, capacity], additive
                      use_cache=True, output_hidden_states=all_hidden, **{self.cache_kwarg: cache})
        hidden = out.last_hidden_state[0, :n].clone()  # [n, d]; a copy: CUDA graphs reuse their outputs
        states = None
        if all_hidden:
            states = tuple(h[:, :n].clone() for h in out.hidden_states)
        return hidden, states
