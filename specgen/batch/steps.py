"""Rows, the batched step and its clients :func:`stream_batch` / :func:`generate_batch` (see :mod:`specgen.batch`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from specgen.batch.drafting import batch_costs, plan_rows
from specgen.drafters import batch_refusal
from specgen.errors import ConfigError, DeadEndError, PromptError, SpecgenError
from specgen.events import FinishEvent, Generation, TokenEvent
from specgen.models.prefix_cache import common_prefix
from specgen.models.target import BatchCache
from specgen.config.options import RequestOptions, parse_batch_size, request_options, set_fields, with_overrides
from specgen.planning import AUTO, BatchCostTable
from specgen.engine.request import RequestPlan, finish, record
from specgen.engine.round import RoundContext, accept_chain, accept_plain, chain_feed, plain_events, round_events
from specgen.engine.state import Request

@dataclass
class RowSpec(RequestPlan):
    """One prompt's checked request (:meth:`specgen.engine.pipeline.Pipeline.plan_request`) and its index."""

    index: int | None


@dataclass(eq=False)
class Row:
    spec: RowSpec
    request: Request
    ctx: RoundContext
    start: float
    owner: object = None  # who receives this row's events (a BatchScheduler's Handle)
    passed_over: int = 0  # consecutive steps this row, still without a first token, fed nothing
    chunked: bool = False  # its prompt has been fed a chunk (prefill_chunks): its rest goes in chunks too


def unbatched_reason(pipe) -> str | None:
    """Why ``pipe``'s rows cannot share batched steps, or None when they can:
    :func:`specgen.drafters.batch_refusal` for its drafter (when it speculates) and its target."""
    target = pipe.target
    return batch_refusal(pipe.drafter if pipe.speculative else None, compiled=target.is_compiled,
                         backend=None if target.capabilities.batches else target.backend)


def prepare(pipe, prompt, common: RequestOptions | None, index: int | None, *, prompt_ids=None,
            caller: str = "generate_batch()") -> RowSpec:
    """Validate one prompt (a str, chat messages, or a dict with ``prompt`` or ``prompt_ids``,
    optionally ``options``, a RequestOptions, and option overrides by name) under ``common``
    (unresolved options; the row's own set fields override them); a SpecgenError names the
    prompt's index (when not None). A row cannot carry stats (each Generation has its own)."""
    try:
        options = with_overrides(common, {}, caller)
        if isinstance(prompt, Mapping):
            own = dict(prompt)
            prompt, prompt_ids = own.pop("prompt", None), own.pop("prompt_ids", None)
            options = with_overrides(options, set_fields(with_overrides(own.pop("options", None), {}, caller)), caller)
            options = with_overrides(options, own, caller)
        if options.stats is not None:
            raise ConfigError(f"stats is not a per-row option of {caller}; read each Generation's stats")
        plan = pipe.plan_request(prompt, prompt_ids, request_options(pipe.defaults, options))
        why = batch_refusal(pipe.drafter) if plan.use_spec else None
        if why:
            raise ConfigError(f"{why}; {pipe.drafter.name!r} cannot run in {caller} "
                              "(pass speculative=False or use generate())")
        return RowSpec(**vars(plan), index=index)
    except SpecgenError as exc:
        if index is None:
            raise
        raise type(exc)(f"{caller} prompt {index}: {exc}") from None


