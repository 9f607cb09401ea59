"""Measure a target's cost tables: timed verify forwards and drafter proposals.

The planner needs what a round costs *here*: on this model, dtype, device and
thread count. Measurement sees the model only through the target protocol
(:class:`specgen.models.target.Target`: ``new_cache``, ``forward``,
``forward_tree``) and what the caller hands in with the :class:`Subject`: a
callable that opens a draft session on the calibration context, and for the
batched table a factory of batched caches (:class:`specgen.models.target.BatchCache`).

:func:`measure` times, after an untimed prefill of a fixed synthetic context,

* ``chain[n - 1]``: a target forward of n new tokens (n = 1 .. max_tokens);
* ``tree[n - 1]``: a tree forward over 1 chain token + n - 1 nodes shaped as
  :func:`tree_shape` (branching: a target may compute a chain-shaped tree as a
  chain, more cheaply than the trees a drafter verifies), plus the LM head of its
  root row; only for drafters that verify trees or read target features (empty
  otherwise: ``verify(n, tree=True)`` then prices the chain);
* the drafter's proposal of 1 and of ``max_tokens`` tokens, which gives
  ``draft_fixed`` and ``draft_per_token``;
* with a draft model, its forward of :data:`CATCH_UP_TOKENS` new tokens (one logits
  row), which gives ``draft_catch_up`` per token;

all over ``step_s``, each the minimum of ``repeats`` interleaved rounds after a
warm-up round (noise only adds time). ``step_s`` is the fastest 1-token forward
of the blocks of :data:`STEADY_FORWARDS` run back to back before each round of the
sweep (plain decoding's pace: on a CPU a wide forward can slow the forwards right
after it, so the sweep's own 1-token forwards, each after a 17-token one, would
inflate the unit and flatten every v(n); a block before every round, not one before
the sweep, keeps a slow spell at the start from setting the unit), bounded by the
fastest forward of any size (no forward costs less). Every n is measured and the
tables are kept as measured, not made non-decreasing: where a longer forward is
cheaper (matrix kernels work on blocks of rows) the planner sees it.

:func:`measure_batch` times batched forwards of at most :data:`MAX_MEASURED_ROWS`
rows and reads every cell from one fit (:func:`specgen.planning.fit.fit_forwards`),
which is linear in rows: bigger batches read the table's linear continuation, so
the measurement's time and memory are bounded whatever the batch size.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from specgen.models.invariance import probe_tokens
from specgen.models.target import BatchCache, Target
from specgen.planning.costs import BatchCostTable, CostTable
from specgen.planning.fit import fit_forwards
from specgen.sampling import ancestor_matrix, tree_depths
from specgen.stats import Clock

#: The most verified tokens measured (every count from 1 up is measured).
MAX_TOKENS = 17
CONTEXT_TOKENS = 192
#: Committed tokens a draft model's catch-up is timed on (a probe follows at least this many plain steps).
CATCH_UP_TOKENS = 8
#: Batch sizes and feed widths the batched table measures (up to its rows); the rest interpolated.
BATCH_SIZES = (1, 2, 4, 8)
BATCH_WIDTHS = (1, 2, 3, 5, 9)
BATCH_CONTEXT_TOKENS = 96
#: The widths the wide cache is timed at (with the largest measured width): its own fit prices the rest.
WIDE_WIDTHS = (1, 3)
#: The most rows a batched measurement uses. Its wide cache holds every row's context side by
#: side, so its memory grows with the square of the rows; the fit prices bigger batches.
MAX_MEASURED_ROWS = 8
#: Part of a batched table's cache key: how it was measured (bumped when that changes).
BATCH_METHOD = 6
#: Part of every table's cache key: how a table is measured (its unit is a steady 1-token forward
#: from blocks spread over the sweep, bounded by the fastest forward of any size; a draft model's
#: catch-up is timed).
UNIT_METHOD = 5
#: 1-token forwards run back to back before each round of the sweep; the fastest of all sets the unit.
STEADY_FORWARDS = 8
#: Part of a tree table's cache key: the shape its tree forwards are timed on (:func:`tree_shape`).
TREE_SHAPE = "binary"


def tree_shape(nodes: int) -> list[int]:
    """Parents of the tree a tree table times at ``nodes`` nodes: two children under the root and
    under every node, level by level (node j's parent is j // 2 - 1, ``-1`` the root), so each
    prefix is a tree and it branches from two nodes on, as the best-first trees a drafter's rounds
    keep do; a target whose tree forward costs more per branch (one attention pass per
    root-to-leaf path) is priced for that."""
    return [j // 2 - 1 for j in range(nodes)]

#: Progress reports: called with one short line while a table is measured.
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Subject:
    """What a cost table is measured on.

    target: the verifying model (the target protocol).
    vocab_size: the tokenizer's, for the synthetic calibration context.
    config: the pipeline's checked run config (:attr:`specgen.config.run.RunConfig.checked`; its
    target, drafter, compile, packed_weights and invariant_verify entries are part of :func:`facts`).
    trees: the drafter verifies trees or reads target features (time tree forwards).
    feature_layers: the target features the drafter reads (None: none).
    open_draft: (context, max_tokens) -> a draft session on ``context`` ready to
    propose (``mark``/``propose``/``rollback``), or None without a drafter.
    draft_model: the drafter's own model (the target protocol), or None.
    """

    target: Target
    vocab_size: int
    config: Mapping
    trees: bool = False
    feature_layers: list[int] | None = None
    open_draft: Callable[[list[int], int], object] | None = None
    draft_model: Target | None = None


def facts(subject: Subject, max_tokens: int = MAX_TOKENS) -> dict:
    """What the measured costs depend on: models, drafter, dtype, device, threads, versions."""
    config, device = subject.config, subject.target.device
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = platform.processor() or platform.machine()
    return {
        "target": json.dumps(config["target"], sort_keys=True, default=str),
        "drafter": json.dumps(config["drafter"], sort_keys=True, default=str),
        **subject.target.describe(),
        "device": str(device), "hardware": hardware, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "context": CONTEXT_TOKENS, "max_tokens": max_tokens,
        "compile": config["compile"], "packed_weights": config["packed_weights"],
        "invariant_verify": config["invariant_verify"],
        "unit": UNIT_METHOD, **({"tree_shape": TREE_SHAPE} if subject.trees else {}),
    }


def batch_facts(subject: Subject, rows: int) -> dict:
    """:func:`facts` of a batched table measured with ``rows`` rows."""
    return dict(facts(subject), batch_size=rows, max_width=BATCH_WIDTHS[-1], method=BATCH_METHOD)


def calibration_context(subject: Subject, max_tokens: int) -> list[int]:
    """The fixed synthetic context every measurement runs on."""
    vocab = subject.vocab_size
    length = max(2, min(CONTEXT_TOKENS, subject.target.context_length - max_tokens - 2))
    return probe_tokens(vocab, length)


def measure(subject: Subject, *, clock: Callable[[], float] | None = None, repeats: int = 2,
            max_tokens: int = MAX_TOKENS) -> CostTable:
    """Time the subject's verify passes and drafter (see the module docstring)."""
    lm = subject.target
    clock = clock or Clock(lm.device)
    context = calibration_context(subject, max_tokens)
    cache = lm.new_cache()
    lm.forward(cache, context[:-1], keep=1)
    base = len(cache)
    sizes = range(1, max(1, max_tokens) + 1)
    chain: dict[int, list[float]] = {n: [] for n in sizes}
    tree: dict[int, list[float]] = {n: [] for n in sizes} if subject.trees else {}
    draft = _DraftTimer(subject, context, max_tokens, clock)
    catch_up = _CatchUpTimer(subject.draft_model, context, clock)
    steady = []  # 1-token forwards run back to back: plain decoding's own pace
    for _ in range(repeats + 1):
        for _ in range(STEADY_FORWARDS):
            start = clock()
            lm.forward(cache, context[-1:], keep=1)
            steady.append(clock() - start)
            cache.crop(base)
        for n in sizes:
            feed = [context[-1]] + context[: n - 1]
            start = clock()
            lm.forward(cache, feed, keep=n)
            chain[n].append(clock() - start)
            cache.crop(base)
            if tree:
                parents = tree_shape(n - 1)
                start = clock()
                out = lm.forward_tree(cache, [context[-1]], context[: n - 1], ancestor_matrix(parents),
                                      tree_depths(parents), subject.feature_layers)
                out.logits(0)
                tree[n].append(clock() - start)
                cache.crop(base)
        draft.time()
        catch_up.time()
    fastest = min(min(times[1:]) for times in chain.values())
    step = min(min(steady), fastest) or 1e-9  # no forward costs less than a 1-token one
    fixed, per_token = draft.result()
    return CostTable(chain=tuple(1.0 if n == 1 else min(chain[n][1:]) / step for n in sizes),
                     tree=tuple(min(times[1:]) / step for times in tree.values()),
                     draft_fixed=fixed / step, draft_per_token=per_token / step, step_s=step,
                     draft_catch_up=catch_up.per_token() / step, facts=facts(subject, max_tokens))


