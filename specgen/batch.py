"""Many requests advancing together: ragged verification and continuous batching.

Every active row is a :class:`specgen.state.Request` whose ``target_cache`` is a
:class:`RowCache`, a view of one row of a shared batch-B DynamicCache
(:class:`BatchKV`). A step runs, for every row, plan + draft (its own drafter
session, planner and γ; a row without a drafter runs a plain step), then ONE
target forward over every row's feed (its uncached committed tokens + its
candidates), then each row's process / accept / commit with its own processor
stack, grammar and RNG -- the same functions :mod:`specgen.round` uses for a
single request, so a row's output law equals a single-request run's.

The shared cache: each forward appends the same number w of slots to every row
(w = the widest feed; shorter feeds are padded with dummies nobody attends to).
A row lists the slots holding its tokens (``RowCache.slots``); the 4D additive
mask lets each new token see its row's listed slots and its own feed causally;
positions are per row (token i of a row sits at position i). Rolling a row back
drops slots from its list (nothing is copied). :meth:`BatchKV.compact` gathers
each row's slots left-aligned into fresh tensors when dead slots pile up.

A step is a transaction over all its rows: an exception anywhere (the batched
forward included) restores every row to its state before the step. A grammar
dead end in one row ends that row only, as in the single-request engine.
Tree drafters (eagle, medusa, mtp) and compiled targets are not batched yet and
are refused with a ConfigError.

One step loop (:class:`Batch`), two clients: :func:`stream_batch` admits a list
given up front; :class:`BatchScheduler` is online (a thread admits requests as
they are submitted and slots free up, and drops cancelled ones between steps).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specgen.engine import RequestPlan
from specgen.errors import ConfigError, DeadEndError, PromptError, SpecgenError, first_line
from specgen.events import FinishEvent, Generation, TokenEvent
from specgen.models import CausalLM, KVCache
from specgen.options import check_option_names, request_options
from specgen.planner import AUTO
from specgen.round import (RoundContext, accept_chain, accept_plain, chain_feed, plain_events, plan_and_draft,
                           round_events)
from specgen.state import Request

log = logging.getLogger("specgen.batch")
#: Compact once the shared cache holds this many slots more than twice the longest row.
COMPACT_SLACK = 16


@dataclass
class RowCache(KVCache):
    """One row of a :class:`BatchKV` behind the single-request KVCache interface.

    tokens: this row's cached ids; slots: the shared cache's slot of each, in order
    (len(slots) == len(tokens)). ``cache`` is the owning BatchKV.
    """

    slots: list[int] = field(default_factory=list)

    def crop(self, length: int) -> None:
        del self.tokens[length:]
        del self.slots[length:]

    def keep_rows(self, prefix: int, rows: list[int]) -> None:
        raise ConfigError("tree drafters (eagle, medusa, mtp) are not batched yet; use generate() per prompt")


class BatchKV:
    """A batch-``size`` DynamicCache shared by ``size`` row views (:attr:`rows`)."""

    def __init__(self, lm: CausalLM, size: int):
        self.lm = lm
        self.cache = DynamicCache(config=lm.config)
        self.width = 0  # slots per row in the shared tensors
        self.rows = [RowCache(self) for _ in range(size)]
        self.live: list[int] = []  # the rows the shared tensors hold, in order (their batch dimension)

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

    def prefill(self, r: int, tokens: list[int]) -> bool:
        """Feed a fresh row's ``tokens`` (its prompt but the last token) in a forward of its
        own, then append their keys/values as new slots of the shared tensors (the other
        rows' entries there stay dead; empty shared tensors are created), so batched steps
        never pad the other rows to a prompt's length. -> False, doing nothing, when the row
        already has slots or the cache's layers are not plain 4D key/value tensors."""
        row = self.rows[r]
        layers = self.cache.layers
        if row.slots or not tokens or not all(hasattr(layer, "lazy_initialization") for layer in layers):
            return False
        if any(layer.is_initialized and (layer.keys is None or layer.keys.dim() != 4) for layer in layers):
            return False
        self._hold(sorted({*self.live, r}))
        own = self.lm.new_cache()
        self.lm.forward(own, tokens, keep=1, check=False)  # its keys/values; the logits are not used
        j, start, n = self.live.index(r), self.width, len(tokens)
        for layer, mine in zip(layers, own.cache.layers, strict=True):
            if not layer.is_initialized:
                layer.lazy_initialization(mine.keys, mine.values)
                empty = mine.keys.new_zeros(len(self.live), mine.keys.shape[1], start, mine.keys.shape[3])
                layer.keys, layer.values = empty, empty.clone()  # [B', heads, S, head_dim], S = self.width
            for name in ("keys", "values"):
                shared, added = getattr(layer, name), getattr(mine, name)  # [B', heads, S, hd], [1, heads, n, hd]
                grown = torch.cat([shared, shared.new_zeros(*shared.shape[:2], n, shared.shape[3])], dim=-2)
                grown[j, :, start:] = added[0]
                setattr(layer, name, grown)  # [B', heads, S + n, head_dim]
        self.width = start + n
        row.tokens.extend(tokens)
        row.slots.extend(range(start, start + n))
        return True

    def clear_row(self, row: int) -> RowCache:
        """Forget row ``row``'s tokens (a refill); its old slots become dead."""
        self.rows[row].crop(0)
        return self.rows[row]

    def forward(self, feeds: list[list[int]], keeps: list[int]) -> list[torch.Tensor | None]:
        """One forward over every row's feed (empty: the row idles); -> per row its last
        ``keeps[r]`` raw logit rows [keeps[r], vocab] (None where keeps[r] == 0).
        On success each row's cache view gains its feed; on failure nothing changes."""
        self._hold([r for r, feed in enumerate(feeds) if feed])
        size, w, start = len(self.live), max(len(f) for f in feeds), self.width
        ids = torch.zeros(size, w, dtype=torch.long)  # [B', w], pads are id 0 and masked out
        positions = torch.zeros(size, w, dtype=torch.long)  # [B', w]
        allowed = torch.zeros(size, w, start + w, dtype=torch.bool)  # [B', w, S + w]
        causal = torch.ones(w, w, dtype=torch.bool).tril()  # [w, w]
        diagonal = torch.eye(w, dtype=torch.bool)  # [w, w]: a pad query sees itself only
        picks: list[tuple[int, int]] = []
        limit = self.lm.context_length - 1
        for j, r in enumerate(self.live):  # batch entry j holds row r
            row, feed, keep = self.rows[r], feeds[r], keeps[r]
            n = len(feed)
            ids[j, :n] = torch.tensor(feed, dtype=torch.long)
            positions[j] = torch.arange(len(row), len(row) + w).clamp(max=limit)
            if row.slots:
                allowed[j, :n, torch.tensor(row.slots)] = True
            allowed[j, :n, start : start + n] = causal[:n, :n]
            allowed[j, n:, start:] = diagonal[n:]
            picks.extend((j, c) for c in range(n - keep, n))
        rows = torch.tensor([p[0] for p in picks], dtype=torch.long)  # [K]
        cols = torch.tensor([p[1] for p in picks], dtype=torch.long)  # [K]
        logits = self.lm.forward_batch(self.cache, ids, positions, allowed, rows, cols)  # [K, vocab]
        self.width = start + w
        out: list[torch.Tensor | None] = []
        used = 0
        for row, feed, keep in zip(self.rows, feeds, keeps, strict=True):
            row.tokens.extend(feed)
            row.slots.extend(range(start, start + len(feed)))
            out.append(logits[used : used + keep] if keep else None)
            used += keep
        return out

    def maybe_compact(self) -> None:
        """Compact when the shared cache is more than twice the longest row (plus slack)."""
        longest = max((len(self.rows[r]) for r in self.live), default=0)
        if self.width > 2 * longest + COMPACT_SLACK:
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


@dataclass
class RowSpec(RequestPlan):
    """One prompt's checked request (:meth:`specgen.engine.Pipeline.plan_request`) and its index."""

    index: int | None


@dataclass(eq=False)
class Row:
    spec: RowSpec
    request: Request
    ctx: RoundContext
    start: float
    owner: object = None  # who receives this row's events (a BatchScheduler's Handle)


def batchable(pipe) -> bool:
    """Whether ``pipe``'s speculative rows can run batched: no tree drafter, no compiled target."""
    drafter = pipe.drafter
    chain = not pipe.speculative or (drafter.feature_layers is None and drafter.tree_width <= 1)
    return chain and pipe.target.compiled is None


def prepare(pipe, prompt, common: dict, index: int | None, *, caller: str = "generate_batch()") -> RowSpec:
    """Validate one prompt (a str, chat messages, or a dict of per-row options with
    ``prompt`` or ``prompt_ids``); a SpecgenError names the prompt's index (when not None)."""
    try:
        options_in = dict(common)
        prompt_ids = None
        if isinstance(prompt, Mapping):
            own = dict(prompt)
            prompt, prompt_ids = own.pop("prompt", None), own.pop("prompt_ids", None)
            check_option_names(own, caller)
            if "stats" in own:
                raise ConfigError(f"stats is not a per-row option of {caller}; read each Generation's stats")
            options_in.update(own)
        plan = pipe.plan_request(prompt, prompt_ids, request_options(pipe.defaults, **options_in))
        if plan.use_spec and (pipe.drafter.feature_layers is not None or pipe.drafter.tree_width > 1):
            raise ConfigError(f"tree drafters (eagle, medusa, mtp) are not batched yet; {pipe.drafter.name!r} "
                              f"cannot run in {caller} (pass speculative=False or use generate())")
        return RowSpec(**vars(plan), index=index)
    except SpecgenError as exc:
        if index is None:
            raise
        raise type(exc)(f"{caller} prompt {index}: {exc}") from None


def _check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    return batch_size


class Batch:
    """The step loop's state, shared by :func:`stream_batch` and :class:`BatchScheduler`:
    ``size`` slots over one :class:`BatchKV`. Rows are added and removed only between
    steps, so a removed row is always at its last commit."""

    def __init__(self, pipe, size: int):
        self.pipe = pipe
        self.kv = BatchKV(pipe.target, size)
        self.slots: list[Row | None] = [None] * size

    @property
    def active(self) -> int:
        """Rows running."""
        return sum(row is not None for row in self.slots)

    @property
    def full(self) -> bool:
        return all(row is not None for row in self.slots)

    def add(self, spec: RowSpec, owner: object = None) -> Row:
        """Admit ``spec`` (planned by this pipeline or a variant sharing its models: the row
        runs ``spec.stack``) into a free slot; ValueError when the batch is full."""
        r = self.slots.index(None)
        self.slots[r] = row = admit(self.pipe, self.kv, r, spec)
        row.owner = owner
        return row

    def remove(self, row: Row) -> None:
        """Free ``row``'s slot (its cached slots become dead and are compacted away later)."""
        r = self.slots.index(row)
        self.slots[r] = None
        self.kv.clear_row(r)

    def rows(self) -> list[Row]:
        return [row for row in self.slots if row is not None]

    def step(self) -> Iterator[tuple[Row, TokenEvent | FinishEvent]]:
        """One step over every active row (a transaction: on an exception nothing is yielded and
        every row is as before); then each row's events, a finished row's FinishEvent last (its
        slot is free by then)."""
        self.kv.maybe_compact()
        live = [(r, row) for r, row in enumerate(self.slots) if row is not None]
        for r, events in step(self.kv, live):
            row = self.slots[r]
            stats = row.ctx.stats
            if stats.ttft is None:
                stats.ttft = time.perf_counter() - row.start
            stats.new_tokens += len(events)
            stats.wall = time.perf_counter() - row.start
            for event in events:
                yield row, event
            if row.request.finish_reason is not None:
                self.remove(row)
                yield row, _finish(row)


def stream_batch(pipe, prompts: Sequence, *, batch_size: int = 8,
                 **common) -> Iterator[tuple[int, TokenEvent | FinishEvent]]:
    """Generate every prompt, at most ``batch_size`` at a time; yield (prompt index, event).

    Each prompt's events come in order and end with its FinishEvent; prompts are
    admitted in input order as rows free up. Every prompt and option is checked
    before the first forward. common: options shared by all rows (a row's dict overrides them).
    """
    _check_batch_size(batch_size)
    if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence):
        raise PromptError("generate_batch() takes a list of prompts")
    if "stats" in common:
        raise ConfigError("stats is not an option of generate_batch(); read each Generation's stats")
    if pipe.target.compiled is not None:
        raise ConfigError("generate_batch() does not run compiled targets yet; set compile=false")
    specs = [prepare(pipe, prompt, common, i) for i, prompt in enumerate(prompts)]
    queue = list(reversed(specs))
    batch = Batch(pipe, min(batch_size, max(1, len(specs))))
    while queue or batch.active:
        while queue and not batch.full:
            batch.add(queue.pop())
        for row, event in batch.step():
            yield row.spec.index, event


