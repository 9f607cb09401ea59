"""Batched rows on llama.cpp: the batched cache of :mod:`specgen.batch` for a :class:`LlamaCppLM`.

A batch has a llama.cpp context of its own with one KV stream per row, so a row's
cells stay in position order whatever the other rows do, as a request's do alone
(in one shared cell pool, a row's later tokens can land in cells another row freed,
before its earlier ones, and attention then sums in another order). A step's feeds,
every row's uncached tokens plus its candidates, go to llama.cpp in one decode
(:meth:`~specgen.models.llama_context.LlamaContext.forward_rows`); a fresh row's prompt
goes in that step too, in decodes of its own that end with its first kept row, as a
request's prompt does alone. Nothing is padded
and rows never share cells, so there is nothing to compact or cut back: a rolled-back
row frees its own cells.

A long prompt is fed a chunk per step (:func:`specgen.batch.steps.prefill_chunks`), the chunk
sized by :meth:`LlamaBatch.prefill_take`: on the grid its solo run splits it at (every
``prefill_chunk`` tokens from its first), or, where :func:`split_gap` measures that the way a
prompt's decodes are split changes no logits, in chunks sized to cost about
:data:`PREFILL_BUDGET` of the cheapest prompt tokens the batch has decoded (measured as it runs), so
a step beside other rows' decodes stays short at any depth.

The context grows with the rows in use, not with the batch's size: it is opened for
one row and, when a row beyond it is first used, reopened for twice as many (at most
``size``), each row's sequence moved over byte for byte
(:meth:`~specgen.models.llama_context.LlamaContext.take`). A batch whose every row at
full length would not fit in the memory available is refused before anything is allocated.
"""

from __future__ import annotations

import itertools
import time

import torch

from specgen.errors import ConfigError
from specgen.machine import available_memory, format_bytes
from specgen.models.invariance import span_splits
from specgen.models.llama_context import LlamaKV

#: Row contexts are a multiple of this many tokens (llama.cpp pads its KV cache to it).
ROW_ALIGN = 256
#: Where splits are free (:func:`split_gap` is 0), a prompt chunk costs about this many of the cheapest
#: prompt tokens' decode time (:meth:`LlamaBatch.prefill_take`): the most a request admitted
#: meanwhile waits for, beside the other rows' decodes.
PREFILL_BUDGET = 4
#: Chunk widths the split probe feeds a prompt in (:func:`split_gap`), then the prompt's last token.
SPLIT_PROBE = (1, 2, 3, 5, 8, 13, 32, 4)


