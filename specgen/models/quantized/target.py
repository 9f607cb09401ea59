"""The quantized torch target: a Llama-family model on torch's int CPU kernels, batch invariant by construction.

:class:`QuantizedLM` implements :class:`specgen.models.target.Target` for chains,
draft trees with target features (:meth:`QuantizedLM.forward_tree`, for learned drafters) and
batched rows (:class:`QuantBatch`). Its forward is :class:`~specgen.models.quantized.model.LeanLlama`;
its KV handle is :class:`QuantKV`. Batched rows share every linear layer's call
(each row's result is its own: the kernels compute rows independently) and attend
each over its own buffers, so a row's logits equal the request's alone. Exactness rests on batch invariance, which
:meth:`QuantizedLM.verify_gap` measures (the build declares ``exact``/``greedy``
only where it is zero over the widths a run uses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specgen.errors import NumericalError
from specgen.models.invariance import GAP_PREFIX, chain_gaps, tree_gaps, worst
from specgen.models.quantized.kernels import KERNELS, w8a8_op
from specgen.models.quantized.model import KEY_BUCKET, Feed, KVBuffers, LeanLlama
from specgen.models.quantized.spans import TreePart
from specgen.models.quantized.smooth import Smoothing
from specgen.models.target import Capabilities, TargetDefaults, TokenCache
from specgen.sampling.tree_structure import ROOT


@dataclass
class QuantKV(TokenCache):
    """One sequence's KV handle: ``tokens`` are the ids whose entries ``buffers`` hold, in order.
    Cropping only shortens ``tokens`` (later slots are overwritten by the next forward)."""

    buffers: KVBuffers
    tokens: list[int] = field(default_factory=list)

    def _truncate(self, length: int) -> None:
        pass

    def keep_rows(self, prefix: int, rows: list[int]) -> None:
        """Keep the first ``prefix`` entries plus the entries at ``prefix + r`` for each r in ``rows``
        (increasing), in that order; drop the rest (after a tree forward: the accepted path's entries,
        which a tree forward computes as a chain would, move to the slots a chain would have written)."""
        if rows != list(range(len(rows))):
            source = torch.tensor([prefix + r for r in rows])  # [kept]
            for buffer in (self.buffers.keys, self.buffers.values):  # [layers, capacity, kv, hd]
                buffer[:, prefix:prefix + len(rows)] = buffer[:, source]
            self.tokens[prefix:] = [self.tokens[prefix + r] for r in rows]
        self.crop(prefix + len(rows))

    def held_bytes(self) -> int:
        return self.buffers.keys.nbytes + self.buffers.values.nbytes


@dataclass
class QuantTreeRows:
    """The rows of :meth:`QuantizedLM.forward_tree` (:class:`specgen.models.target.TreeRows`): row 0
    belongs to the last chain token, row 1 + i to node i. ``hidden``: their normalised final hidden
    states [n + 1, d], which the LM head reads on demand (row by row, as it computes rows apart);
    features [n + 1, F] and chain_features [m - 1, F] float32, or None."""

    lm: QuantizedLM
    hidden: torch.Tensor
    features: torch.Tensor | None
    chain_features: torch.Tensor | None

    @torch.inference_mode()
    def logits(self, row: int) -> torch.Tensor:
        """Raw logits [1, vocab] float32 of ``row``."""
        return self.lm.net.logits(self.hidden[row:row + 1])[:, : self.lm.vocab_size]

    @torch.inference_mode()
    def all_logits(self) -> torch.Tensor:
        """Raw logits [n + 1, vocab] float32 of every row."""
        return self.lm.net.logits(self.hidden)[:, : self.lm.vocab_size]


class QuantizedLM(TargetDefaults):
    """A Llama-family model on quantized linears (:mod:`specgen.models.quantized.kernels`).

    model: the transformers model whose float32 weights are quantized (kept only with ``keep_model``,
    as :attr:`hf_model`);
    vocab_size: the tokenizer's size (logits are cut to it); kind: the layers' kernel as chosen
    (``int8``, ``int4``, ``w8a8`` or ``float``) and head_kind the LM head's; fallback: why the kind asked
    for is not what runs (None when it is), stated in :meth:`describe`; smoothing: the calibrated
    per-channel factors folded into the weights (``w8a8``; None: none).
    """

    backend = "torch_quant"
    capabilities = Capabilities(trees=True, features=True, batches=True)
    device = torch.device("cpu")
    dtype = torch.float32  # the logits' (the weights are int8/int4 with bfloat16 scales)

    def __init__(self, model: torch.nn.Module, vocab_size: int, *, kind: str, head_kind: str, name: str = "model",
                 fallback: str | None = None, smoothing: Smoothing | None = None, keep_model: bool = False):
        self.net = LeanLlama(model, kind, head_kind, smoothing)
        self._model = model if keep_model else None
        embedding = model.get_input_embeddings().weight.detach()  # [vocab', d]
        if keep_model and embedding.dtype == torch.float32 and torch.equal(embedding, self.net.embedding):
            self.net.embedding = embedding  # one copy of the table, the kept model's
        self.smoothing = smoothing
        self.context_length = self.net.context_length
        self.vocab_size = int(vocab_size)
        self.name = name
        self.kind, self.head_kind, self.fallback = kind, head_kind, fallback
        self._gaps: dict[int, float] = {}  # width -> its gap after GAP_PREFIX tokens

    @property
    def memory_bytes(self) -> int:
        """The quantized forward's bytes, plus the float32 model's where it is kept (:attr:`hf_model`)."""
        if self._model is None:
            return self.net.memory_bytes
        shared = self.net.embedding.untyped_storage().data_ptr()
        kept = sum(p.numel() * p.element_size() for p in self._model.parameters()
                   if p.untyped_storage().data_ptr() != shared)
        return self.net.memory_bytes + kept

    @property
    def hf_model(self) -> torch.nn.Module | None:
        """The float32 transformers model the weights were quantized from, where the loader kept it
        (``keep_model``: a learned head reads its embeddings and fingerprint); None otherwise
        (:class:`specgen.models.target.HFBacked`)."""
        return self._model

    def describe(self) -> dict:
        """What this path's costs and numerics depend on; ``dtype`` names the kernels that run."""
        return {"backend": self.backend, "dtype": self.path, "attention": f"sdpa over masked key spans of {KEY_BUCKET}"}

    @property
    def path(self) -> str:
        """The numerical path in words, e.g. ``int8 (torch _weight_int8pack_mm)``."""
        layers = self._words(self.kind)
        head = "" if self.head_kind == self.kind else f"; LM head {self._words(self.head_kind)}"
        shapes = sorted({l.reason for l in self.net.linears() if l.reason})
        odd = f"; float linear where {'; '.join(shapes)}" if shapes else ""
        why = f" (fallback: {self.fallback})" if self.fallback else ""
        smooth = f"; smoothed, alpha {self.smoothing.alpha}" if self.smoothing is not None else ""
        return f"{layers}{head}{smooth}{odd}{why}"

    @staticmethod
    def _words(kind: str) -> str:
        if kind == "float":
            return "float32 linear"
        if kind == "w8a8":
            return f"w8a8 (torch {w8a8_op()}, 8-bit activations per row)"
        return f"{kind} (torch {KERNELS[kind]}, bfloat16 activations)"

    def new_cache(self) -> QuantKV:
        return QuantKV(self.net.new_buffers())

    def new_batch(self, size: int, row_context: int | None = None) -> QuantBatch:
        """A batch of ``size`` rows of at most ``row_context`` tokens each (None: the context length)."""
        return QuantBatch(self, size, min(row_context or self.context_length, self.context_length))

    def forward(self, cache: QuantKV, new_tokens: list[int] | torch.Tensor, keep: int,
                check: bool = True) -> torch.Tensor:
        """Feed ``new_tokens`` after the cached ones; return the last ``keep`` rows' raw logits
        [keep, vocab_size] (float32); ``check``: NumericalError on NaN. Appends to the cache."""
        ids = new_tokens.tolist() if isinstance(new_tokens, torch.Tensor) else [int(t) for t in new_tokens]
        return self.forward_rows([cache], [ids], [keep], check)[0]

    @torch.inference_mode()
    def forward_rows(self, caches: list[QuantKV], feeds: list[list[int]], keeps: list[int],
                     check: bool = True) -> list[torch.Tensor]:
        """One forward over several sequences: ``feeds[r]`` (ids, at least one) after the tokens of
        ``caches[r]``; -> per sequence its last ``keeps[r]`` rows' raw logits [keeps[r], vocab_size]
        (float32), equal bit for bit to what the sequence gets fed alone. Appends each feed to its
        cache only once every row is computed (on an error no cache changes)."""
        if not all(feeds):
            raise ValueError("forward needs at least one new token")
        parts = [Feed(cache.buffers, len(cache), len(ids), keep) for cache, ids, keep in zip(caches, feeds, keeps)]
        ids = torch.tensor([t for feed in feeds for t in feed], dtype=torch.long)  # [sum n]
        logits = self.net.forward(parts, ids)[:, : self.vocab_size]  # [sum keep, vocab]
        if check and logits.numel() and torch.isnan(logits.max()):
            raise NumericalError(f"{self.name} produced NaN logits")
        for cache, feed in zip(caches, feeds):
            cache.tokens.extend(feed)
        return list(logits.split(list(keeps)))

    @torch.inference_mode()
    def forward_tree(self, cache: QuantKV, chain: list[int], nodes: list[int], ancestors: torch.Tensor,
                     depths: list[int], feature_layers: list[int] | None = None) -> QuantTreeRows:
        """One forward over ``chain`` (uncached committed tokens, at least one) then draft-tree ``nodes``
        (ancestors: [N, N] bool, True where node j is node i or one of its ancestors; depths: each
        node's, 1 = a child of the root), as :meth:`specgen.models.causal_lm.CausalLM.forward_tree`.

        Node i is computed in the shapes of a one-token step at position ``len(cache) + len(chain) - 1
        + depths[i]`` over the cache, the chain and its ancestors in depth order (a chain-shaped tree
        is fed as a chain), so its row equals its path fed token by token bit for bit where
        :meth:`verify_gap` with ``parents`` is 0. The cache then holds chain + every node in node
        order; :meth:`QuantKV.keep_rows` keeps the accepted path."""
        if not chain:
            raise ValueError("forward_tree needs at least one chain token")
        start, m, n = len(cache), len(chain), len(nodes)
        parents = [next((j for j in torch.nonzero(ancestors[i]).flatten().tolist() if depths[j] == depths[i] - 1), ROOT)
                   for i in range(n)]
        tree = None if parents == list(range(-1, n - 1)) else TreePart(parents)
        ids = torch.tensor(list(chain) + list(nodes), dtype=torch.long)  # [m + n]
        hidden, features = self.net.hidden([Feed(cache.buffers, start, m + n, n + 1, tree)], ids, feature_layers)
        cache.tokens.extend(list(chain) + list(nodes))
        if features is None:
            return QuantTreeRows(self, hidden, None, None)
        return QuantTreeRows(self, hidden, features[m - 1:], features[:m - 1])  # [n + 1, F], [m - 1, F]

    def verify_gap(self, widths, parents: list[int] | None = None, prefix: int = GAP_PREFIX) -> tuple[float, int]:
        """Batch invariance (:mod:`specgen.models.invariance`): the largest |logit| difference between
        positions fed ``width`` at a time and the same positions fed one by one, over ``widths``;
        -> (max difference, its width). Widths are measured once per process (for the default
        prefix). ``parents``: tree forwards over that tree and its level-ordered prefixes of
        ``width - 1`` nodes instead, rows read one by one as rounds on the CPU read them."""
        if parents is not None:
            sizes = [int(w) - 1 for w in widths] + [len(parents)]
            return worst(tree_gaps(self, parents, sizes, _rows_one_by_one, prefix))
        widths = sorted({int(w) for w in widths})
        memo = self._gaps if prefix == GAP_PREFIX else {}
        memo.update(chain_gaps(self, [w for w in widths if w not in memo], prefix))
        return worst({w: memo[w] for w in widths})


