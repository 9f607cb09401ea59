"""The target protocol: what the engine, rounds, drafters and cost measurement see of a model.

A backend feeds committed + candidate tokens and returns raw logits for the
positions asked, with a KV handle (:class:`TokenCache`) that records which
tokens its entries belong to, so committing a round is ``sync`` (keep the
longest common prefix with the committed tokens) and rolling back is ``crop``.

Backends: :class:`specgen.models.causal_lm.CausalLM` (torch/HF, the reference:
chains, trees, features, batches, GPUs),
:class:`specgen.models.quantized.QuantizedLM` (``torch_quant``: Llama-family
models on torch's int8/int4 CPU kernels, chains) and
:class:`specgen.models.llama_cpp.LlamaCppLM` (GGUF files on a CPU through
llama.cpp). Each declares what it serves in :class:`Capabilities`; a
combination a backend cannot serve is refused before loading
(:func:`specgen.config.checks`), never approximated.

Consumers (engine, rounds, batches, planning, drafters) see a :class:`Target` only: they
never name a backend class or branch on :attr:`Target.backend` (a name for reports and
messages), and never reach into a backend's model. What one backend has beyond the
protocol is an optional protocol here, checked where it is used: :class:`HFBacked` (a
transformers model behind the target). Batches of many requests go through one protocol
whatever the backend: :meth:`Target.new_batch` returns a :class:`BatchCache`.
tests/test_target_protocol_use.py holds it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from specgen.errors import ConfigError

BackendName = Literal["torch", "torch_quant", "llama_cpp"]

#: A cached entry whose token id is still on the device (see TokenCache.resolve).
PENDING = -1


@dataclass(frozen=True)
class Capabilities:
    """What a backend serves.

    trees: a forward over a draft tree with an ancestor mask (``forward_tree``);
    features: hidden states of chosen layers for learned drafters;
    batches: ragged multi-request forwards on a :class:`BatchCache` (``new_batch``, :mod:`specgen.batch`);
    prefix_reuse: a handle synced to a prefix of a new request's ids, then fed the rest, gives
    the logits of a fresh handle fed every id, bit for bit (measured per backend, see
    tests/test_prefix_cache.py): the pipeline's prefix cache (:mod:`specgen.models.prefix_cache`)
    is on only where it holds;
    prefill_floor: the fewest tokens a forward must feed for the entries it writes to be those a
    fresh prefill writes (1: any forward; more where a backend's kernels compute narrow forwards,
    such as decode steps, otherwise than wide ones). Entries written otherwise are not reused
    (:attr:`TokenCache.reusable`), and a request that reuses a prefix feeds at least this many
    tokens; batch slots keep no prefix for the next row where it is above 1;
    compile: forwards compiled on a static KV cache (``enable_compile``, ``compile=true``).
    """

    trees: bool
    features: bool
    batches: bool
    prefix_reuse: bool = True
    prefill_floor: int = 1
    compile: bool = False


class TokenCache:
    """A KV handle's bookkeeping: ``tokens`` are the ids whose entries are cached, in order.

    Subclasses implement :meth:`_truncate` (drop every entry from ``length`` on)."""

    tokens: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def reusable(self) -> int:
        """How many leading entries are those a fresh prefill of the same ids writes, bit for bit
        (what a prefix cache may hand to another request; see ``Capabilities.prefill_floor``)."""
        return len(self.tokens)

    def resolve(self, values: list[int]) -> None:
        """Name the ids of entries fed as device tensors (:data:`PENDING` in ``tokens``),
        in order, once they are read back. Entries left pending never match a committed
        token, so :meth:`sync` drops them: correct, only slower."""
        values = iter(values)
        for i, token in enumerate(self.tokens):
            if token == PENDING:
                value = next(values, None)
                if value is None:
                    return
                self.tokens[i] = value

    def sync(self, committed: list[int]) -> None:
        """Crop to the longest common prefix with ``committed``."""
        limit = min(len(self.tokens), len(committed))
        if limit == len(self.tokens):  # the usual case, compared in C: one slice copied, not two
            if committed[:limit] == self.tokens:
                return
        elif self.tokens[:limit] == committed:
            self.crop(limit)
            return
        keep = 0
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
        return committed[len(self.tokens):]

    def keep_prefix_of(self, ids: list[int], floor: int = 1) -> int:
        """Crop to what a prefill of ``ids`` may start from: their common prefix, at most the
        :attr:`reusable` entries and ``len(ids) - 1`` (the last id is fed, for its logits), and
        short enough that at least ``floor`` ids are fed (``Capabilities.prefill_floor``, where
        ``ids`` has that many); -> the entries kept."""
        self.sync(ids)
        self.crop(min(len(self.tokens), self.reusable, max(len(ids) - 1, 0)))
        if len(ids) - len(self.tokens) < floor:
            self.crop(max(len(ids) - floor, 0))
        return len(self.tokens)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries."""
        if length >= len(self.tokens):
            return
        self._truncate(length)
        del self.tokens[length:]

    def held_bytes(self) -> int:
        """Bytes of KV memory this handle holds (0: not known to the backend; then only the
        prefix cache's entry bound limits it)."""
        return 0

    def release(self) -> None:
        """Give the handle's entries back now (a pooled backend reuses them for another request);
        the handle is not used after. Collecting the handle does the same, later."""

    def _truncate(self, length: int) -> None:
        raise NotImplementedError