def generate_batch(pipe, prompts: Sequence, *, batch_size: int = 8, **common) -> list[Generation]:
    """Run :func:`stream_batch` to the end; -> one Generation per prompt, in input order."""
    out: list[Generation | None] = [None] * len(prompts) if isinstance(prompts, Sequence) else []
    for index, event in stream_batch(pipe, prompts, batch_size=batch_size, **common):
        if isinstance(event, FinishEvent):
            out[index] = event.generation
    return out


def admit(pipe, kv: BatchKV, r: int, spec: RowSpec) -> Row:
    o = spec.options
    request, ctx = pipe.open_request(spec.ids, max_new_tokens=spec.max_new, seed=o.seed, stop=o.stop,
                                     use_spec=spec.use_spec, stack=spec.stack)
    request.target_cache = kv.clear_row(r)
    if request.draft is not None and spec.gamma == AUTO:
        ctx.costs = pipe.cost_table()
    return Row(spec, request, ctx, time.perf_counter())


def _finish(row: Row) -> FinishEvent:
    request, spec = row.request, row.spec
    row.ctx.stats.wall = time.perf_counter() - row.start
    reason = request.finish_reason
    if reason == "length" and spec.context_bound:
        reason = "context"
    tail = request.text.flush()
    generation = Generation(request.text.text, list(request.generated), spec.guarantee, reason, row.ctx.stats,
                            spec.ids)
    return FinishEvent(tail, reason, generation)