class Batch:
    """The step loop's state, shared by :func:`stream_batch` and :class:`BatchScheduler`:
    ``size`` slots over one batched cache (:meth:`~specgen.models.target.Target.new_batch`; a row holds
    at most ``row_context`` tokens where the backend sizes rows, None: the target's context).
    Rows are added and removed only between steps, so a removed row is always at its last commit."""

    def __init__(self, pipe, size: int, row_context: int | None = None, *, chunked_prefill: bool = True):
        self.pipe = pipe
        self.kv: BatchCache = pipe.target.new_batch(size, row_context)
        #: Long prompts are prefilled a chunk per step (see :func:`prefill_chunks`); False: whole, in one step.
        self.chunked_prefill = chunked_prefill
        self.slots: list[Row | None] = [None] * size
        self.costs: BatchCostTable | None = None  # loaded when a row first plans with num_tokens="auto"
        #: A slot keeps its last request's entries for the next one to start from (see :meth:`add`):
        #: where the pipeline's prefix cache is on (its setting, and the target's ``prefix_reuse``)
        #: and rows hold caches of their own (a shared-width cache's row cannot be fed a prefix apart),
        #: on a target whose every entry is reusable (``prefill_floor`` 1: a row's decode steps are too).
        self.reuse = (bool(pipe.prefix_cache.enabled) and not self.kv.shares_width
                      and pipe.target.capabilities.prefill_floor <= 1)

    @property
    def active(self) -> int:
        """Rows running."""
        return sum(row is not None for row in self.slots)

    @property
    def full(self) -> bool:
        return all(row is not None for row in self.slots)

    def add(self, spec: RowSpec, owner: object = None) -> Row:
        """Admit ``spec`` (planned by this pipeline or a variant sharing its models: the row
        runs ``spec.stack``) into a free slot; ValueError when the batch is full. With :attr:`reuse`,
        the free slot whose kept entries share the longest prefix with the prompt (ties: the first),
        and the row prefills only the rest, as a request parked in the prefix cache does alone."""
        r = self.slots.index(None)
        if self.reuse:
            free = [i for i, row in enumerate(self.slots) if row is None]
            r = max(free, key=lambda i: (self._kept_prefix(i, spec.ids), -i))
        needed = len(spec.ids) + spec.max_new
        if needed > self.kv.row_context:
            raise PromptError(f"the prompt ({len(spec.ids)} tokens) and max_new_tokens ({spec.max_new}) need {needed} "
                              f"tokens; a batched row here holds {self.kv.row_context} (llama_cpp.batch_row_context)")
        if self.costs is None and spec.use_spec and spec.gamma == AUTO:  # before the row's clock starts
            self.costs = batch_costs(self.pipe, len(self.slots))  # measured once per machine and cached
        self.slots[r] = row = admit(self.pipe, self.kv, r, spec, self.reuse)
        row.owner = owner
        return row

    def remove(self, row: Row) -> None:
        """Free ``row``'s slot (its cached slots become dead and are compacted away later). With
        :attr:`reuse` a row whose request ended keeps its committed entries for the slot's next
        request; a row removed otherwise (cancelled, failed) is cleared."""
        r = self.slots.index(row)
        self.slots[r] = None
        if not (self.reuse and row.request.finish_reason is not None):
            self.kv.clear_row(r)

    def _kept_prefix(self, r: int, ids: Sequence[int]) -> int:
        """How many of ``ids`` free slot ``r`` holds from its last request (0 for a row not made yet)."""
        return common_prefix(self.kv.rows[r].tokens, ids) if r < len(self.kv.rows) else 0

    def rows(self) -> list[Row]:
        return [row for row in self.slots if row is not None]

    def step(self, draining: bool = False) -> Iterator[tuple[Row, TokenEvent | FinishEvent]]:
        """One step over every active row (a transaction: on an exception nothing is yielded and
        every row is as before); then each row's events, a finished row's FinishEvent last (its
        slot is free by then). draining: no request waits for a free row (a batch job's tail:
        its end is what counts, not its throughput; a server keeps False, each request's own
        latency counting)."""
        live = [(r, row) for r, row in enumerate(self.slots) if row is not None and row.request.finish_reason is None]
        for row in self.rows():
            if row.request.finish_reason is not None:  # ended when admitted (echo with max_new_tokens=0)
                self.remove(row)
                yield row, finish(row.request, row.spec, row.ctx.stats, row.start)
        for r, events in step(self.kv, live, self.costs, draining, self.chunked_prefill) if live else ():
            row = self.slots[r]
            if events or row.request.finish_reason is not None:  # not a step that only prefilled
                record(row.ctx.stats, events, row.start)
            for event in events:
                yield row, event
            if row.request.finish_reason is not None:
                self.remove(row)
                yield row, finish(row.request, row.spec, row.ctx.stats, row.start)