class TreeRows(Protocol):
    """The rows of a tree forward (:meth:`Target.forward_tree`): row 0 belongs to the last chain token,
    row 1 + i to tree node i; ``logits(row)`` -> [1, vocab] and ``all_logits()`` -> [n + 1, vocab], raw,
    float32. features: [n + 1, F] float32 or None; chain_features: [m - 1, F], the chain tokens' rows
    before row 0 (None without features)."""

    features: torch.Tensor | None
    chain_features: torch.Tensor | None

    def logits(self, row: int) -> torch.Tensor: ...

    def all_logits(self) -> torch.Tensor: ...


@runtime_checkable
class Target(Protocol):
    """A model the engine can verify with.

    ``forward(cache, new_tokens, keep, check)`` feeds ``new_tokens`` (ids, or a [n]
    long tensor) after the cached ones at the next positions and returns the raw
    logits of the last ``keep`` fed positions, [keep, vocab_size] float32, appending
    the fed tokens to ``cache``; ``check`` refuses NaN (NumericalError naming the
    model). For ``exact``/``greedy`` to hold, the logits of a position must not depend
    on how many tokens were fed with it: ``verify_gap`` measures that, and the build
    declares ``exact``/``greedy`` only where it returns 0.0.

    Gated by :attr:`capabilities` (a backend that declares one off refuses the call with
    ConfigError, see :class:`TargetDefaults`): ``forward_tree`` (``trees``; its
    ``feature_layers``: ``features``), ``enable_compile`` (``compile``), ``new_batch``
    (``batches``).
    ``context_hint``: the setting that raises :attr:`context_length`, for the message that
    refuses a prompt longer than it (None: none does).
    """

    name: str
    vocab_size: int
    backend: BackendName
    capabilities: Capabilities
    context_hint: str | None

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def context_length(self) -> int: ...

    @property
    def memory_bytes(self) -> int: ...

    @property
    def is_compiled(self) -> bool:
        """Whether forwards run compiled (after ``enable_compile``)."""

    def new_cache(self) -> TokenCache: ...

    def forward(self, cache: TokenCache, new_tokens: list[int] | torch.Tensor, keep: int,
                check: bool = True) -> torch.Tensor: ...

    def forward_tree(self, cache: TokenCache, chain: list[int], nodes: list[int], ancestors: torch.Tensor,
                     depths: list[int], feature_layers: list[int] | None = None) -> TreeRows:
        """One forward over ``chain`` (uncached committed tokens, at least one) then draft-tree
        ``nodes`` (ancestors: [N, N] bool, depths: each node's, 1 = a child of the root), with the
        hidden states of ``feature_layers`` (None: none); the cache then holds chain + every node
        (see :meth:`specgen.models.causal_lm.CausalLM.forward_tree`)."""

    def enable_compile(self) -> None:
        """Run later forwards compiled; caches made before stay as they are."""

    def new_batch(self, size: int, row_context: int | None = None) -> BatchCache:
        """A batch of ``size`` rows, each holding at most ``row_context`` tokens (None: the backend's
        default, at most :attr:`context_length`), for :mod:`specgen.batch`."""

    def describe(self) -> dict: ...

    def verify_gap(self, widths: Iterable[int], parents: list[int] | None = None) -> tuple[float, int]:
        """Batch invariance as this target's runs verify (:mod:`specgen.models.invariance`): the
        largest |logit| difference between positions fed together and the same positions fed one
        token at a time, over chains of each of ``widths`` tokens, or, with ``parents``, tree
        forwards over that tree and its level-ordered prefixes; -> (max difference, the tokens
        fed where it occurs). 0.0 for ``exact``/``greedy``; a backend without trees refuses
        ``parents`` (ValueError)."""