def _rows_one_by_one(out: QuantTreeRows, n: int) -> torch.Tensor:
    """[n + 1, vocab] rows of a tree forward, each through the LM head on its own (as rounds on the CPU read them)."""
    return torch.cat([out.logits(row) for row in range(n + 1)])


class QuantBatch:
    """``size`` rows of a :class:`QuantizedLM`, each a :class:`QuantKV` of its own, a
    :class:`~specgen.models.target.BatchCache` (:mod:`specgen.batch`): a step's feeds go in one
    :meth:`QuantizedLM.forward_rows`; nothing is padded or shared, so there is nothing to compact."""

    #: Each row attends only to its own buffers.
    shares_width = False
    #: A fresh row's prompt goes in its first step's forward (its rows are its own there too).
    prefills_apart = False
    #: Prompts are not chunked across steps: a prompt is fed whole, as a request's is alone.
    prefill_chunk = None

    def prefill_take(self, r: int, length: int) -> int:
        """Not called: prompts are not chunked across steps here (:attr:`prefill_chunk` is None)."""
        raise NotImplementedError("prompts are not chunked on this batch cache")

    def __init__(self, lm: QuantizedLM, size: int, row_context: int):
        self.lm, self.row_context = lm, int(row_context)
        self.rows: list[QuantKV] = [lm.new_cache() for _ in range(size)]

    @property
    def width(self) -> int:
        return max((len(row) for row in self.rows), default=0)

    def prefill(self, r: int, tokens: list[int], reuse: bool = True) -> bool:
        """Feed a fresh row's ``tokens`` (no logits); -> False, doing nothing, when the row already
        holds tokens or ``tokens`` is empty. ``reuse`` has no effect (rows share nothing)."""
        row = self.rows[r]
        if len(row) or not tokens:
            return False
        self.lm.forward_rows([row], [list(tokens)], [0], check=False)
        return True

    def clear_row(self, r: int) -> QuantKV:
        """Forget row ``r``'s tokens (a refill)."""
        self.rows[r].crop(0)
        return self.rows[r]

    def forward(self, feeds: list[list[int]], keeps: list[int]) -> list[torch.Tensor | None]:
        """One forward over every row's feed (empty: the row idles); -> per row its last ``keeps[r]``
        raw logits rows (None where the row idles). On failure no row changes."""
        live = [r for r, feed in enumerate(feeds) if feed]
        logits = self.lm.forward_rows([self.rows[r] for r in live], [list(feeds[r]) for r in live],
                                      [keeps[r] for r in live])
        out: list[torch.Tensor | None] = [None] * len(feeds)
        for r, rows in zip(live, logits):
            out[r] = rows if keeps[r] else None
        return out

    def rewind(self, width: int) -> None:
        """Nothing to cut: rows cropped one by one drop their own entries."""

    def compact(self) -> None:
        """Nothing to gather: rows hold only their own entries."""

    def maybe_compact(self) -> None:
        """See :meth:`compact`."""