def stream_batch(pipe, prompts: Sequence, *, batch_size: int = 8, options: RequestOptions | None = None,
                 **overrides) -> Iterator[tuple[int, TokenEvent | FinishEvent]]:
    """Generate every prompt, at most ``batch_size`` at a time; yield (prompt index, event).

    Each prompt's events come in order and end with its FinishEvent; prompts are
    admitted in input order as rows free up. Every prompt and option is checked
    before the first forward. options / overrides: shared by all rows, as ``Pipeline.stream``
    takes them (a row's dict overrides them).
    """
    parse_batch_size(batch_size)
    if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence):
        raise PromptError("generate_batch() takes a list of prompts")
    common = with_overrides(options, overrides, "generate_batch()")
    if common.stats is not None:
        raise ConfigError("stats is not an option of generate_batch(); read each Generation's stats")
    if pipe.target.is_compiled:
        raise ConfigError("generate_batch() does not run compiled targets yet; set compile=false")
    specs = [prepare(pipe, prompt, common, i) for i, prompt in enumerate(prompts)]
    if not pipe.target.capabilities.batches:  # one row after another, each run as generate() runs it
        for spec in specs:
            for event in pipe.run_plan(spec):
                yield spec.index, event
        return
    queue = list(reversed(specs))
    longest = max((len(spec.ids) + spec.max_new for spec in specs), default=1)  # tokens a row ever holds
    batch = Batch(pipe, min(batch_size, max(1, len(specs))), row_context=min(longest, pipe.target.context_length))
    while queue or batch.active:
        while queue and not batch.full:
            batch.add(queue.pop())
        for row, event in batch.step(draining=not queue):
            yield row.spec.index, event


def generate_batch(pipe, prompts: Sequence, *, batch_size: int = 8, options: RequestOptions | None = None,
                   **overrides) -> list[Generation]:
    """Run :func:`stream_batch` to the end; -> one Generation per prompt, in input order."""
    out: list[Generation | None] = [None] * len(prompts) if isinstance(prompts, Sequence) else []
    for index, event in stream_batch(pipe, prompts, batch_size=batch_size, options=options, **overrides):
        if isinstance(event, FinishEvent):
            out[index] = event.generation
    return out


def admit(pipe, kv: BatchCache, r: int, spec: RowSpec, reuse: bool = False) -> Row:
    """Open ``spec`` on slot ``r``: on its kept entries synced to the prompt (``reuse``: every
    entry but the prompt's last token may be kept), else on the slot cleared."""
    if reuse and r < len(kv.rows):
        cache = kv.rows[r]
        cache.uncached(list(spec.ids))  # crops to the common prefix, at most len(ids) - 1 entries
    else:
        cache = kv.clear_row(r)
    request, ctx = pipe.open_plan(spec, target_cache=cache)
    if request.draft is not None and spec.gamma == AUTO:
        request.planner.attach(pipe.cost_table())
    return Row(spec, request, ctx, time.perf_counter())


#: Steps a prompt still without its first token may be passed over in a row before it goes first
#: (:func:`prefill_chunks`): the bound on how long newer, shorter prompts can hold a long one back.
MAX_PASSED_OVER = 4