def step(kv: BatchKV, live: list[tuple[int, Row]]) -> list[tuple[int, list[TokenEvent]]]:
    """One batched step over the ``live`` (row index, Row) pairs, as one transaction;
    -> (row index, events) for each live row."""
    feeds: list[list[int]] = [[] for _ in kv.rows]
    keeps = [0] * len(kv.rows)
    drafted: dict[int, tuple] = {}
    results: list[tuple[int, Row, object]] = []
    with ExitStack() as transaction:
        for r, row in live:
            transaction.enter_context(row.request.transaction())
            row.ctx.clock.take_laps()
            if not row.request.target_cache.slots:  # a fresh row: its prompt in a forward of its own
                kv.prefill(r, row.request.committed.tokens[:-1])
        for r, row in live:  # plan + draft, per row
            request = row.request
            if request.draft is None:
                feeds[r], keeps[r] = request.target_cache.uncached(request.committed.tokens), 1
                continue
            proposal, predicted = plan_and_draft(request, row.ctx, row.spec.gamma)
            if proposal.parents is not None:
                raise ConfigError("tree proposals are not batched yet")
            drafted[r] = (proposal, predicted)
            feeds[r], keeps[r] = chain_feed(request, proposal), len(proposal) + 1
        logits = kv.forward(feeds, keeps)  # verify: one target forward over every row
        for r, row in live:  # process + accept + commit, per row
            try:
                with row.request.transaction():
                    if r in drafted:
                        proposal, predicted = drafted[r]
                        results.append((r, row, (proposal, predicted, *accept_chain(row.request, row.ctx,
                                                                                    proposal, logits[r]))))
                    else:
                        results.append((r, row, accept_plain(row.request, row.ctx, logits[r])))
            except DeadEndError:
                row.request.finish_reason = "dead_end"
                results.append((r, row, None))
    out = []
    for r, row, result in results:  # emit, once every row has committed
        if result is None:
            out.append((r, []))
        elif r in drafted:
            proposal, predicted, verdict, kept, depth = result
            out.append((r, round_events(row.ctx, proposal, predicted, row.spec.gamma == AUTO, verdict, kept,
                                        depth)))
        else:
            out.append((r, plain_events(row.ctx, result)))
    return out