class _CatchUpTimer:
    """Times a draft model's forward of CATCH_UP_TOKENS committed tokens after the calibration context."""

    def __init__(self, model: Target | None, context: list[int], clock):
        self.model, self.clock, self.times = model, clock, []
        if model is not None:
            self.tokens = context[-CATCH_UP_TOKENS:]
            self.cache = model.new_cache()
            model.forward(self.cache, context[:-CATCH_UP_TOKENS], keep=1)
            self.base = len(self.cache)

    def time(self) -> None:
        if self.model is None:
            return
        start = self.clock()
        self.model.forward(self.cache, self.tokens, keep=1)
        self.times.append(self.clock() - start)
        self.cache.crop(self.base)

    def per_token(self) -> float:
        """Seconds per caught-up token (the fastest timing after the first); 0 without a draft model."""
        return min(self.times[1:]) / CATCH_UP_TOKENS if self.times else 0.0


class _DraftTimer:
    """Times the drafter's proposals of 1 and ``max_tokens`` tokens on the calibration context."""

    def __init__(self, subject: Subject, context: list[int], max_tokens: int, clock):
        self.clock, self.max_tokens = clock, max_tokens
        self.times: dict[int, list[tuple[float, int]]] = {1: [], max_tokens: []}
        self.session = None if subject.open_draft is None else subject.open_draft(context, max_tokens)

    def time(self) -> None:
        for budget in self.times:
            if self.session is None:
                self.times[budget].append((0.0, budget))
                continue
            mark = self.session.mark()
            start = self.clock()
            proposal = self.session.propose(budget)
            self.times[budget].append((self.clock() - start, len(proposal)))
            self.session.rollback(mark)

    def result(self) -> tuple[float, float]:
        """(fixed seconds per proposal, seconds per drafted token) from the fastest timings."""
        first = min(self.times[1][1:])
        last = min(self.times[self.max_tokens][1:])
        per_token = max(0.0, (last[0] - first[0]) / (last[1] - first[1])) if last[1] > first[1] else 0.0
        return max(0.0, first[0] - per_token * first[1]), per_token