class LlamaBatch:
    """``size`` rows of ``row_context`` tokens on a context of ``lm``'s model, a
    :class:`~specgen.models.target.BatchCache`.

    rows: one LlamaKV handle per row the context holds so far (:attr:`capacity`; a row
    beyond is made when first used); width: the longest row, in tokens (the cells a
    row's attention reads at most); row_context: the most tokens a row may hold.
    ConfigError, nothing allocated, where ``size`` full rows need more KV cache than the
    memory available.
    """

    #: Each row attends only to its own cells (see :meth:`compact`).
    shares_width = False
    #: A fresh row's prompt goes in its first step's forward, where its span is decoded on its own
    #: and gives the row's first logits (:meth:`LlamaContext.forward_rows`), as a request's does
    #: alone; :meth:`prefill` is for the cost model's timings.
    prefills_apart = False

    def __init__(self, lm, size: int, row_context: int, splits_free: bool = False):
        self.lm, self.size = lm, int(size)
        self._splits_free = bool(splits_free)
        self.row_context = row_cells(row_context)
        check_fits(lm, self.size, self.row_context)
        self.context = lm.open_context(self.row_context, 1)
        self.rows: list[LlamaKV] = [self.context.new_handle()]
        self._rates: dict[int, tuple[int, float]] = {}  # row -> (its length then, seconds per token of its last chunk)
        self._cheapest: float | None = None  # the fewest seconds per token any chunk took
        #: "measured": chunks sized by time where :attr:`splits_free`; "grid": the solo run's splits regardless.
        self.splits = "measured"

    @property
    def capacity(self) -> int:
        """Rows the current context holds (its KV cache is ``capacity * row_context`` tokens)."""
        return len(self.rows)

    def _reach(self, r: int) -> None:
        """Make row ``r`` exist: reopen the context for twice the rows (or r + 1, at most ``size``),
        every row's sequence moved to it. On failure the batch is as before."""
        if r < len(self.rows):
            return
        if not 0 <= r < self.size:
            raise IndexError(f"row {r} of a batch of {self.size}")
        rows = min(self.size, max(r + 1, 2 * len(self.rows)))
        context = self.lm.open_context(self.row_context * rows, rows)
        try:
            for handle in self.rows:
                context.take(handle)
        except BaseException:
            for handle in self.rows:
                handle.bind(self.context)  # its entries never left the old context
            context.close()
            raise
        self.context.close()
        self.context = context
        self.rows.extend(context.new_handle() for _ in range(rows - len(self.rows)))

    @property
    def prefill_chunk(self) -> int:
        """The width a row's prompt is split at, from its first token, whatever feeds it (a solo run
        included): a prompt fed in chunks ending on these splits is decoded as it is alone."""
        return self.context.prefill_tokens

    @property
    def prefill_floor(self) -> int:
        """The narrowest decode a solo prefill's last split may be (see
        :func:`~specgen.models.invariance.span_splits`, which gives the splits of :attr:`prefill_chunk`)."""
        return self.context.prefill_floor

    @property
    def splits_free(self) -> bool:
        """Whether a prompt's decodes may be split anywhere without changing a logit (as the model
        measured when it made this batch, :func:`split_gap`), unless :attr:`splits` is "grid"."""
        return self.splits != "grid" and self._splits_free

    def prefill_take(self, r: int, length: int) -> int:
        """How many tokens row ``r``'s next prompt chunk feeds (no logits read; at least 1), of a prompt
        of ``length`` tokens: to the end of its solo run's decode (:func:`span_splits` of the prompt
        by :attr:`prefill_chunk` and :attr:`prefill_floor`), or, where
        :attr:`splits_free`, at most :attr:`prefill_chunk` sized by time: PREFILL_BUDGET times the
        cheapest per-token time of any chunk so far, over this row's last chunk's per-token time
        (PREFILL_BUDGET tokens before a measurement)."""
        grid, held = self.prefill_chunk, len(self.rows[r]) if r < len(self.rows) else 0
        if not self.splits_free:
            ends = itertools.accumulate(span_splits(length, grid, self.prefill_floor))
            return next(end for end in ends if end > held) - held
        measured_at, rate = self._rates.get(r, (None, None))
        if rate is None or measured_at > held or not self._cheapest:  # no chunk of this prompt measured yet
            return min(grid, PREFILL_BUDGET)
        return max(1, min(grid, int(PREFILL_BUDGET * self._cheapest / rate)))

    @property
    def width(self) -> int:
        return max((len(row) for row in self.rows), default=0)

    def prefill(self, r: int, tokens: list[int], reuse: bool = True) -> bool:
        """Feed a fresh row's ``tokens`` in decodes of their own, no logits read (the cost model's
        prefilled rows; a batch step feeds a fresh prompt itself, see :attr:`prefills_apart`);
        -> False, doing nothing, when the row already holds tokens or ``tokens`` is empty.
        ``reuse`` has no effect (rows never share cells)."""
        self._reach(r)
        row = self.rows[r]
        if len(row) or not tokens:
            return False
        self.context.forward_rows([row], [list(tokens)], [0], check=False)  # its KV entries only
        return True

    def clear_row(self, r: int) -> LlamaKV:
        """Forget row ``r``'s tokens (a refill): its cells are freed."""
        self._reach(r)
        self.rows[r].crop(0)
        self._rates.pop(r, None)
        return self.rows[r]

    def forward(self, feeds: list[list[int]], keeps: list[int]) -> list[torch.Tensor | None]:
        """One decode over every row's feed (empty: the row idles); -> per row its last
        ``keeps[r]`` raw logits rows [keeps[r], vocab] (None where keeps[r] == 0). On
        success each row gains its feed; on failure no row changes."""
        live = [r for r, feed in enumerate(feeds) if feed]
        self._reach(max(live, default=0))
        chunks = [r for r in live if not keeps[r]]  # prompt chunks: decoded on their own either way, so timed apart
        rest = [r for r in live if keeps[r]]
        out: list[torch.Tensor | None] = [None] * len(feeds)
        starts = {r: len(self.rows[r]) for r in chunks}
        began = time.perf_counter()
        if chunks:
            self.context.forward_rows([self.rows[r] for r in chunks], [feeds[r] for r in chunks], [0] * len(chunks))
        seconds = (time.perf_counter() - began) / max(1, sum(len(feeds[r]) for r in chunks))
        try:
            if rest:
                logits = self.context.forward_rows([self.rows[r] for r in rest], [feeds[r] for r in rest],
                                                   [keeps[r] for r in rest])
                for r, rows in zip(rest, logits, strict=True):
                    out[r] = rows
        except BaseException:
            for r, start in starts.items():
                self.rows[r].crop(start)
            raise
        for r in chunks:
            self._rates[r] = (len(self.rows[r]), seconds)
            self._cheapest = seconds if self._cheapest is None else min(self._cheapest, seconds)
        return out

    def rewind(self, width: int) -> None:
        """Nothing to cut: rows cropped one by one have freed their own cells."""

    def compact(self) -> None:
        """Nothing to gather: rows hold only their own cells."""

    def maybe_compact(self) -> None:
        """See :meth:`compact`."""


