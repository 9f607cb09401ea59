"""A thin wrapper around a transformers causal LM with an explicit KV cache.

The wrapper owns no request state. A :class:`KVCache` records which tokens its
keys/values belong to, so committing a round is one call: keep the longest
common prefix of the cached tokens and the committed sequence, drop the rest.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specgen.errors import NumericalError


@dataclass
class KVCache:
    """KV cache of one model for one request.

    tokens: the ids whose keys/values are cached, in order (len == cache length).
    """

    cache: DynamicCache
    tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def sync(self, committed: list[int]) -> None:
        """Crop to the longest common prefix with ``committed``."""
        keep = 0
        limit = min(len(self.tokens), len(committed))
        while keep < limit and self.tokens[keep] == committed[keep]:
            keep += 1
        self.crop(keep)

    def uncached(self, committed: list[int]) -> list[int]:
        """Sync to ``committed`` and return the tokens to feed next (at least one:
        if every committed token is cached, the last one is dropped and re-fed so
        its logits can be computed)."""
        self.sync(committed)
        if len(self.tokens) >= len(committed):
            self.crop(len(committed) - 1)
        return committed[len(self.tokens) :]

    def crop(self, length: int) -> None:
        if length >= len(self.tokens):
            return
        _crop(self.cache, len(self.tokens), length)
        del self.tokens[length:]


def _crop_takes_removal_count() -> bool:
    params = list(inspect.signature(DynamicCache.crop).parameters)
    return len(params) > 1 and params[1] == "tokens_to_remove"


_CROP_BY_REMOVAL = _crop_takes_removal_count()


def _crop(cache: DynamicCache, current: int, length: int) -> None:
    if _CROP_BY_REMOVAL:
        cache.crop(-(current - length))
    else:
        cache.crop(length)


class CausalLM:
    """model: a transformers ``*ForCausalLM`` in eval mode.

    vocab_size: how many ids have a token in the tokenizer; logits are cut to
    this width so ids without a token (Qwen pads its embedding rows) have zero
    probability on every side.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int, name: str = "model"):
        self.model = model
        self.vocab_size = int(vocab_size)
        self.name = name
        self.config = model.config
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def new_cache(self) -> KVCache:
        return KVCache(DynamicCache(config=self.config))

    @torch.inference_mode()
    def forward(self, cache: KVCache, new_tokens: list[int], keep: int) -> torch.Tensor:
        """Feed ``new_tokens`` after the cached ones; return the last ``keep`` rows.

        Returns raw logits [keep, vocab_size] (float32). Appends to the cache.
        """
        if not new_tokens:
            raise ValueError("forward needs at least one new token")
        start = len(cache)
        device = self.device
        ids = torch.tensor([new_tokens], dtype=torch.long, device=device)  # [1, n]
        positions = torch.arange(start, start + len(new_tokens), device=device).unsqueeze(0)  # [1, n]
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep,
            **{self._cache_kwarg: cache.cache},
        )
        cache.tokens.extend(new_tokens)
        logits = out.logits[0, -keep:, : self.vocab_size].float()  # [keep, vocab]
        if torch.isnan(logits).any():
            raise NumericalError(f"{self.name} produced NaN logits at position {start + len(new_tokens) - 1}")
        return logits