class TargetDefaults:
    """What a backend inherits for the parts of :class:`Target` its :class:`Capabilities`
    declare off: each refuses with ConfigError naming the backend (checks refuse such runs
    before loading; this is the guard behind them)."""

    backend: BackendName
    context_hint: str | None = None
    is_compiled = False

    def forward_tree(self, cache: TokenCache, chain: list[int], nodes: list[int], ancestors: torch.Tensor,
                     depths: list[int], feature_layers: list[int] | None = None) -> TreeRows:
        raise ConfigError(f"the {self.backend} backend serves no tree forwards (capabilities.trees is off)")

    def enable_compile(self) -> None:
        raise ConfigError(f"compile=true compiles a torch model; the {self.backend} backend has no compiled path")

    def new_batch(self, size: int, row_context: int | None = None) -> BatchCache:
        raise ConfigError(f"the {self.backend} backend serves no batched forwards (capabilities.batches is off)")


@runtime_checkable
class HFBacked(Protocol):
    """Optional: a target with a transformers model behind it (the torch backend), for what reads the
    model itself: HF ``generate()`` baselines, learned heads (embeddings, fingerprint), training."""

    @property
    def hf_model(self) -> torch.nn.Module | None:
        """The transformers model behind this target; None: there is none."""


def hf_model_of(target: object) -> torch.nn.Module | None:
    """The transformers model behind ``target`` (:class:`HFBacked`), or None where there is none."""
    return target.hf_model if isinstance(target, HFBacked) else None


@runtime_checkable
class BatchCache(Protocol):
    """The KV state of a batch of rows (:meth:`Target.new_batch`), the one thing :mod:`specgen.batch`
    and the batched cost model (:func:`specgen.planning.measure.measure_batch`) feed.

    rows: one :class:`TokenCache` handle per row made so far (a backend may make rows when first
    used: ``len(rows)`` can be below the batch's size; :meth:`clear_row` and :meth:`prefill` make
    the row they name), each the ``target_cache`` of the request on that row. width: the slots a
    step's attention spans at most (the shared width, or the longest row). row_context: the most
    tokens a row may hold.

    shares_width: rows share one cache width (a forward spans the widest row's slots until
    :meth:`compact`), so a row cannot be fed a kept prefix apart from the others.
    prefills_apart: a fresh row's prompt (all but its last token) goes in :meth:`prefill`, a
    forward of its own, before its first step; False: in its first step's :meth:`forward`.
    prefill_chunk: the width the backend splits a prompt's decodes at, from its first token,
    whatever feeds it (a prompt fed in chunks ending on these splits decodes as it does alone,
    :func:`specgen.batch.steps.prefill_chunks`); None: prompts are not chunked across steps.
    """

    rows: list[TokenCache]
    shares_width: bool
    prefills_apart: bool

    @property
    def width(self) -> int: ...

    @property
    def row_context(self) -> int: ...

    @property
    def prefill_chunk(self) -> int | None: ...

    def prefill_take(self, r: int, length: int) -> int:
        """Tokens row ``r``'s next prompt chunk feeds (at least 1, at most :attr:`prefill_chunk`) of its
        prompt of ``length`` tokens, so that the prompt decodes as alone; called only where
        :attr:`prefill_chunk` is not None."""
        ...

    def prefill(self, r: int, tokens: list[int], reuse: bool = True) -> bool:
        """Feed a fresh row ``r``'s ``tokens`` (no logits read); -> False, doing nothing, where the row
        already holds tokens or ``tokens`` is empty. reuse=False: a shared-width cache appends every
        token in new slots (the cost model's wide cache); no effect where rows share nothing."""

    def clear_row(self, r: int) -> TokenCache:
        """Forget row ``r``'s tokens (a refill); -> its handle, empty."""

    def forward(self, feeds: list[list[int]], keeps: list[int]) -> list[torch.Tensor | None]:
        """One forward over every row's feed (empty: the row idles); -> per row its last ``keeps[r]``
        raw logits rows [keeps[r], vocab] float32 (None where keeps[r] == 0), each equal bit for bit
        to its row's tokens fed alone where the backend's batch gap is 0. On success each row's
        handle gains its feed; on failure no row changes."""

    def rewind(self, width: int) -> None:
        """Cut the shared slots back to ``width`` (no row may list a slot past it); nothing where rows
        share nothing."""

    def compact(self) -> None:
        """Gather each row's entries left-aligned (width = the longest row); nothing where rows share nothing."""

    def maybe_compact(self) -> None:
        """Trim, and compact where dead slots have piled up (before a step's transaction)."""