class StepError(SpecgenError):
    """A batched step failed (rolled back); the rows it ran were removed. ``__cause__``: the error."""


@dataclass(frozen=True)
class Cancelled:
    """A handle's last item when it was cancelled (or its scheduler closed) before finishing:
    ``new_tokens`` TokenEvents had been delivered."""

    new_tokens: int


class Handle:
    """One request submitted to a :class:`BatchScheduler`.

    Its items, in order: TokenEvents, then exactly one of FinishEvent, :class:`Cancelled`
    or a SpecgenError (the request was refused when admitted, before any event; a
    :class:`StepError` when a step it ran in failed). With a ``callback`` each item is
    passed to it on the scheduler's thread (it must not block for long or raise); without
    one, iterate the handle (on any thread): it yields the events and Cancelled, and
    raises the error.
    """

    def __init__(self, prompt: object, variant: Hashable | None, callback: Callable[[object], None] | None,
                 cancelled: threading.Event | None = None):
        self.prompt, self.variant = prompt, variant
        self.cancelled = cancelled or threading.Event()
        self.delivered = 0  # TokenEvents delivered so far
        self._items: queue.SimpleQueue | None = None if callback else queue.SimpleQueue()
        self._callback = callback

    def deliver(self, item: object) -> None:
        if isinstance(item, TokenEvent):
            self.delivered += 1
        if self._callback is not None:
            self._callback(item)
        else:
            self._items.put(item)

    def __iter__(self) -> Iterator[TokenEvent | FinishEvent | Cancelled]:
        if self._items is None:
            raise ConfigError("a handle with a callback receives its events there; it cannot be iterated")
        while True:
            item = self._items.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, (FinishEvent, Cancelled)):
                return


