"""Measure a pipeline's cost table (v(n), drafting cost) and cache it on disk.

The planner needs what a round costs *here*: on this model, dtype, device and
thread count. :func:`measure` times, after an untimed prefill of a fixed
synthetic context,

* ``chain[n - 1]``: a target forward of n new tokens (n = 1 .. max_tokens);
* ``tree[n - 1]``: a tree forward over 1 chain token + n - 1 nodes, plus the
  LM head of its root row (the verify pass of a draft tree); only for drafters
  that verify trees or read target features (empty otherwise: ``verify(n, tree=True)``
  then prices the chain);
* the drafter's proposal of 1 and of ``max_tokens`` tokens, which gives
  ``draft_fixed`` and ``draft_per_token``;

all over ``step_s`` (the 1-token forward, bounded by the fastest forward of any
size: no forward costs less), each the minimum of ``repeats`` interleaved rounds
after a warm-up round (noise only adds time). Every n is
measured and the tables are kept as measured, NOT made non-decreasing: on a CPU
a forward of 4 tokens can cost less than one of 3 (matrix kernels work on blocks
of rows; SmolLM2-135M float32 on this project's CPU: v(3) = 1.6, v(4) = 1.36,
v(8) = 1.58), and the planner should see that a longer draft is cheaper there.
It takes a few seconds on a 135M model on one CPU thread. :func:`cost_table` serves it from ``<cache_root>/costs/<key>.json``,
keyed by :func:`facts`; ``refresh=True`` measures again. With
``$SPECGEN_COST_TABLE`` naming a JSON file in the cache's format (see
:func:`to_dict`), every pipeline plans with that fixed table instead: nothing
is measured or cached (reproducible plans, e.g. for tests that run the CLI).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import time
from collections.abc import Callable

import torch

from specgen.batch_planner import BatchCostTable
from specgen.costfit import fit_forwards
from specgen.errors import ConfigError
from specgen.planner import CostTable
from specgen.sampling import ancestor_matrix, tree_depths

#: The most verified tokens measured (every count from 1 up is measured).
MAX_TOKENS = 17
CONTEXT_TOKENS = 192
#: Batch sizes and feed widths the batched table measures (up to the batch's size); the rest interpolated.
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
BATCH_WIDTHS = (1, 2, 3, 5, 9)
BATCH_CONTEXT_TOKENS = 96
#: Part of a batched table's cache key: 5 = ragged forwards timed with attention cut to each
#: row's real queries (specgen.models.attention.row_lengths). 4 = cells read from a least-squares
#: fit of the timings (specgen.costfit), not each shape's fastest timing. 3 = measured on a compacted and on a wide
#: cache, and ragged (one row wide, the others one token: linear layers skip padding). Method 2 had no ragged table;
#: method 1 measured only with every row's prefill slots side by side, 8 contexts wide, and
#: priced every batch as if one of its rows were that long.
BATCH_METHOD = 5
#: Part of every table's cache key: 2 = the unit is the fastest forward of any size (1: the fastest
#: 1-token forward, which a busy machine could read above longer ones).
UNIT_METHOD = 2
#: Names a JSON cost table that replaces measurement for every pipeline (unset or empty: measure).
FIXED_TABLE_ENV = "SPECGEN_COST_TABLE"
_MEMO: dict[str, CostTable | BatchCostTable] = {}


def facts(pipe, max_tokens: int = MAX_TOKENS) -> dict:
    """What the measured costs depend on: models, drafter, dtype, device, threads, versions."""
    config = pipe.config or {}
    device = pipe.device
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = platform.processor() or platform.machine()
    return {
        "target": json.dumps(config.get("target"), sort_keys=True, default=str),
        "drafter": json.dumps(config.get("drafter"), sort_keys=True, default=str),
        **pipe.target.describe(),
        "device": str(device), "hardware": hardware, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "context": CONTEXT_TOKENS, "max_tokens": max_tokens,
        "compile": bool(config.get("compile", False)), "packed_weights": bool(config.get("packed_weights", True)),
        "unit": UNIT_METHOD,
    }


def cache_key(fact: dict) -> str:
    return hashlib.sha256(json.dumps(fact, sort_keys=True).encode()).hexdigest()[:20]


def _context(pipe, max_tokens: int) -> list[int]:
    vocab = pipe.tokenizer.vocab_size
    length = max(2, min(CONTEXT_TOKENS, pipe.target.context_length - max_tokens - 2))
    return [(7919 * i + 11) % vocab for i in range(length)]


def measure(pipe, *, clock: Callable[[], float] | None = None, repeats: int = 2,
            max_tokens: int = MAX_TOKENS) -> CostTable:
    """Time this pipeline's verify passes and drafter (see the module docstring)."""
    from specgen.stats import Clock

    clock = clock or Clock(pipe.device)
    lm = pipe.target
    context = _context(pipe, max_tokens)
    cache = lm.new_cache()
    lm.forward(cache, context[:-1], keep=1)
    base = len(cache)
    sizes = range(1, max(1, max_tokens) + 1)
    drafter = pipe.drafter
    trees = drafter is not None and (drafter.tree_width > 1 or drafter.feature_layers is not None)
    chain: dict[int, list[float]] = {n: [] for n in sizes}
    tree: dict[int, list[float]] = {n: [] for n in sizes} if trees else {}  # chain drafters never verify a tree
    draft = _DraftTimer(pipe, context, max_tokens, clock)
    for _ in range(repeats + 1):
        for n in sizes:
            feed = [context[-1]] + context[: n - 1]
            start = clock()
            lm.forward(cache, feed, keep=n)
            chain[n].append(clock() - start)
            cache.crop(base)
            if not trees:
                continue
            parents = list(range(-1, n - 2))
            start = clock()
            out = lm.forward_tree(cache, [context[-1]], context[: n - 1], ancestor_matrix(parents),
                                  tree_depths(parents), drafter.feature_layers)
            out.logits(0)
            tree[n].append(clock() - start)
            cache.crop(base)
        draft.time()
    # The unit: no forward costs less than a 1-token one, so the fastest forward of any size bounds
    # it (a busy machine can read every 1-token timing high, which priced plain steps above
    # verifying 2-9 tokens: v(2..9) = 0.80-0.99 in one such table).
    step = min(min(times[1:]) for times in chain.values()) or 1e-9
    first, last = draft.result()
    per_token = max(0.0, (last[0] - first[0]) / (last[1] - first[1])) if last[1] > first[1] else 0.0
    fixed = max(0.0, first[0] - per_token * first[1])
    return CostTable(
        chain=tuple(1.0 if n == 1 else min(chain[n][1:]) / step for n in sizes), tree=tuple(min(times[1:]) / step for times in tree.values()),
        draft_fixed=fixed / step, draft_per_token=per_token / step, step_s=step, facts=facts(pipe, max_tokens))