def table_size(size: int) -> int:
    """The rows a table serving batches of ``size`` rows is measured with: 8, the first of
    BATCH_SIZES holding 8 rows, clamped to :data:`MAX_MEASURED_ROWS`. One table serves every
    batch size (a run's last, partly filled batch must not measure a table of its own mid-run)."""
    return min(next((b for b in BATCH_SIZES if b >= max(size, 8)), size), MAX_MEASURED_ROWS)


def batch_shape(size: int, max_width: int) -> tuple[list[int], list[int]]:
    """(rows, widths) a table of ``size`` rows and ``max_width`` tokens measures."""
    sizes = sorted({b for b in BATCH_SIZES if b < size} | {size})
    widths = sorted({w for w in BATCH_WIDTHS if w < max_width} | {max_width})
    return sizes, widths


def measure_batch(subject: Subject, size: int, new_batch: Callable[[int], BatchCache], *,
                  clock: Callable[[], float] | None = None, repeats: int = 2, max_width: int = BATCH_WIDTHS[-1],
                  progress: Progress | None = None) -> BatchCostTable:
    """Time batched verify forwards of b rows x w tokens, b in 1, 2, 4, .. ``size`` (clamped to
    :data:`MAX_MEASURED_ROWS`), w in BATCH_WIDTHS up to ``max_width``; -> their table.

    Each row runs on its own prefilled copy of a short calibration context in one
    ``new_batch(rows)`` cache, one logits row per row; at the largest shape also every
    row's w logits rows (which gives ``head``). All of it twice: on the compacted cache
    (the shared tensors one context wide: ``body``), and as the prefills leave it (every
    row's slots side by side: ``wide``), since a forward's attention and cache append grow
    with the shared width (the wide cache timed at :data:`WIDE_WIDTHS` and the largest width
    only). On the compacted cache also the ragged forwards (one row w
    tokens, the others 1: ``ragged``). Each shape is timed ``repeats`` times after one
    untimed forward of its own; sizes run largest first (a smaller batch drops rows). The
    cells are :func:`specgen.planning.fit.fit_forwards` over each shape's fastest timing:
    one fit for the compacted cache (uniform and ragged forwards together), one for the
    wide cache (never below the compacted one). Units: the fitted 1-row 1-token forward on
    the compacted cache. ``progress``: told which pass runs.
    """
    lm = subject.target
    clock = clock or Clock(lm.device)
    sizes, widths = batch_shape(min(size, MAX_MEASURED_ROWS), max_width)
    context = calibration_context(subject, max_width)[:BATCH_CONTEXT_TOKENS]
    feed = [context[-1]] + context[: max_width - 1]
    timer = _BatchTimer(new_batch, sizes, context, feed, max(1, repeats), clock)
    kv = new_batch(sizes[-1])
    wide = None
    if kv.shares_width:
        if progress:
            progress(f"{sizes[-1]} rows, wide cache")
        wide, _, _, wide_slots = timer.run(False, sorted({w for w in WIDE_WIDTHS if w < widths[-1]} | {widths[-1]}), kv)
        kv = None
    if progress:
        progress(f"{sizes[-1]} rows" + (", compacted cache" if wide else ""))
    narrow, full, ragged, narrow_slots = timer.run(True, widths, kv)
    fastest = {key: min(times) for key, times in narrow.items()}
    fit = fit_forwards([(b, w, b * w, t) for (b, w), t in fastest.items()]
                       + [(b, w, b - 1 + w, min(t)) for (b, w), t in ragged.items()])
    if wide is None:  # every row keeps its own cells: the cache as prefilled is the compacted one
        wide, wide_slots = narrow, narrow_slots
    fit_wide = fit_forwards([(b, w, b * w, min(t)) for (b, w), t in wide.items()])
    step = fit(1, 1, 1) or 1e-9
    body = tuple(tuple(fit(b, w, b * w) / step for w in widths) for b in sizes)
    extra = sizes[-1] * (widths[-1] - 1)
    head = max(0.0, (min(full) - fastest[(sizes[-1], widths[-1])]) / step / extra) if extra else 0.0
    return BatchCostTable(tuple(sizes), tuple(widths), body, head, step, batch_facts(subject, sizes[-1]),
                          wide=tuple(tuple(max(fit_wide(b, w, b * w) / step, cell) for w, cell in zip(widths, line))
                                     for b, line in zip(sizes, body)),
                          slots=(narrow_slots, wide_slots),
                          ragged=tuple(tuple(fit(b, w, b - 1 + w) / step for w in widths) for b in sizes))


