"""The torch backend's :class:`~specgen.models.target.BatchCache`: one DynamicCache of batch B shared
by row views (:meth:`specgen.models.causal_lm.CausalLM.new_batch`; how :mod:`specgen.batch` uses it).

Each forward appends the same number w of slots to every row (w = the widest feed; a shorter
row's extra slots hold zeros nobody attends to); the rows' tokens are fed flat, unpadded
(:meth:`BatchKV.forward`). A fresh
row's prompt is prefilled in a forward of its own and stored in its batch entry's dead slots (a
refill takes over the finished row's), appending only what does not fit. A row lists the slots
holding its tokens (:attr:`RowCache.slots`); the 4D additive mask lets each new token see its row's
listed slots and its own feed causally; positions are per row (token i of a row sits at position
i). Rolling a row back drops slots from its list (nothing is copied). :meth:`BatchKV.compact`
gathers each row's slots left-aligned into fresh tensors when dead slots pile up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specgen.errors import ConfigError
from specgen.models.growing_cache import growing_cache
from specgen.models.target import TokenCache

#: Compact once the shared cache is this many slots, plus COMPACT_SHARE of the longest row, wider
#: than the longest row. Every batched step attends over every shared slot of every row, dead
#: ones included, so dead slots cost each step what live ones do; a compaction costs about two
#: copies of the live cache, a few steps' worth of reading the dead ones back.
COMPACT_SLACK = 16
COMPACT_SHARE = 1 / 8


@dataclass
class RowCache(TokenCache):
    """One row of a :class:`BatchKV` behind the single-request KVCache interface.

    tokens: this row's cached ids; slots: the shared cache's slot of each, in order
    (len(slots) == len(tokens); increasing: new tokens only ever get slots past the row's
    last one). ``cache`` is the owning BatchKV.
    """

    cache: BatchKV
    tokens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)

    def crop(self, length: int) -> None:
        del self.tokens[length:]
        del self.slots[length:]

    def keep_rows(self, prefix: int, rows: list[int]) -> None:
        raise ConfigError("tree drafters are not batched yet; use generate() per prompt")


class BatchKV:
    """A batch-``size`` DynamicCache shared by ``size`` row views (:attr:`rows`) of the torch target
    ``lm`` (its ``config``, ``new_cache``, ``forward`` and ``forward_batch``), a
    :class:`~specgen.models.target.BatchCache`."""

    #: Rows share the cache's width: a forward spans every row's slots up to the widest.
    shares_width = True
    #: A fresh row's prompt goes in a forward of its own (:meth:`prefill`) before its first step.
    prefills_apart = True
    #: Prompts are not chunked across steps (:func:`specgen.batch.steps.prefill_chunks`): a chunked
    #: prefill here would compute its keys/values in other shapes than a solo run's one forward.
    prefill_chunk = None

    def prefill_take(self, r: int, length: int) -> int:
        """Not called: prompts are not chunked across steps here (:attr:`prefill_chunk` is None)."""
        raise NotImplementedError("prompts are not chunked on this batch cache")

    def __init__(self, lm, size: int):
        self.lm = lm
        self.cache = growing_cache(lm.config)  # appends in place: no copy of the whole cache per step
        self.width = 0  # slots per row in the shared tensors
        self.rows = [RowCache(self) for _ in range(size)]
        self.live: list[int] = []  # the rows the shared tensors hold, in order (their batch dimension)

    @property
    def row_context(self) -> int:
        """The most tokens a row may hold: the model's context."""
        return self.lm.context_length

    def _hold(self, wanted: list[int]) -> None:
        """Make the shared tensors' batch dimension hold exactly the rows ``wanted`` (increasing),
        so idle rows cost no compute. A row that leaves is forgotten (its view emptied: only
        rows with nothing to feed leave); a row that joins has no slots yet, so whatever its
        new batch entry holds is never attended to. Copies happen only when the set changes."""
        if wanted == self.live:
            return
        position = {r: i for i, r in enumerate(self.live)}
        for r in self.live:
            if r not in wanted:
                self.rows[r].crop(0)
        source = [position.get(r, 0) for r in wanted]
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.dim() != 4 or not self.live:
                continue
            index = torch.tensor(source, dtype=torch.long, device=keys.device)  # [B']
            layer.keys = keys.index_select(0, index)  # [B', heads, S, head_dim]
            layer.values = layer.values.index_select(0, index)
        self.live = list(wanted)

    def prefill(self, r: int, tokens: list[int], reuse: bool = True) -> bool:
        """Feed a fresh row's ``tokens`` (its prompt but the last token) in a forward of its
        own and store their keys/values in the row's batch entry: first in the slots the
        shared tensors already have (all dead for a row without slots, e.g. a finished
        row's, so a refill costs no width), then, for the rest, in new slots appended for
        every row (dead zeros for the others; in place where the layers grow in place,
        :class:`~specgen.models.growing_cache.GrowingLayer`). Batched steps never pad the
        other rows to a prompt's length. reuse=False appends every token (the cost model's
        wide cache). -> False, doing nothing, when the row already has slots or the cache's
        layers are not plain 4D key/value tensors."""
        row = self.rows[r]
        layers = self.cache.layers
        if row.slots or not tokens or not all(hasattr(layer, "lazy_initialization") for layer in layers):
            return False
        if any(layer.is_initialized and (layer.keys is None or layer.keys.dim() != 4) for layer in layers):
            return False
        self._hold(sorted({*self.live, r}))
        own = self.lm.new_cache()
        self.lm.forward(own, tokens, keep=1, check=False)  # its keys/values; the logits are not used
        j, width, n = self.live.index(r), self.width, len(tokens)
        reused = min(n, width) if reuse else 0
        with torch.inference_mode():  # the buffers are inference tensors (made by forwards)
            self._store_row(j, reused, width, own.cache.layers)
        self.width = width + n - reused
        row.tokens.extend(tokens)
        row.slots.extend(range(reused))
        row.slots.extend(range(width, self.width))
        return True

    def _store_row(self, j: int, reused: int, width: int, own: list) -> None:
        """Store one row's keys/values (``own``: its layers, [1, heads, n, head_dim] each) in batch
        entry ``j``: the first ``reused`` in slots 0.. (dead ones), the rest in n - reused new
        slots appended after ``width`` for every row (live in entry j only)."""
        for layer, mine in zip(self.cache.layers, own, strict=True):
            n = mine.keys.shape[-2]
            if not layer.is_initialized:
                layer.lazy_initialization(mine.keys, mine.values)
                empty = mine.keys.new_zeros(len(self.live), mine.keys.shape[1], width, mine.keys.shape[3])
                layer.keys, layer.values = empty, empty.clone()  # [B', heads, S, head_dim], S = self.width
            layer.keys[j, :, :reused] = mine.keys[0, :, :reused]  # [heads, reused, head_dim]
            layer.values[j, :, :reused] = mine.values[0, :, :reused]
            if n > reused:
                dead = layer.keys.new_zeros(*layer.keys.shape[:2], n - reused, layer.keys.shape[3])
                layer.update(dead, dead)  # [B', heads, S + n - reused, head_dim]
                layer.keys[j, :, width:] = mine.keys[0, :, reused:]
                layer.values[j, :, width:] = mine.values[0, :, reused:]

    def clear_row(self, row: int) -> RowCache:
        """Forget row ``row``'s tokens (a refill); its old slots become dead."""
        self.rows[row].crop(0)
        return self.rows[row]

    def forward(self, feeds: list[list[int]], keeps: list[int]) -> list[torch.Tensor | None]:
        """One forward over every row's feed (empty: the row idles); -> per row its last
        ``keeps[r]`` raw logit rows [keeps[r], vocab] (None where keeps[r] == 0).
        On success each row's cache view gains its feed; on failure nothing changes.
        The held rows' feeds go flat (:meth:`~specgen.models.causal_lm.CausalLM.forward_batch`):
        every row gains w = the longest feed's slots, a shorter row's extra ones dead."""
        self._hold([r for r, feed in enumerate(feeds) if feed])
        if not self.live:
            return [None] * len(feeds)
        lengths, start = [len(feeds[r]) for r in self.live], self.width
        w = max(lengths)
        allowed = torch.zeros(len(self.live), w, start + w, dtype=torch.bool)  # [B', w, S + w]
        causal = torch.ones(w, w, dtype=torch.bool).tril()  # [w, w]
        ids: list[int] = []
        positions: list[int] = []
        picks: list[int] = []
        limit = self.lm.context_length - 1
        for j, r in enumerate(self.live):  # batch entry j holds row r
            row, feed, keep = self.rows[r], feeds[r], keeps[r]
            n = len(feed)
            if row.slots:
                allowed[j, :n, torch.tensor(row.slots)] = True
            allowed[j, :n, start : start + n] = causal[:n, :n]
            picks.extend(range(len(ids) + n - keep, len(ids) + n))
            ids.extend(feed)
            positions.extend(min(p, limit) for p in range(len(row), len(row) + n))
        logits = self.lm.forward_batch(self.cache, torch.tensor(ids, dtype=torch.long),  # [T]
                                       torch.tensor(positions, dtype=torch.long), allowed, lengths,  # [T]
                                       torch.tensor(picks, dtype=torch.long))  # [K, vocab]
        self.width = start + w
        out: list[torch.Tensor | None] = []
        used = 0
        for row, feed, keep in zip(self.rows, feeds, keeps, strict=True):
            row.tokens.extend(feed)
            row.slots.extend(range(start, start + len(feed)))
            out.append(logits[used : used + keep] if keep else None)
            used += keep
        return out

    def rewind(self, width: int) -> None:
        """Cut the shared tensors back to ``width`` slots (no row may list a slot past it):
        undoes forwards whose rows were cropped, e.g. a timed forward of the cost model."""
        if any(row.slots and row.slots[-1] >= width for row in self.rows):  # slots increase along a row
            raise ValueError("a row still lists a slot past the cut")
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
                layer.keys = layer.keys[..., :width, :]  # [B, heads, width, head_dim], a prefix view: appends go on in place
                layer.values = layer.values[..., :width, :]
        self.width = min(self.width, width)

    def trim(self) -> None:
        """Cut the shared tensors back past the last slot any row lists (free: prefix views;
        the slots a step's rejected drafts and padding left at the end are written over)."""
        end = max((row.slots[-1] + 1 for row in self.rows if row.slots), default=0)
        if end < self.width:
            self.rewind(end)

    def maybe_compact(self) -> None:
        """Trim; then compact when the shared cache is more than COMPACT_SLACK slots plus
        COMPACT_SHARE of the longest row wider than the longest row."""
        self.trim()
        longest = max((len(self.rows[r]) for r in self.live), default=0)
        if self.width > longest + max(COMPACT_SLACK, int(longest * COMPACT_SHARE)):
            self.compact()

    def compact(self) -> None:
        """Gather each held row's slots, left-aligned, into fresh tensors (width = the longest row)."""
        longest = max((len(self.rows[r]) for r in self.live), default=0)
        index = torch.zeros(len(self.live), longest, dtype=torch.long)  # [B', L]; pads point at slot 0, never seen
        for j, r in enumerate(self.live):
            row = self.rows[r]
            index[j, : len(row)] = torch.tensor(row.slots, dtype=torch.long)
            row.slots = list(range(len(row)))
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.dim() != 4:
                continue
            where = index.to(keys.device)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
            layer.keys = keys.gather(2, where)  # [B, heads, L, head_dim]
            layer.values = layer.values.gather(2, where)
        self.width = longest