class _DraftTimer:
    """Times the drafter's proposals of 1 and ``max_tokens`` tokens on the calibration context."""

    def __init__(self, pipe, context: list[int], max_tokens: int, clock):
        self.clock, self.max_tokens = clock, max_tokens
        self.times: dict[int, list[tuple[float, int]]] = {1: [], max_tokens: []}
        self.request = None
        if pipe.drafter is None:
            return
        from specgen.round import speculative_round

        self.request, ctx = pipe.open_request(context, max_new_tokens=max_tokens + 4, seed=0)
        if self.request.draft is not None:
            speculative_round(self.request, ctx, 1)  # prefills the draft model, hands learned heads a feature

    def time(self) -> None:
        session = None if self.request is None else self.request.draft
        for budget in self.times:
            if session is None:
                self.times[budget].append((0.0, budget))
                continue
            mark = session.mark()
            start = self.clock()
            proposal = session.propose(budget)
            self.times[budget].append((self.clock() - start, len(proposal)))
            session.rollback(mark)

    def result(self) -> tuple[tuple[float, int], tuple[float, int]]:
        """(seconds, tokens) of the fastest timed proposal of each size."""
        first = min(self.times[1][1:])
        last = min(self.times[self.max_tokens][1:])
        return first, last


def table_size(size: int) -> int:
    """The batch size a table is measured for: the first of BATCH_SIZES (from 8 up) holding
    ``size`` rows. A table serves every smaller batch, so batches of 1, 7 and 8 share one
    (a run's last, partly filled batch must not measure a table of its own mid-run)."""
    return next((b for b in BATCH_SIZES if b >= max(size, 8)), size)


