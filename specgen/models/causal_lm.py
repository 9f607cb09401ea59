"""A thin wrapper around a transformers causal LM with an explicit KV cache.

The wrapper owns no request state. A :class:`KVCache` records which tokens its
keys/values belong to, so committing a round is one call: keep the longest
common prefix of the cached tokens and the committed sequence, drop the rest.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, StaticCache

from specgen.errors import ConfigError, NumericalError
from specgen.models import attention, packed_linear
from specgen.models.batch_kv import BatchKV
from specgen.models.compiled import (BUCKETS, FIRST_CAPACITY, CompiledDecoder, bucket_for, grown, keep_static_rows,
                                     new_static_cache)
from specgen.models.growing_cache import growing_cache
from specgen.models.invariance import GAP_PREFIX, chain_gaps, tree_gaps, worst
from specgen.models.target import PENDING, Capabilities, TargetDefaults, TokenCache


@dataclass
class KVCache(TokenCache):
    """KV cache of one torch model for one request.

    tokens: the ids whose keys/values are cached, in order (len == cache length).
    cache: a DynamicCache, or a StaticCache (compile=true) whose slots past
    ``len(tokens)`` hold stale entries that every forward masks out, so cropping
    it only shortens ``tokens``.
    """

    cache: DynamicCache | StaticCache
    tokens: list[int] = field(default_factory=list)

    def _truncate(self, length: int) -> None:
        if not isinstance(self.cache, StaticCache):
            _crop(self.cache, len(self.tokens), length)

    def keep_rows(self, prefix: int, rows: list[int]) -> None:
        """Keep the first ``prefix`` entries plus the entries at ``prefix + r`` for
        each r in ``rows`` (increasing), in that order; drop the rest. Used after a
        tree forward to keep only the accepted path's keys/values."""
        if rows == list(range(len(rows))):
            self.crop(prefix + len(rows))
            return
        if isinstance(self.cache, StaticCache):
            keep_static_rows(self.cache, prefix, rows)
            self.tokens = self.tokens[:prefix] + [self.tokens[prefix + r] for r in rows]
            return
        kept = list(range(prefix)) + [prefix + r for r in rows]
        where: dict[torch.device, torch.Tensor] = {}  # the index, built once per device
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
                device = layer.keys.device
                if device not in where:
                    where[device] = torch.tensor(kept, device=device)  # [prefix + len(rows)]
                layer.keys = layer.keys.index_select(-2, where[device])  # [B, heads, kept, head_dim]
                layer.values = layer.values.index_select(-2, where[device])
        self.tokens = self.tokens[:prefix] + [self.tokens[prefix + r] for r in rows]

    def held_bytes(self) -> int:
        """Bytes of the storages behind every layer's keys and values (a growing layer's spare room included)."""
        tensors = (getattr(layer, name, None) for layer in self.cache.layers for name in ("keys", "values"))
        storages = (t.untyped_storage() for t in tensors if isinstance(t, torch.Tensor))
        return sum({storage.data_ptr(): storage.nbytes() for storage in storages}.values())


def select_features(hidden_states: tuple[torch.Tensor, ...], layers: list[int]) -> torch.Tensor:
    """A draft head's input feature from a transformers ``hidden_states`` tuple
    (entry 0 = embeddings, entry i = output of layer i, the last entry already
    normalised): the last entry when ``layers`` is empty, else the named entries
    concatenated on the last dimension. [..., d] -> [..., d * max(1, len(layers))]."""
    if not layers:
        return hidden_states[-1]
    return torch.cat([hidden_states[i] for i in layers], dim=-1)


def _crop_takes_removal_count() -> bool:
    params = list(inspect.signature(DynamicCache.crop).parameters)
    return len(params) > 1 and params[1] == "tokens_to_remove"


_CROP_BY_REMOVAL = _crop_takes_removal_count()