class BatchScheduler:
    """An online batch: requests join while it runs and leave when they finish or are cancelled.

    One thread (started by :meth:`start`, or by the first :meth:`submit`) owns the pipeline:
    it admits queued requests, in submission order, whenever a slot is free (at most
    ``batch_size`` rows), checks each on admission (:func:`prepare`), and runs
    :meth:`Batch.step` while any row is active. :meth:`cancel` is honoured between steps:
    the row, at its last commit, is removed and its slot reused; other rows are untouched.
    A step that raises fails every row it ran (each handle gets a :class:`StepError`);
    the scheduler goes on with the next requests.

    variants: maps a request's ``variant`` key to a pipeline sharing ``pipe``'s models
    (its processor stack and guarantee then plan the row); called on the scheduler thread.
    """

    def __init__(self, pipe, batch_size: int = 8, *, variants: Callable[[Hashable], object] | None = None):
        if not batchable(pipe):
            raise ConfigError("the batch scheduler needs a chain drafter (or none) and compile=false")
        self.pipe, self.variants = pipe, variants
        self.batch = Batch(pipe, _check_batch_size(batch_size))
        self._waiting: queue.SimpleQueue[Handle | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    @property
    def pending(self) -> int:
        """Requests waiting for a slot."""
        return self._waiting.qsize()

    @property
    def active(self) -> int:
        """Rows running."""
        return self.batch.active

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closing.is_set()

    def start(self) -> None:
        with self._lock:
            if self.closed:
                raise ConfigError("this BatchScheduler is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="specgen-batch", daemon=True)
                self._thread.start()

    def submit(self, prompt=None, *, prompt_ids=None, variant: Hashable | None = None,
               callback: Callable[[object], None] | None = None, cancelled: threading.Event | None = None,
               **options) -> Handle:
        """Queue one request (the options of :meth:`specgen.engine.Pipeline.stream`); -> its handle.
        It is checked when admitted: a bad one's handle gets the SpecgenError. cancelled: an
        Event that cancels the request when set (default: a new one; :meth:`cancel` sets it)."""
        if variant is not None and self.variants is None:
            raise ConfigError("this BatchScheduler has no variants; submit without variant=")
        handle = Handle(dict(options, prompt=prompt, prompt_ids=prompt_ids), variant, callback, cancelled)
        self.start()
        self._waiting.put(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """Stop ``handle`` at its last commit (between steps); it then gets Cancelled."""
        handle.cancelled.set()

    def close(self) -> None:
        """Stop after the running step; active and queued requests get Cancelled."""
        with self._lock:
            self._closing.set()
            thread = self._thread
        if thread is not None:
            self._waiting.put(None)
            thread.join()

    def generate(self, prompt=None, **options) -> Generation:
        """Submit and wait (any thread); -> the Generation. Raises the request's SpecgenError."""
        for item in self.submit(prompt, **options):
            if isinstance(item, FinishEvent):
                return item.generation
        raise SpecgenError("the request was cancelled")

    def _loop(self) -> None:
        while not self.closed:
            for row in self.batch.rows():
                if row.owner.cancelled.is_set():
                    self.batch.remove(row)
                    row.owner.deliver(Cancelled(row.owner.delivered))
            while not self.closed and not self.batch.full:
                try:
                    handle = self._waiting.get(block=not self.batch.active)
                except queue.Empty:
                    break
                if handle is not None:
                    self._admit(handle)
            if not self.closed and self.batch.active:
                self._step()
        for row in self.batch.rows():
            self.batch.remove(row)
            row.owner.deliver(Cancelled(row.owner.delivered))
        while True:
            try:
                handle = self._waiting.get_nowait()
            except queue.Empty:
                return
            if handle is not None:
                handle.deliver(Cancelled(0))

    def _admit(self, handle: Handle) -> None:
        if handle.cancelled.is_set():
            handle.deliver(Cancelled(0))
            return
        try:
            pipe = self.pipe if handle.variant is None else self.variants(handle.variant)
            self.batch.add(prepare(pipe, handle.prompt, {}, None, caller="a request"), handle)
        except SpecgenError as exc:
            handle.deliver(exc)
        except Exception as exc:  # a bug must not take the scheduler (and every later request) down
            log.exception("admitting a request failed")
            failure = StepError(f"internal error: {first_line(exc)}")
            failure.__cause__ = exc
            handle.deliver(failure)

    def _step(self) -> None:
        rows = self.batch.rows()
        try:
            for row, event in self.batch.step():
                if not row.owner.cancelled.is_set():
                    row.owner.deliver(event)
                elif isinstance(event, FinishEvent):  # finished in the step its cancel arrived in
                    row.owner.deliver(Cancelled(row.owner.delivered))
        except Exception as exc:  # the step rolled back: fail its rows, keep serving the others
            log.exception("a batched step failed")
            failure = StepError(f"generation failed: {first_line(exc)}")
            failure.__cause__ = exc
            for row in rows:
                if row in self.batch.slots:
                    self.batch.remove(row)
                    row.owner.deliver(failure)