def _batch_shape(size: int, max_width: int) -> tuple[list[int], list[int]]:
    sizes = sorted({b for b in BATCH_SIZES if b < size} | {size})
    widths = sorted({w for w in BATCH_WIDTHS if w < max_width} | {max_width})
    return sizes, widths


def measure_batch(pipe, size: int, *, clock: Callable[[], float] | None = None, repeats: int = 3,
                  max_width: int = BATCH_WIDTHS[-1]) -> BatchCostTable:
    """Time batched verify forwards (:meth:`specgen.batch.BatchKV.forward`, masks and all) of
    b rows x w tokens for b in 1, 2, 4, .. ``size`` and w in BATCH_WIDTHS up to ``max_width``,
    each row on its own prefilled copy of a short calibration context, one logits row per
    row; and, at the largest shape, every row's w logits rows (which gives ``head``). All of
    it twice: on the compacted cache (the shared tensors one context wide: ``body``), and as
    the prefills leave it (every row's slots side by side, ``size`` contexts wide: ``wide``),
    since a forward's attention and cache append grow with the shared width, which a batch
    with one long row has for every row. On the compacted cache also the ragged forwards (one
    row w tokens, the others 1: ``ragged``). Each shape is timed ``repeats`` times after one
    untimed forward of its own (a shape's first forward can cost several times the later
    ones); sizes run largest first (a smaller batch drops rows). The table's cells are not
    the timings themselves but :func:`specgen.costfit.fit_forwards` over each shape's
    fastest: one fit for the compacted cache (uniform and ragged forwards together), one for
    the wide cache (never below the compacted one), which irons out cells read high or low
    by a shared machine. Units: the fitted 1-row 1-token forward on the compacted cache.
    SmolLM2-135M float32 on this project's 2-core CPU (one thread): about 30 s for size 8."""
    from specgen.stats import Clock

    clock = clock or Clock(pipe.device)
    sizes, widths = _batch_shape(size, max_width)
    context = _context(pipe, max_width)[:BATCH_CONTEXT_TOKENS]
    feed = [context[-1]] + context[: max_width - 1]
    wide, _, _, wide_slots = _time_batches(pipe, sizes, widths, context, feed, False, repeats, clock)
    narrow, full, ragged, narrow_slots = _time_batches(pipe, sizes, widths, context, feed, True, repeats, clock)
    fastest = {key: min(times) for key, times in narrow.items()}
    fit = fit_forwards([(b, w, b * w, t) for (b, w), t in fastest.items()]
                       + [(b, w, b - 1 + w, min(t)) for (b, w), t in ragged.items()])
    fit_wide = fit_forwards([(b, w, b * w, min(t)) for (b, w), t in wide.items()])
    step = fit(1, 1, 1) or 1e-9
    body = tuple(tuple(fit(b, w, b * w) / step for w in widths) for b in sizes)
    extra = sizes[-1] * (widths[-1] - 1)
    head = max(0.0, (min(full) - fastest[(sizes[-1], widths[-1])]) / step / extra) if extra else 0.0
    return BatchCostTable(tuple(sizes), tuple(widths), body, head, step,
                          dict(facts(pipe), batch_size=size, max_width=max_width, method=BATCH_METHOD),
                          wide=tuple(tuple(max(fit_wide(b, w, b * w) / step, cell) for w, cell in zip(widths, line))
                                     for b, line in zip(sizes, body)),
                          slots=(narrow_slots, wide_slots),
                          ragged=tuple(tuple(fit(b, w, b - 1 + w) / step for w in widths)
                                       for b in sizes))