def _crop(cache: DynamicCache, current: int, length: int) -> None:
    if _CROP_BY_REMOVAL:
        cache.crop(-(current - length))
    else:
        cache.crop(length)


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _split_features(features: torch.Tensor | None, n: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """[m + n, F] rows of a tree forward -> (root and node rows [n + 1, F], earlier chain rows [m - 1, F]), float32."""
    if features is None:
        return None, None
    return features[-(n + 1):].float(), features[: features.shape[0] - n - 1].float()


@dataclass
class TreeOutput:
    """The rows of a tree forward: row 0 belongs to the last chain token, row
    1 + i to tree node i. features: [n + 1, F] float32 or None; chain_features:
    [m - 1, F], the rows of the chain tokens before row 0 (None without features).

    Logits are computed on demand (:meth:`logits`): verification visits only the
    root and the accepted path, so the LM head -- a large share of a small
    model's cost -- runs on those rows alone. ``hidden`` is what the LM head
    reads ([n + 1, d]), or None when ``full_logits`` were computed eagerly.
    """

    lm: CausalLM
    position: int
    hidden: torch.Tensor | None
    full_logits: torch.Tensor | None
    features: torch.Tensor | None
    chain_features: torch.Tensor | None = None

    @torch.inference_mode()
    def logits(self, row: int) -> torch.Tensor:
        """Raw logits [1, vocab] (float32) of ``row``. A lazily computed row is not read
        back for a NaN check: its consumer (argmax or the tree verifier) reads it anyway
        and refuses NaN there, so a visited node costs one host read, not two."""
        if self.full_logits is not None:
            return self.full_logits[row : row + 1]
        return self.lm._head(self.hidden[row : row + 1]).float()  # [1, vocab]

    @torch.inference_mode()
    def all_logits(self) -> torch.Tensor:
        """Raw logits [n + 1, vocab] (float32) of every row, in one LM-head call: what a
        device verifies with when reading back once beats skipping unvisited rows."""
        if self.full_logits is not None:
            return self.full_logits
        return self.lm._head(self.hidden).float()  # [n + 1, vocab]


class CausalLM(TargetDefaults):
    """The torch/HF target backend (:class:`specgen.models.target.Target`): the reference, serving chains,
    trees, features, compiled forwards, and batches (:meth:`new_batch`: a :class:`~specgen.models.batch_kv.BatchKV`).

    model: a transformers ``*ForCausalLM`` in eval mode (:attr:`hf_model`, for what reads it).
    vocab_size: how many ids have a token in the tokenizer; logits are cut to
    this width so ids without a token (Qwen pads its embedding rows) have zero
    probability on every side.
    packed: on a CPU, run linear layers on oneDNN-packed weights where that applies
    (:mod:`specgen.models.packed_linear`: float32 and bfloat16); False keeps PyTorch's
    ``linear``. A model on another device keeps its layers as they are unless ``invariant``.
    invariant: compute every fed position as a single-token step computes it (linear layers
    row by row, attention query by query: :func:`packed_linear.set_rowwise`,
    :func:`attention.set_per_query`), so that verify logits can equal single-token logits bit
    for bit, at the cost of a verify pass that grows with its width. :meth:`verify_gap` measures
    whether they do, with or without it.
    """

    backend = "torch"
    #: prefix_reuse off: float matmuls may round a row differently by how many rows are fed with it, so
    #: logits after a prefix fed apart need not equal a fresh prefill's bit for bit (tests/test_prefix_cache.py)
    capabilities = Capabilities(trees=True, features=True, batches=True, prefix_reuse=False, compile=True)

    def __init__(self, model: torch.nn.Module, vocab_size: int, name: str = "model", packed: bool = True,
                 invariant: bool = False):
        self.model = model
        if next(model.parameters()).device.type == "cpu" or invariant:  # else linear layers stay as they are
            packed_linear.install(model)  # off the CPU a PackedLinear runs F.linear (row by row where invariant)
            packed_linear.set_enabled(model, packed)
        packed_linear.set_rowwise(model, invariant)
        attention.set_per_query(model, invariant)
        self.vocab_size = int(vocab_size)
        self.name = name
        self.config = model.config
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # Logits are lm_head(last hidden state) unless the model scales or caps them.
        self._plain_lm_head = all(getattr(self.config, key, None) in (None, 1, 1.0) for key in _LOGIT_TRANSFORMS) \
            and model.get_output_embeddings() is not None and hasattr(model, "get_decoder")
        self.compiled: CompiledDecoder | None = None  # set by enable_compile

    def enable_compile(self) -> None:
        """Run forwards compiled on a static KV cache (see :mod:`specgen.models.compiled`).

        Caches made before this call stay dynamic; make new ones. ConfigError for a
        model whose logits are not ``lm_head(last hidden state)``.
        """
        if not self._plain_lm_head:
            raise ConfigError(f"compile=true needs logits = lm_head(hidden state); {self.name} scales or caps them")
        packed_linear.set_enabled(self.model, False)  # inductor picks its own kernels
        self.compiled = CompiledDecoder(self.model.get_decoder(), self._cache_kwarg, self.device)
        self.is_compiled = True

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def memory_bytes(self) -> int:
        """The parameters' size in bytes."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def hf_model(self) -> torch.nn.Module:
        """The wrapped transformers model (:class:`specgen.models.target.HFBacked`)."""
        return self.model

    def describe(self) -> dict:
        """What this backend's costs and numerics depend on: backend, dtype, attention kernel."""
        return {"backend": self.backend, "dtype": str(self.dtype),
                "attention": getattr(self.config, "_attn_implementation", None)}

    def verify_gap(self, widths: Iterable[int], parents: list[int] | None = None,
                   prefix: int = GAP_PREFIX) -> tuple[float, int]:
        """Batch invariance as this model's runs verify (dtype, packed weights, attention, compiled path as
        they are now; :mod:`specgen.models.invariance`): chains of each of ``widths`` tokens, or, with
        ``parents``, :meth:`forward_tree` over that tree and its level-ordered prefixes of ``width - 1``
        nodes, rows read as rounds read them. -> (largest |logit| gap to single-token steps, tokens fed)."""
        if parents is None:
            return worst(chain_gaps(self, widths, prefix))
        sizes = [w - 1 for w in widths] + [len(parents)]
        return worst(tree_gaps(self, parents, sizes, self._tree_rows, prefix))

    def _tree_rows(self, out: TreeOutput, n: int) -> torch.Tensor:
        """[n + 1, vocab] rows of a tree forward as rounds read them: one LM-head call off the CPU, row by row on it."""
        if self.device.type != "cpu":
            return out.all_logits()
        return torch.cat([out.logits(row) for row in range(n + 1)])

    def new_cache(self) -> KVCache:
        if self.compiled is not None:
            return KVCache(new_static_cache(self.config, FIRST_CAPACITY))
        return KVCache(growing_cache(self.config))

    def new_batch(self, size: int, row_context: int | None = None) -> BatchKV:
        """``size`` rows on one shared batch cache; a row holds up to :attr:`context_length` (``row_context`` unused)."""
        return BatchKV(self, size)

    def _static_forward(self, cache: KVCache, ids: list[int] | torch.Tensor, positions: list[int], allowed: torch.Tensor,
                        all_hidden: bool = False):
        """The compiled path: grow the static cache if ``ids`` (padded to their
        bucket) would not fit, run, append ``ids`` to ``cache.tokens``.
        allowed: [n, len(cache) + n] bool. Returns CompiledDecoder.run's pair."""
        start = len(cache)
        width = bucket_for(len(ids)) or len(ids)
        limit = self.context_length + BUCKETS[-1]
        cache.cache = grown(cache.cache, self.config, start, start + width, limit)
        out = self.compiled.run(cache.cache, ids, positions, allowed, start, all_hidden)
        cache.tokens.extend([PENDING] * len(ids) if isinstance(ids, torch.Tensor) else ids)
        return out

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, d] -> raw logits [rows, vocab_size] in the model's dtype."""
        return self.model.get_output_embeddings()(hidden)[:, : self.vocab_size]

    @torch.inference_mode()
    def forward(self, cache: KVCache, new_tokens: list[int] | torch.Tensor, keep: int,
                check: bool = True) -> torch.Tensor:
        """Feed ``new_tokens`` after the cached ones; return the last ``keep`` rows.

        new_tokens: ids, or a [n] long tensor on the model's device fed without reading
        it back (the cache records them as PENDING until :meth:`KVCache.resolve`).
        Returns raw logits [keep, vocab_size] (float32). Appends to the cache.
        check: read the logits back once for NaN (NumericalError naming this model);
        False skips that host read where the consumer refuses NaN itself (a
        drafter's argmax or sample_token).
        """
        on_device = isinstance(new_tokens, torch.Tensor)
        n = int(new_tokens.shape[0]) if on_device else len(new_tokens)
        if not n:
            raise ValueError("forward needs at least one new token")
        start = len(cache)
        device = self.device
        recorded = [PENDING] * n if on_device else list(new_tokens)
        if self.compiled is not None:
            allowed = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)  # [n, start + n]
            hidden, _ = self._static_forward(cache, new_tokens if on_device else recorded,
                                             list(range(start, start + n)), allowed)  # records the tokens
            logits = self._head(hidden[-keep:])  # [keep, vocab]
        else:
            ids = new_tokens.reshape(1, n) if on_device else torch.tensor([new_tokens], dtype=torch.long, device=device)
            positions = torch.arange(start, start + n, device=device).unsqueeze(0)  # [1, n]
            inputs = dict(input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_kwarg: cache.cache})
            if self._plain_lm_head:  # the LM head on the kept rows only
                hidden = self.model.get_decoder()(**inputs).last_hidden_state[0, -keep:]  # [keep, d]
                logits = self._head(hidden)  # [keep, vocab]
            else:
                logits = self.model(**inputs, logits_to_keep=keep).logits[0, -keep:, : self.vocab_size]  # [keep, vocab]
            cache.tokens.extend(recorded)
        return self._checked(logits, start + n - 1) if check else logits.float()

    def _checked(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        logits = logits.float()
        if logits.numel() and torch.isnan(logits.max()):  # max propagates NaN: one pass, no [rows, vocab] mask
            raise NumericalError(f"{self.name} produced NaN logits at position {position}")
        return logits

    @torch.inference_mode()
    def forward_tree(self, cache: KVCache, chain: list[int], nodes: list[int], ancestors: torch.Tensor,
                     depths: list[int], feature_layers: list[int] | None = None) -> TreeOutput:
        """One forward over ``chain`` (uncached committed tokens, at least one)
        followed by draft-tree ``nodes``.

        ancestors: [N, N] bool, True where node j is node i or one of its ancestors.
        depths: depth of each node (1 = child of the root).
        Node i sees the cache, the chain and its own ancestors, at position
        ``len(cache) + len(chain) - 1 + depths[i]``. Returns rows for the last chain
        token and every node; the cache then holds chain + all nodes in node order,
        and the caller must keep only the accepted path (:meth:`KVCache.keep_rows`).
        feature_layers: None for no features, else as in ``select_features``.
        """
        if not chain:
            raise ValueError("forward_tree needs at least one chain token")
        start, m, n = len(cache), len(chain), len(nodes)
        device = self.device
        ids = torch.tensor([chain + nodes], dtype=torch.long, device=device)  # [1, m + n]
        positions = list(range(start, start + m)) + [start + m - 1 + d for d in depths]
        allowed = torch.ones(m + n, start + m + n, dtype=torch.bool, device=device)  # [m + n, start + m + n]
        allowed[:m, start:] = torch.cat([torch.ones(m, m, dtype=torch.bool, device=device).tril(),
                                         torch.zeros(m, n, dtype=torch.bool, device=device)], dim=1)
        allowed[m:, start + m:] = ancestors.to(device)
        if self.compiled is not None:
            hidden, states = self._static_forward(cache, chain + nodes, positions, allowed,
                                                  all_hidden=feature_layers is not None)
            features = None if feature_layers is None else select_features(states, feature_layers)[0]  # [m + n, F]
            return TreeOutput(self, start + m - 1, hidden[-(n + 1):], None, *_split_features(features, n))
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        inputs = dict(input_ids=ids, position_ids=torch.tensor([positions], device=device),
                      attention_mask=mask[None, None],  # [1, 1, m + n, start + m + n], additive: eager and sdpa agree
                      use_cache=True, output_hidden_states=feature_layers is not None,
                      **{self._cache_kwarg: cache.cache})
        hidden = full = None
        if self._plain_lm_head:
            out = self.model.get_decoder()(**inputs)
            hidden = out.last_hidden_state[0, -(n + 1):]  # [n + 1, d]
        else:
            out = self.model(**inputs, logits_to_keep=n + 1)
            full = self._checked(out.logits[0, -(n + 1):, : self.vocab_size], start + m - 1)  # [n + 1, vocab]
        cache.tokens.extend(chain + nodes)
        features = None if feature_layers is None else select_features(out.hidden_states, feature_layers)[0]
        return TreeOutput(self, start + m - 1, hidden, full, *_split_features(features, n))

    @torch.inference_mode()
    def forward_batch(self, cache: DynamicCache, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                      lengths: list[int], picks: torch.Tensor) -> torch.Tensor:
        """One forward of B rows sharing a batch-B DynamicCache (:class:`BatchKV`), fed flat: no padding
        reaches a linear layer or an attention call (:class:`attention.BatchRows`).

        ids, positions: [T] every row's new tokens and their positions, row j's ``lengths[j]`` (at least
        one) after row j - 1's; allowed: [B, w, S + w] bool (w = max(lengths)), which of the S cached
        slots and w new slots row j's query i < lengths[j] sees (at least one each); picks: [K] indices
        into the T tokens whose logits are wanted. Returns raw logits [K, vocab_size] (float32), refusing
        NaN (NumericalError). Appends w slots to every row of ``cache`` (row j's first lengths[j] its new
        keys/values, the rest zero); on any exception the cache is cut back to S slots before re-raising.
        """
        if getattr(self.config, "_attn_implementation", None) != attention.NAME:
            raise ConfigError(f"batched forwards need attn_implementation={attention.NAME!r}, not "
                              f"{getattr(self.config, '_attn_implementation', None)!r}")
        device = self.device
        dtype = next(self.model.parameters()).dtype
        start = int(allowed.shape[-1] - max(lengths))
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)  # [B, w, S + w], additive
        mask.masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
        inputs = dict(input_ids=ids.to(device)[None], position_ids=positions.to(device)[None],  # [1, T]
                      attention_mask=mask[:, None], use_cache=False,
                      **{attention.ROWS: attention.BatchRows(cache, lengths)})
        try:
            if self._plain_lm_head:  # the head's input [K, d]: only the picked tokens through the LM head
                hidden = self.model.get_decoder()(**inputs).last_hidden_state  # [1, T, d]
                logits = self._head(hidden[0, picks.to(device)])  # [K, vocab]
            else:
                full = self.model(**inputs).logits  # [1, T, vocab']
                logits = full[0, picks.to(device), : self.vocab_size]  # [K, vocab]
            return self._checked(logits, start)
        except BaseException:
            for layer in cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4 and layer.keys.shape[-2] > start:
                    layer.keys = layer.keys[..., :start, :]  # [B, heads, S, head_dim]
                    layer.values = layer.values[..., :start, :]
            raise