def row_cells(row_context: int) -> int:
    """The KV cells a batch row of ``row_context`` tokens takes: rounded up to :data:`ROW_ALIGN`."""
    return -(-int(row_context) // ROW_ALIGN) * ROW_ALIGN


def check_fits(lm, size: int, row_context: int) -> None:
    """ConfigError where ``size`` rows of ``row_context`` tokens need more KV cache than the memory
    available now (:func:`specgen.machine.available_memory`; not checked where that is unknown)."""
    need = size * row_context * lm.kv_bytes_per_token
    free = available_memory()
    if free is not None and need > free:
        raise ConfigError(f"a batch of {size} rows of {row_context} tokens needs {format_bytes(need)} of KV cache "
                          f"when full ({format_bytes(row_context * lm.kv_bytes_per_token)} a row) but "
                          f"{format_bytes(free)} is available; lower batch_size or llama_cpp.batch_row_context")


def batch_gap(lm, rows: int = 4) -> float:
    """Batch invariance across rows: the largest |logit| difference between ``rows`` rows of a
    :class:`LlamaBatch` (prefixes of different lengths fed with ragged feeds of 1..4 tokens in
    one step) and the same tokens fed to one handle of ``lm``'s own context, the prefix and then
    one token at a time; the prefix's last row included. 0.0: batched rows see a request's own logits."""
    vocab = lm.vocab_size
    prefixes = [[(7919 * i + 104729 * r + 11) % vocab for i in range(5 + 4 * r)] for r in range(rows)]
    feeds = [[(31 * i + 17 * r + 3) % vocab for i in range(1 + r % 4)] for r in range(rows)]
    batch = LlamaBatch(lm, rows, ROW_ALIGN)
    together = batch.forward([[*prefix, *feed] for prefix, feed in zip(prefixes, feeds, strict=True)],
                             [1 + len(f) for f in feeds])  # as a fresh row is fed: its prompt with its first step
    worst = 0.0
    alone_cache = lm.new_cache()
    for r, (prefix, feed) in enumerate(zip(prefixes, feeds, strict=True)):
        alone_cache.crop(0)
        first = lm.forward(alone_cache, prefix, keep=1)  # as a request is fed: its prompt, then one token a step
        alone = torch.cat([first, *(lm.forward(alone_cache, [t], keep=1) for t in feed)])  # [1 + len(feed), vocab]
        worst = max(worst, float((together[r] - alone).abs().max()))
    batch.context.close()
    return worst


def split_gap(lm, decoded: int = 4) -> float:
    """Prefill splits: the largest |logit| difference between a prompt fed to one handle of ``lm``'s own
    context as a request's is (one forward, split where the backend splits prompts) and the same prompt
    fed to a :class:`LlamaBatch` row in chunks of the SPLIT_PROBE widths (no logits read), then its last
    token with its logits; over that row and ``decoded`` tokens fed one at a time after it on each.
    0.0: how a prompt's decodes are split changes no logit (and no KV entry a later position reads)."""
    vocab = lm.vocab_size
    tokens = [(7919 * i + 104729 + 13) % vocab for i in range(sum(SPLIT_PROBE) + 1 + decoded)]
    prompt, after = tokens[: sum(SPLIT_PROBE) + 1], tokens[sum(SPLIT_PROBE) + 1:]
    alone_cache = lm.new_cache()
    try:
        alone = torch.cat([lm.forward(alone_cache, prompt, keep=1),
                           *(lm.forward(alone_cache, [t], keep=1) for t in after)])  # [1 + decoded, vocab]
    finally:
        alone_cache.release()
    batch = LlamaBatch(lm, 1, ROW_ALIGN)
    try:
        fed = 0
        for width in SPLIT_PROBE:
            batch.forward([prompt[fed: fed + width]], [0])
            fed += width
        split = torch.cat([batch.forward([prompt[fed:]], [1])[0],
                           *(batch.forward([[t]], [1])[0] for t in after)])  # [1 + decoded, vocab]
    finally:
        batch.context.close()
    return float((split - alone).abs().max())