def _time_batches(pipe, sizes, widths, context, feed, compacted: bool, repeats: int, clock):
    """-> ({(b, w): seconds of each timed forward}, full-logits timings, {(b, w): seconds of the
    ragged forward (one row w tokens, the rest 1)}, shared slots) on a fresh batched cache of
    sizes[-1] prefilled rows, compacted or as the prefills leave it. The full-logits and
    ragged forwards run on the compacted cache only (ragged: where w > 1 and b > 1, the only
    shapes where the two differ)."""
    from specgen.batch.kv import BatchKV

    kv = BatchKV(pipe.target, sizes[-1])
    for r in range(sizes[-1]):
        kv.prefill(r, context[:-1], reuse=False)  # side by side: the wide cache of a batch with one long row
    if compacted:
        kv.compact()
    base, width0 = len(kv.rows[0]), kv.width

    def timed(b: int, w: int, keep: int, ragged: bool = False) -> float:
        feeds = [feed[:w]] + [feed[:1 if ragged else w]] * (b - 1) + [[]] * (sizes[-1] - b)
        start = clock()
        kv.forward(feeds, [keep] * b + [0] * (sizes[-1] - b))
        spent = clock() - start
        for r in range(b):
            kv.rows[r].crop(base)
        kv.rewind(width0)
        return spent

    times: dict[tuple[int, int], list[float]] = {}
    ragged: dict[tuple[int, int], list[float]] = {}
    full: list[float] = []
    for b in reversed(sizes):
        for w in widths:  # warm-up (for a smaller b it also drops the other rows)
            timed(b, w, 1)
            if compacted and b > 1 and w > 1:
                timed(b, w, 1, ragged=True)
        for _ in range(max(1, repeats)):
            for w in widths:
                times.setdefault((b, w), []).append(timed(b, w, 1))
                if compacted and b > 1 and w > 1:
                    ragged.setdefault((b, w), []).append(timed(b, w, 1, ragged=True))
            if compacted and b == sizes[-1] and widths[-1] > 1:
                full.append(timed(b, widths[-1], widths[-1]))
    return times, full, ragged, width0


def batch_cost_table(pipe, size: int, *, refresh: bool = False,
                     clock: Callable[[], float] | None = None) -> BatchCostTable:
    """The batched step's cost table for batches of up to ``size`` rows: from ``$SPECGEN_COST_TABLE``
    (its "batch" entry, else :meth:`BatchCostTable.from_chain` of its chain) if set, else from
    memory, the disk cache (keyed by :func:`facts` and ``size``) or measured (and cached)."""
    fixed = os.environ.get(FIXED_TABLE_ENV)
    if fixed:
        single = fixed_table(fixed)  # ConfigError if unusable
        data = json.loads(pathlib.Path(fixed).expanduser().read_text())
        if "batch" not in data:
            return BatchCostTable.from_chain(single.chain, _batch_shape(table_size(size), BATCH_WIDTHS[-1])[0])
        try:
            return batch_from_dict(data["batch"])
        except (ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"{FIXED_TABLE_ENV}={fixed}: not a batch cost table "
                              f"({type(error).__name__}: {error})") from None
    size = table_size(size)
    fact = dict(facts(pipe), batch_size=size, max_width=BATCH_WIDTHS[-1], method=BATCH_METHOD)
    return _cached("batch-" + cache_key(fact), refresh, lambda: measure_batch(pipe, size, clock=clock),
                   batch_from_dict, batch_to_dict)


def batch_to_dict(table: BatchCostTable) -> dict:
    return {"sizes": list(table.sizes), "widths": list(table.widths), "body": [list(line) for line in table.body],
            "head": table.head, "step_s": table.step_s, "facts": table.facts,
            "wide": [list(line) for line in table.wide], "slots": list(table.slots),
            "ragged": [list(line) for line in table.ragged],
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def batch_from_dict(data: dict) -> BatchCostTable:
    sizes, widths = tuple(int(b) for b in data["sizes"]), tuple(int(w) for w in data["widths"])
    body = tuple(tuple(float(x) for x in line) for line in data["body"])
    wide = tuple(tuple(float(x) for x in line) for line in data.get("wide") or ())
    slots = tuple(int(s) for s in data.get("slots") or ())
    ragged = tuple(tuple(float(x) for x in line) for line in data.get("ragged") or ())
    if len(body) != len(sizes) or any(len(line) != len(widths) for line in body):
        raise ValueError("batch table: body is not sizes x widths")
    if ragged and (len(ragged) != len(sizes) or any(len(line) != len(widths) for line in ragged)):
        raise ValueError("batch table: ragged is not sizes x widths")
    if wide and (len(wide) != len(sizes) or any(len(line) != len(widths) for line in wide) or len(slots) != 2):
        raise ValueError("batch table: wide is not sizes x widths with two slot counts")
    return BatchCostTable(sizes, widths, body, float(data.get("head", 0.0)), float(data.get("step_s", 0.0)),
                          dict(data.get("facts") or {}), wide, slots, ragged)


def cost_table(pipe, *, refresh: bool = False, clock: Callable[[], float] | None = None) -> CostTable:
    """The pipeline's cost table: ``$SPECGEN_COST_TABLE``'s if set (ConfigError if unreadable), else
    from memory, else from the disk cache, else measured (and cached)."""
    fixed = os.environ.get(FIXED_TABLE_ENV)
    if fixed:
        return fixed_table(fixed)

    return _cached(cache_key(facts(pipe)), refresh, lambda: measure(pipe, clock=clock), from_dict, to_dict)


def _cached(key: str, refresh: bool, measure_now: Callable[[], object], load: Callable[[dict], object],
            dump: Callable[[object], dict]):
    """The table under ``key``: from memory, else the disk cache, else ``measure_now()`` (then cached
    in both). ``refresh`` skips the lookups; an unreadable cache file is measured over."""
    from specgen.models.loading import cache_root

    if not refresh and key in _MEMO:
        return _MEMO[key]
    path = cache_root() / "costs" / f"{key}.json"
    table = None
    if not refresh and path.is_file():
        try:
            table = load(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            table = None
    if table is None:
        table = measure_now()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dump(table), indent=1))
        except OSError:
            pass  # an unwritable cache only costs a re-measurement next time
    _MEMO[key] = table
    return table