@dataclass
class _BatchTimer:
    """Times the forwards of :func:`measure_batch` on a fresh batched cache of sizes[-1] prefilled rows."""

    new_batch: Callable[[int], BatchCache]
    sizes: list[int]
    context: list[int]
    feed: list[int]
    repeats: int
    clock: Callable[[], float]

    def run(self, compacted: bool, widths: list[int], kv: BatchCache | None = None):
        """At ``widths`` -> ({(b, w): seconds of each timed forward}, full-logits timings, {(b, w): seconds of the
        ragged forward (one row w tokens, the rest 1)}, shared slots), on the cache compacted or as
        the prefills leave it. Full-logits and ragged forwards run on the compacted cache only
        (ragged: where w > 1 and b > 1, the only shapes where the two differ). ``kv``: a fresh
        cache of sizes[-1] rows to use (None: a new one)."""
        rows = self.sizes[-1]
        kv = kv or self.new_batch(rows)
        for r in range(rows):
            kv.prefill(r, self.context[:-1], reuse=False)  # side by side: the wide cache of a batch with one long row
        if compacted:
            kv.compact()
        start = (len(kv.rows[0]), kv.width)  # what every timed forward is undone to
        times: dict[tuple[int, int], list[float]] = {}
        ragged: dict[tuple[int, int], list[float]] = {}
        full: list[float] = []
        for b in reversed(self.sizes):
            for w in widths:  # warm-up (for a smaller b it also drops the other rows)
                self._timed(kv, start, b, w, 1)
                if compacted and b > 1 and w > 1:
                    self._timed(kv, start, b, w, 1, ragged=True)
            for _ in range(self.repeats):
                for w in widths:
                    times.setdefault((b, w), []).append(self._timed(kv, start, b, w, 1))
                    if compacted and b > 1 and w > 1:
                        ragged.setdefault((b, w), []).append(self._timed(kv, start, b, w, 1, ragged=True))
                if compacted and b == rows and widths[-1] > 1:
                    full.append(self._timed(kv, start, b, widths[-1], widths[-1]))
        return times, full, ragged, start[1]

    def _timed(self, kv: BatchCache, start: tuple[int, int], b: int, w: int, keep: int, ragged: bool = False
               ) -> float:
        """One forward of b rows (w tokens each, or w for row 0 and 1 for the rest), undone after
        (rows cropped to ``start[0]`` tokens, the shared tensors cut to ``start[1]`` slots)."""
        rows, (base, width0) = self.sizes[-1], start
        feeds = [self.feed[:w]] + [self.feed[:1 if ragged else w]] * (b - 1) + [[]] * (rows - b)
        began = self.clock()
        kv.forward(feeds, [keep] * b + [0] * (rows - b))
        spent = self.clock() - began
        for r in range(b):
            kv.rows[r].crop(base)
        kv.rewind(width0)
        return spent
