"""The batch planner: how many draft tokens each row of a batched step verifies.

Pure functions and data, no models (the batched counterpart of :mod:`specgen.planning.chain`).
A batched step runs ONE target forward over every row's feed (see :mod:`specgen.batch`).
Where the rows share one cache width (torch) the real tokens are computed alone
(:class:`specgen.models.attention.BatchRows`) but every row gains the widest feed's
slots: so a row's draft length is not its own business, since one row drafting 8 tokens
widens every row's cache by 9 slots. The step's cost, in units of one single-row
single-token forward (``step_s``), is

    verify(B, w, K, T) + sum_i draft_i(k_i) + sunk

for B rows, width w = max_i(feed_i + k_i), T = sum_i (feed_i + k_i) real tokens,
K = sum_i (k_i + 1) logits rows (:class:`BatchCostTable`, measured by
:func:`specgen.planning.measure.measure_batch`: uniform and ragged forwards), and
it commits sum_i E_i(k_i) tokens in expectation (E_i from row i's own
per-position acceptance estimates, :func:`specgen.planning.acceptance.expected_tokens`).
:func:`plan_batch` chooses the k_i that maximise committed tokens per unit of cost, pricing
every candidate with :func:`batch_rate` (:func:`batch_cost`).
All k_i = 0 (a plain batched step) is always a candidate, so a plan is never
expected to be slower than plain batched decoding under the table.

Exactness is per row, as in :mod:`specgen.planning.chain`: row i's length may depend on
past rounds, on its own drafter's confidences for tokens it has not drawn yet
(:func:`truncate_batch` decides token t from ``confidences[:t + 1]`` of every
row), and on other rows' drafts (independent of row i's target draws), never on
the target's probabilities for the tokens being verified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specgen.planning.costs import BatchCostTable, CostTable, draft_cost
from specgen.planning.acceptance import AcceptanceHistory, expected_tokens, planning_rates


@dataclass(frozen=True)
class RowPlan:
    """One row's planning inputs.

    rates: estimated P(draft at position t accepted | the earlier ones were), for every
    position the row may verify (len(rates) = its most drafts; [] = a plain row).
    low: drafts the row verifies at least (a probe, a fixed γ, tokens already kept).
    feed: committed tokens it feeds before its drafts (its uncached ones; usually 1).
    draft_fixed / draft_per_token: what drafting k > 0 tokens costs this row (0 once drafted).
    value: what one committed token of this row is worth against another row's (1: tokens are
    interchangeable, as when requests wait for a free row; see :func:`token_values`).
    """

    rates: tuple[float, ...] = ()
    low: int = 0
    feed: int = 1
    draft_fixed: float = 0.0
    draft_per_token: float = 0.0
    value: float = 1.0

    def draft(self, k: int) -> float:
        return draft_cost(self.draft_fixed, self.draft_per_token, k)


def batch_cost(costs: BatchCostTable, rows: Sequence[RowPlan], lengths: Sequence[int], sunk: float = 0.0) -> float:
    """The step's cost with row i verifying lengths[i] drafts."""
    width = max(row.feed + k for row, k in zip(rows, lengths, strict=True))
    tokens = sum(row.feed + k for row, k in zip(rows, lengths, strict=True))
    verify = costs.verify(len(rows), width, sum(k + 1 for k in lengths), tokens)
    return verify + sunk + sum(row.draft(k) for row, k in zip(rows, lengths, strict=True))


def row_gains(rows: Sequence[RowPlan]) -> list[list[float]]:
    """gains[i][k]: row i's expected committed tokens with k drafts, weighted by its value."""
    return [[row.value * e for e in expected_tokens(row.rates)] for row in rows]


def batch_rate(costs: BatchCostTable, rows: Sequence[RowPlan], lengths: Sequence[int], sunk: float = 0.0,
               gains: Sequence[Sequence[float]] | None = None) -> float:
    """Expected committed tokens (each weighted by its row's value) per unit of cost of the plan ``lengths``.
    gains: :func:`row_gains` of ``rows`` when the caller has it."""
    gains = row_gains(rows) if gains is None else gains
    gained = sum(gain[k] for gain, k in zip(gains, lengths, strict=True))
    return gained / batch_cost(costs, rows, lengths, sunk)


def plan_batch(costs: BatchCostTable, rows: Sequence[RowPlan], sunk: float = 0.0) -> list[int]:
    """Drafts to verify per row (0 = a plain row) maximising the batch's committed tokens per cost.

    For every width the batch could have, each row's length is chosen by Dinkelbach's
    iteration (given the width the cost is a constant plus per-row terms: a row's drafting,
    its logits rows and its real tokens, so each row on its own maximises expected tokens
    minus rate x its own cost); the best width wins. Every candidate is priced by
    :func:`batch_rate`. Ties keep the shorter plan: speculation must pay to be chosen.
    """
    if not rows:
        return []
    if any(row.low > len(row.rates) for row in rows):
        raise ValueError("a row's low exceeds its drafts")
    gains = row_gains(rows)
    size = len(rows)
    best = [row.low for row in rows]
    best_rate = batch_rate(costs, rows, best, sunk, gains)
    floor = max(row.feed + row.low for row in rows)
    ceiling = max(row.feed + len(row.rates) for row in rows)
    for width in range(floor, ceiling + 1):
        rate, lengths = best_rate, best
        per_token = costs.head + costs.padding_saving(size, width)  # a real token's cost over a padded one
        for _ in range(8):  # Dinkelbach: converges in a few steps
            chosen = [_best_length(row, gain, width, rate, per_token) for row, gain in zip(rows, gains)]
            new = batch_rate(costs, rows, chosen, sunk, gains)
            if new <= rate * (1 + 1e-9):
                break
            rate, lengths = new, chosen
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = lengths, rate
    return list(best)


