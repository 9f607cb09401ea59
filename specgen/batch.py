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
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from specgen.errors import ConfigError, DeadEndError, PromptError, SpecgenError
from specgen.engine import RequestPlan
from specgen.events import FinishEvent, Generation, TokenEvent
from specgen.models import CausalLM, KVCache
from specgen.options import check_option_names, request_options
from specgen.planner import AUTO
from specgen.round import (RoundContext, accept_chain, accept_plain, chain_feed, plain_events, plan_and_draft,
                           round_events)
from specgen.state import Request

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

    def clear_row(self, row: int) -> RowCache:
        """Forget row ``row``'s tokens (a refill); its old slots become dead."""
        self.rows[row].crop(0)
        return self.rows[row]

    def forward(self, feeds: list[list[int]], keeps: list[int]) -> list[torch.Tensor | None]:
        """One forward over every row's feed (empty: the row idles); -> per row its last
        ``keeps[r]`` raw logit rows [keeps[r], vocab] (None where keeps[r] == 0).
        On success each row's cache view gains its feed; on failure nothing changes."""
        size, w, start = len(self.rows), max(len(f) for f in feeds), self.width
        ids = torch.zeros(size, w, dtype=torch.long)  # [B, w], pads are id 0 and masked out
        positions = torch.zeros(size, w, dtype=torch.long)  # [B, w]
        allowed = torch.zeros(size, w, start + w, dtype=torch.bool)  # [B, w, S + w]
        causal = torch.ones(w, w, dtype=torch.bool).tril()  # [w, w]
        diagonal = torch.eye(w, dtype=torch.bool)  # [w, w]: a pad query sees itself only
        picks: list[tuple[int, int]] = []
        limit = self.lm.context_length - 1
        for r, (row, feed, keep) in enumerate(zip(self.rows, feeds, keeps, strict=True)):
            n = len(feed)
            ids[r, :n] = torch.tensor(feed, dtype=torch.long)
            positions[r] = torch.arange(len(row), len(row) + w).clamp(max=limit)
            if row.slots:
                allowed[r, :n, torch.tensor(row.slots)] = True
            allowed[r, :n, start : start + n] = causal[:n, :n]
            allowed[r, n:, start:] = diagonal[n:]
            picks.extend((r, c) for c in range(n - keep, n))
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
        longest = max(len(row) for row in self.rows)
        if self.width > 2 * longest + COMPACT_SLACK:
            self.compact()

    def compact(self) -> None:
        """Gather each row's slots, left-aligned, into fresh tensors (width = the longest row)."""
        longest = max(len(row) for row in self.rows)
        index = torch.zeros(len(self.rows), longest, dtype=torch.long)  # [B, L]; pads point at slot 0, never seen
        for r, row in enumerate(self.rows):
            index[r, : len(row)] = torch.tensor(row.slots, dtype=torch.long)
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

    index: int


@dataclass
class Row:
    spec: RowSpec
    request: Request
    ctx: RoundContext
    start: float


def prepare(pipe, prompt, common: dict, index: int) -> RowSpec:
    """Validate one prompt (a str, chat messages, or a dict of per-row options with
    ``prompt`` or ``prompt_ids``); a SpecgenError names the prompt's index."""
    try:
        options_in = dict(common)
        prompt_ids = None
        if isinstance(prompt, Mapping):
            own = dict(prompt)
            prompt, prompt_ids = own.pop("prompt", None), own.pop("prompt_ids", None)
            check_option_names(own, "generate_batch()")
            if "stats" in own:
                raise ConfigError("stats is not a per-row option of generate_batch(); read each Generation's stats")
            options_in.update(own)
        plan = pipe.plan_request(prompt, prompt_ids, request_options(pipe.defaults, **options_in))
        if plan.use_spec and (pipe.drafter.feature_layers is not None or pipe.drafter.tree_width > 1):
            raise ConfigError(f"tree drafters (eagle, medusa, mtp) are not batched yet; {pipe.drafter.name!r} "
                              f"cannot run in generate_batch (pass speculative=False or use generate())")
        return RowSpec(**vars(plan), index=index)
    except SpecgenError as exc:
        raise type(exc)(f"generate_batch() prompt {index}: {exc}") from None


def stream_batch(pipe, prompts: Sequence, *, batch_size: int = 8,
                 **common) -> Iterator[tuple[int, TokenEvent | FinishEvent]]:
    """Generate every prompt, at most ``batch_size`` at a time; yield (prompt index, event).

    Each prompt's events come in order and end with its FinishEvent; prompts are
    admitted in input order as rows free up. Every prompt and option is checked
    before the first forward. common: options shared by all rows (a row's dict overrides them).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence):
        raise PromptError("generate_batch() takes a list of prompts")
    if "stats" in common:
        raise ConfigError("stats is not an option of generate_batch(); read each Generation's stats")
    if pipe.target.compiled is not None:
        raise ConfigError("generate_batch() does not run compiled targets yet; set compile=false")
    specs = [prepare(pipe, prompt, common, i) for i, prompt in enumerate(prompts)]
    queue = list(reversed(specs))
    kv = BatchKV(pipe.target, min(batch_size, max(1, len(specs))))
    slots: list[Row | None] = [None] * len(kv.rows)
    while queue or any(slots):
        for r, row in enumerate(slots):
            if row is None and queue:
                slots[r] = admit(pipe, kv, r, queue.pop())
        kv.maybe_compact()
        live = [(r, row) for r, row in enumerate(slots) if row is not None]
        for r, events in step(kv, live):
            row = slots[r]
            stats = row.ctx.stats
            if stats.ttft is None:
                stats.ttft = time.perf_counter() - row.start
            stats.new_tokens += len(events)
            stats.wall = time.perf_counter() - row.start
            for event in events:
                yield row.spec.index, event
            if row.request.finish_reason is not None:
                slots[r] = None
                kv.clear_row(r)
                yield row.spec.index, _finish(row)


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