def prefill_chunks(kv: BatchCache, live: list[tuple[int, Row]]) -> dict[int, list[int]]:
    """The rows of ``live`` whose prompt does not go whole this step, each with what it feeds.

    The rows without a first token yet share a budget of one chunk (``kv.prefill_chunk``
    tokens: the width the backend splits a prompt's decodes at, from the prompt's first
    token, on every path) of prompt per step, shortest remaining prompt first (ties: the row
    admitted first): each whose uncached prompt fits what is left of the budget (a row
    already chunked: also its next chunk, :meth:`BatchCache.prefill_take`) steps as any row (its prompt
    with its first logits, its first token this step); when none fits, the shortest feeds
    its next chunk, no logits read, so its prompt's decodes, its last chunk's included, are
    those of its solo run or split where the backend measured that splits change no logit;
    every other such row waits, feeding nothing. Rows that have their first token decode in
    every step, outside the budget. So a step costs at most one chunk of prompt beside the
    decodes, and a newly admitted short prompt goes before the rest of a long one. No
    prompt starves: a row passed over (fed nothing) :data:`MAX_PASSED_OVER` steps in a row
    goes first in the next step (oldest first among such rows); each row's ``passed_over``
    count is updated here. {} when the backend does not chunk (``kv.prefill_chunk`` None)."""
    chunk = kv.prefill_chunk
    if not chunk:
        return {}
    waiting = []  # (uncached prompt tokens, admission time, row index, row)
    for r, row in live:
        request = row.request
        if not request.committed.num_generated:
            waiting.append((request.target_cache.uncached(request.committed.tokens), row.start, r, row))
    out: dict[int, list[int]] = {}
    budget = chunk

    def order(entry):  # starving rows first, oldest first; then shortest remaining prompt, oldest first
        pending, start, _, row = entry
        return (0, start, len(pending)) if row.passed_over >= MAX_PASSED_OVER else (1, len(pending), start)

    for pending, _, r, row in sorted(waiting, key=order):
        take = kv.prefill_take(r, len(row.request.target_cache) + len(pending)) if row.chunked else budget
        if len(pending) <= min(budget, take):
            budget -= len(pending)
            row.passed_over = 0
        elif budget == chunk:
            out[r] = pending[: kv.prefill_take(r, len(row.request.target_cache) + len(pending))]
            budget = 0
            row.passed_over = 0
            row.chunked = True
        else:
            out[r] = []
            row.passed_over += 1
    return out


def step(kv: BatchCache, live: list[tuple[int, Row]], costs: BatchCostTable | None = None, draining: bool = False,
         chunked: bool = True) -> list[tuple[int, list[TokenEvent]]]:
    """One batched step over the ``live`` (row index, Row) pairs, as one transaction;
    -> (row index, events) for each live row (none for a row still prefilling). costs: the
    batched cost table the auto rows are planned with (None: a stand-in from their
    single-request table); draining: no request waits for a row (see
    :func:`specgen.batch.drafting.plan_rows`); chunked: long prompts feed a chunk a step
    (:func:`prefill_chunks`), else each whole in its row's first step."""
    feeds: list[list[int]] = [[] for _ in kv.rows]
    keeps = [0] * len(kv.rows)
    results: list[tuple[int, Row, object]] = []
    kv.maybe_compact()  # a relayout that keeps every row's contents: before the transaction, which restores slot lists
    with ExitStack() as transaction:
        for r, row in live:
            transaction.enter_context(row.request.transaction())
            row.ctx.clock.take_laps()
            if not len(row.request.target_cache) and kv.prefills_apart:  # a fresh row: its prompt apart
                kv.prefill(r, row.request.committed.tokens[:-1])
        prefilling = prefill_chunks(kv, live) if chunked else {}
        for r, tokens in prefilling.items():
            feeds[r] = tokens
        live = [(r, row) for r, row in live if r not in prefilling]
        drafted = plan_rows(None if costs is None else costs.at(kv.width), live, draining)  # lengths chosen together
        for r, row in live:
            request = row.request
            if r not in drafted:
                feeds[r], keeps[r] = request.target_cache.uncached(request.committed.tokens), 1
                continue
            proposal = drafted[r][0]
            if proposal.parents is not None:
                raise ConfigError("tree proposals are not batched yet")
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
    out = [(r, []) for r in prefilling]
    for r, row, result in results:  # emit, once every row has committed
        if result is None:
            out.append((r, []))
        elif r in drafted:
            proposal, predicted, verdict, kept, depth = result
            out.append((r, round_events(row.request, row.ctx, proposal, predicted, row.spec.gamma == AUTO, verdict,
                                        kept, depth)))
        else:
            out.append((r, plain_events(row.request, row.ctx, result)))
    return out