def fixed_table(path: str) -> CostTable:
    """The cost table stored at ``path`` (the cache's JSON format); ConfigError naming it if unusable."""
    try:
        return from_dict(json.loads(pathlib.Path(path).expanduser().read_text()))
    except OSError as error:
        raise ConfigError(f"{FIXED_TABLE_ENV}={path}: cannot read it ({error.strerror or error})") from None
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{FIXED_TABLE_ENV}={path}: not a cost table ({type(error).__name__}: {error})") from None


def to_dict(table: CostTable) -> dict:
    return {"chain": list(table.chain), "tree": list(table.tree), "draft_fixed": table.draft_fixed,
            "draft_per_token": table.draft_per_token, "overhead": table.overhead, "step_s": table.step_s,
            "facts": table.facts, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def from_dict(data: dict) -> CostTable:
    return CostTable(chain=tuple(float(x) for x in data["chain"]), tree=tuple(float(x) for x in data["tree"]),
                     draft_fixed=float(data["draft_fixed"]), draft_per_token=float(data["draft_per_token"]),
                     overhead=float(data.get("overhead", 0.0)), step_s=float(data["step_s"]),
                     facts=dict(data.get("facts") or {}))


def describe(table: CostTable) -> str:
    """A few lines for humans: v(n) for chains and trees, and the drafting cost."""
    chain = " ".join(f"{v:.2f}" for v in table.chain)
    tree = " ".join(f"{v:.2f}" for v in table.tree)
    fact = table.facts
    return (f"cost table ({fact.get('dtype')}, {fact.get('device')}, {fact.get('threads')} threads; "
            f"unit: one 1-token forward = {1e3 * table.step_s:.2f} ms)\n"
            f"  v(n) chain, n = 1..{len(table.chain)}: {chain}\n"
            f"  v(n) tree (n - 1 nodes):      {tree}\n"
            f"  draft: {table.draft_fixed:.3f} per proposal + {table.draft_per_token:.3f} per token")


def describe_batch(table: BatchCostTable) -> str:
    """One line for humans: the batched verify cost per (rows, width), in 1-row 1-token forwards."""
    def cells(body) -> str:
        return "; ".join(f"B={b}: " + " ".join(f"{v:.2f}" for v in line) for b, line in zip(table.sizes, body))

    text = (f"batch cost table (unit {1e3 * table.step_s:.1f} ms; widths {','.join(map(str, table.widths))}; "
            f"+{table.head:.3f} per extra logits row)")
    ragged = f"; one row w wide, the others 1: {cells(table.ragged)}" if table.ragged else ""
    if table.wide and len(table.slots) == 2:
        return (f"{text}: {table.slots[0]} shared slots: {cells(table.body)}; {table.slots[1]} slots: "
                f"{cells(table.wide)}{ragged}")
    return f"{text}: {cells(table.body)}{ragged}"