def _best_length(row: RowPlan, gain: Sequence[float], width: int, rate: float, per_token: float) -> int:
    """Row's length within ``width`` maximising its gain minus ``rate`` x its own cost (ties: shorter)."""
    top, pick = None, row.low
    for k in range(row.low, min(len(row.rates), width - row.feed) + 1):
        value = gain[k] - rate * (row.draft(k) + per_token * k)
        if top is None or value > top + 1e-12:
            top, pick = value, k
    return pick


def token_values(costs: BatchCostTable, remaining: Sequence[int], draining: bool) -> list[float]:
    """What one committed token of each row is worth, for :attr:`RowPlan.value`.

    While requests wait for a free row (``draining`` False) every row's token is worth the
    same: a row that finishes early is refilled, so the batch's throughput is what counts.
    When nothing waits, the batch ends with its *laggards*, the rows with the most tokens
    still to make (``remaining``: each row's budget left). A token of a row ahead of them
    only frees that row one step sooner, worth the marginal cost of a row in a plain step
    (``verify(B, 1) - verify(B - 1, 1)``); a token of one of n tied laggards brings the end
    1/n step closer, worth ``verify(n, 1) / n``. Both are in units of an average token of a
    plain step, ``verify(B, 1) / B``, so all rows tied is the same as not draining.
    The values read only budgets and the table, never a target probability.
    """
    size = len(remaining)
    if not draining or size < 2:
        return [1.0] * size
    plain = costs.verify(size, 1)
    if plain <= 0:
        return [1.0] * size
    average = plain / size
    top = max(remaining)
    laggards = sum(r == top for r in remaining)
    ahead = max(0.0, plain - costs.verify(size - 1, 1)) / average
    behind = costs.verify(laggards, 1) / laggards / average
    return [behind if r == top else min(ahead, behind) for r in remaining]


@dataclass(frozen=True)
class DraftedRow:
    """A row after drafting.

    known[t]: the estimate for drafted token t given the drafter's confidence for it
    (computed before token t was drawn); later[t]: the history-only estimate for position t.
    low: tokens kept whatever happens (a probe, a fixed γ). feed, value: as :class:`RowPlan`.
    """

    known: tuple[float, ...] = ()
    later: tuple[float, ...] = ()
    low: int = 0
    feed: int = 1
    value: float = 1.0


def truncate_batch(costs: BatchCostTable, rows: Sequence[DraftedRow], sunk: float = 0.0) -> list[int]:
    """How many drafted tokens each row verifies: a stopping rule run depth by depth.

    At depth t each row still extending keeps token t iff the best plan
    (:func:`plan_batch`) over lengths >= what is kept, with its ``known[:t + 1]`` and
    ``later`` estimates past t, gives it more than t tokens; a row that stops stays
    stopped. Whether row i keeps token t thus depends on its confidences up to t only
    (and on other rows, independent of it): a stopping time of the drafter's
    information. ``sunk``: drafting already paid (part of every plan's cost).
    """
    kept = [min(row.low, len(row.known)) for row in rows]
    going = [len(row.known) > kept[i] for i, row in enumerate(rows)]
    depth = 0
    while any(going):
        plans = []
        for i, row in enumerate(rows):
            if going[i]:
                seen = max(depth + 1, kept[i])  # a row's confidences used so far
                plans.append(RowPlan(row.known[:seen] + row.later[seen: len(row.known)], kept[i], row.feed,
                                     value=row.value))
            else:
                plans.append(RowPlan(row.known[: kept[i]], kept[i], row.feed, value=row.value))
        lengths = plan_batch(costs, plans, sunk)
        for i, row in enumerate(rows):
            if going[i] and kept[i] == depth:  # row i decides token t = depth now
                if lengths[i] > depth:
                    kept[i] = depth + 1
                    going[i] = kept[i] < len(row.known)
                else:
                    going[i] = False
        depth += 1
    return kept


def auto_row(history: AcceptanceHistory, single: CostTable, costs: BatchCostTable, budget: int, feed: int,
             value: float = 1.0) -> RowPlan:
    """The plan input of a row with num_tokens="auto" and ``budget`` drafts at most: the history's
    estimates (:func:`planning_rates`, cheap by its single-request table) and its drafting cost,
    rescaled from ``single``'s unit to ``costs``'."""
    rates = tuple(planning_rates(history, budget, single.cheap))
    scale = single.step_s / costs.step_s if single.step_s and costs.step_s else 1.0
    return RowPlan(rates, 0, feed, single.draft_fixed * scale, single.draft_per_token * scale, value)


def drafted_row(history: AcceptanceHistory, confidence: Sequence[float | None] | None, size: int,
                plan: RowPlan) -> DraftedRow:
    """An auto row after drafting ``size`` tokens with ``confidence`` (None: none reported)."""
    confidence = confidence or [None] * size
    later = tuple(history.bases(size))
    known = tuple(history.estimate(t, confidence[t], later[t]) for t in range(size))
    return DraftedRow(known, later, min(plan.low, size), plan.feed, plan.value)
