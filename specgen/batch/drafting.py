"""The plan + draft stage of a batched step: every row's draft length chosen together.

The planning itself is pure and lives in :mod:`specgen.planning.batch`; this stage
feeds it the rows and runs their drafters. Rows with ``num_tokens="auto"`` are
planned jointly against the batched cost table (a row drafting k tokens makes every
row's forward 1 + k wide); rows with a fixed γ draft it as in a single request
(:meth:`specgen.planning.planner.Planner.draft`) and are fixed points of the plan; rows
without a drafter are plain. Then the joint stopping rule
(:func:`specgen.planning.batch.truncate_batch`) cuts each auto row's draft. Every
input is a row's past rounds, its drafter's output, or other rows' (independent of
the row's own target draws): the plan is non-anticipating, so each row stays exact.
"""

from __future__ import annotations

from dataclasses import replace

from specgen.drafters import Proposal
from specgen.drafters.base import EMPTY
from specgen.planning import (AUTO, BatchCostTable, DraftedRow, RowPlan, auto_row, drafted_row, plan_batch,
                              token_values, truncate_batch)
from specgen.planning import cost_cache
from specgen.planning.measure import BATCH_CONTEXT_TOKENS, BATCH_WIDTHS
from specgen.planning.planner import chain_prefix, prefills


#: Tokens a row of a measured batch holds at most: its calibration context and the widest feed.
MEASURE_ROW_CONTEXT = BATCH_CONTEXT_TOKENS + BATCH_WIDTHS[-1] + 1


def batch_costs(pipe, size: int, *, refresh: bool = False) -> BatchCostTable:
    """The pipeline's batched cost table for batches of ``size`` rows (measured once per machine on
    batched caches of its target (:meth:`~specgen.models.target.Target.new_batch`), then cached; see :func:`specgen.planning.cost_cache.batch_cost_table`)."""
    return cost_cache.batch_cost_table(pipe.cost_subject(), size, lambda rows: pipe.target.new_batch(rows, MEASURE_ROW_CONTEXT),
                                  refresh=refresh)


def stand_in_costs(rows) -> BatchCostTable:
    """A batched table from the rows' single-request table, for a step run without one."""
    chain = next(row.request.planner.costs.chain for row in rows if row.request.planner.costs is not None)
    return BatchCostTable.from_chain(chain, max_width=len(chain))


def plan_rows(costs: BatchCostTable | None, live: list, draining: bool = False) -> dict[int, tuple[Proposal, float]]:
    """Plan and draft every row of ``live`` ((row index, Row) pairs); -> for each row with a
    drafter, its proposal and predicted tree tokens (0.0 for chains). Call inside the step's
    transaction: the drafters' sessions advance here. draining: no request waits for a free
    row, so the batch's end is what counts (:func:`specgen.planning.batch.token_values`)."""
    auto = [(r, row) for r, row in live if row.request.draft is not None and row.spec.gamma == AUTO]
    for _, row in auto:
        row.request.planner.load()
    if auto and costs is None:
        costs = stand_in_costs([row for _, row in auto])
    values = token_values(costs, [row.request.remaining for _, row in live], draining) if auto else []
    drafted, plans, budgets, prefilling = _plan_inputs(costs, live, values)
    if not auto:
        return drafted
    probing = [row.request.planner.history.probe_due for r, row in auto if budgets[r]]
    if probing and all(probing):  # a probe widens every row's forward: the batch probes once all rows are due
        plans = [replace(p, low=1) if r in budgets and budgets[r] else p for (r, _), p in zip(live, plans, strict=True)]
    lengths = plan_batch(costs, plans)
    sunk = 0.0
    for (r, row), plan, length in zip(live, plans, lengths, strict=True):  # draft
        if r in budgets:
            with row.ctx.clock.stage("draft"):
                drafted[r] = (row.request.draft.propose(length) if length else EMPTY), 0.0
            sunk += plan.draft(length)
    cut = truncate_batch(costs, [_drafted(row, plan, drafted.get(r), r in budgets)
                                 for (r, row), plan in zip(live, plans, strict=True)], sunk)
    for (r, row), keep in zip(live, cut, strict=True):
        if r in budgets:
            proposal = drafted[r][0]
            drafted[r] = chain_prefix(proposal, keep), 0.0
            if not keep and row.request.draft.shadows and r not in prefilling:  # a prefill round shadows nothing
                with row.ctx.clock.stage("draft"):
                    row.request.planner.shadow(row.request.draft, proposal)
    return drafted


def _plan_inputs(costs: BatchCostTable | None, live: list, values: list[float]):
    """-> (proposals of the fixed-γ rows, drafted now; every row's plan input; each auto row's budget;
    the auto rows whose round prefills, :func:`prefills`)."""
    drafted: dict[int, tuple[Proposal, float]] = {}
    plans: list[RowPlan] = []
    budgets: dict[int, int] = {}
    prefilling: set[int] = set()
    for j, (r, row) in enumerate(live):
        request, feed = row.request, len(row.request.target_cache.uncached(row.request.committed.tokens))
        value = values[j] if values else 1.0
        if request.draft is None:
            plans.append(RowPlan(feed=feed, value=value))
        elif row.spec.gamma != AUTO:
            with row.ctx.clock.stage("draft"):
                drafted[r] = request.planner.draft(request.draft, row.spec.gamma,
                                                   request.draft_room(row.ctx.target.context_length))
            size = len(drafted[r][0])
            plans.append(RowPlan((0.0,) * size, size, feed, value=value))
        else:
            planner = request.planner
            limit = min(planner.max_tokens, planner.costs.max_tokens, costs.widths[-1] - 1)
            if prefills(feed):
                prefilling.add(r)
            room = 0 if r in prefilling else request.draft_room(row.ctx.target.context_length)
            budgets[r] = budget = min(limit, room)
            plans.append(auto_row(planner.history, planner.costs, costs, budget, feed, value))
    return drafted, plans, budgets, prefilling


def _drafted(row, plan: RowPlan, drafted, auto: bool) -> DraftedRow:
    if drafted is None:
        return DraftedRow(feed=plan.feed, value=plan.value)
    proposal = drafted[0]
    size = len(proposal)
    if not auto:
        return DraftedRow((0.0,) * size, (0.0,) * size, size, plan.feed, plan.value)
    return drafted_row(row.request.planner.history, proposal.confidence, size, plan)
