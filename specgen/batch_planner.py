"""The batch planner: how many draft tokens each row of a batched step verifies.

Pure functions and data, no models (the batched counterpart of :mod:`specgen.planner`).
A batched step runs ONE target forward over every row's feed, padded to the widest
feed (see :mod:`specgen.batch`). Linear layers skip the padding where they can
(:func:`specgen.models.packed_linear.real_tokens`), attention does not: so a row's
draft length is not its own business, since one row drafting 8 tokens makes every
row's attention 9 queries wide. The step's cost, in units of one single-row
single-token forward (``step_s``), is

    verify(B, w, K, T) + sum_i draft_i(k_i) + sunk

for B rows, width w = max_i(feed_i + k_i), T = sum_i (feed_i + k_i) real tokens,
K = sum_i (k_i + 1) logits rows (:class:`BatchCostTable`, measured by
:func:`specgen.costmodel.measure_batch`: uniform and ragged forwards), and
it commits sum_i E_i(k_i) tokens in expectation (E_i from row i's own
per-position acceptance estimates, :func:`specgen.planner.expected_tokens`).
:func:`plan_batch` chooses the k_i that maximise committed tokens per unit of cost.
All k_i = 0 (a plain batched step) is always a candidate, so a plan is never
expected to be slower than plain batched decoding under the table.

Exactness is per row, as in :mod:`specgen.planner`: row i's length may depend on
past rounds, on its own drafter's confidences for tokens it has not drawn yet
(:func:`truncate_batch` decides token t from ``confidences[:t + 1]`` of every
row), and on other rows' drafts (independent of row i's target draws), never on
the target's probabilities for the tokens being verified.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from specgen.planner import expected_tokens


@dataclass(frozen=True)
class BatchCostTable:
    """Measured costs of batched verify forwards, in units of one 1-row 1-token forward (``step_s`` seconds).

    body[i][j]: a forward of sizes[i] rows, widths[j] tokens each, one logits row per row,
    with ``slots[0]`` slots in the shared cache.
    head: each further logits row (a row verifying k drafts reads k + 1).
    wide, slots: where measured, the same forwards with ``slots[1]`` shared slots (a forward's
    attention and cache append grow with the shared width); :meth:`at` interpolates between.
    ragged[i][j]: where measured, the forward of sizes[i] rows where one row feeds widths[j]
    tokens and the others one each (padded to widths[j]: linear layers skip the padding,
    attention does not), on ``slots[0]`` slots. Between that and ``body``, a forward's cost is
    linear in its real tokens (:meth:`verify`'s ``tokens``).
    facts: what the table was measured on (the cache key).
    """

    sizes: tuple[int, ...]
    widths: tuple[int, ...]
    body: tuple[tuple[float, ...], ...]
    head: float = 0.0
    step_s: float = 0.0
    facts: dict = field(default_factory=dict, compare=False)
    wide: tuple[tuple[float, ...], ...] = ()
    slots: tuple[int, ...] = ()
    ragged: tuple[tuple[float, ...], ...] = ()

    def at(self, slots: int) -> BatchCostTable:
        """The table for a shared cache ``slots`` wide: each entry linear in the width between the
        two measured ones (continued past the wider one, never below the narrower one's entry);
        the table itself when only one width was measured."""
        if not self.wide or len(self.slots) != 2 or self.slots[1] <= self.slots[0]:
            return self
        share = max(0.0, (slots - self.slots[0]) / (self.slots[1] - self.slots[0]))
        body = tuple(tuple(max(n, n + (w - n) * share) for n, w in zip(narrow, wide, strict=True))
                     for narrow, wide in zip(self.body, self.wide, strict=True))
        ragged = ()
        if self.ragged:  # padding saves the same at any width: shift by what the slots add
            ragged = tuple(tuple(r + (b - n) for r, n, b in zip(line, narrow, wide_line, strict=True))
                           for line, narrow, wide_line in zip(self.ragged, self.body, body, strict=True))
        return BatchCostTable(self.sizes, self.widths, body, self.head, self.step_s, self.facts, ragged=ragged)

    def verify(self, rows: int, width: int, logits_rows: int | None = None, tokens: int | None = None) -> float:
        """Cost of one batched forward of ``rows`` rows ``width`` tokens wide, ``tokens`` of them
        real (default: all, rows x width; at least rows - 1 + width), reading ``logits_rows``
        logits rows (default: one per row); bilinear in (rows, width), linear past the table."""
        rows, width = max(1, rows), max(1, width)
        extra = 0 if logits_rows is None else max(0, logits_rows - rows)
        padded = self._cell(self.body, rows, width)
        if tokens is not None:
            padded -= self.padding_saving(rows, width, padded) * (rows * width - max(tokens, rows - 1 + width))
        return padded + self.head * extra

    def padding_saving(self, rows: int, width: int, padded: float | None = None) -> float:
        """What each padded (not real) token of a ``rows`` x ``width`` forward saves against a real
        one: 0 without a ragged table or where padding saves nothing measurable. padded: that
        forward's uniform cost when the caller has it."""
        rows, width = max(1, rows), max(1, width)
        span = (rows - 1) * (width - 1)  # rows x width minus the ragged shape's rows - 1 + width tokens
        if not self.ragged or not span:
            return 0.0
        padded = self._cell(self.body, rows, width) if padded is None else padded
        return max(0.0, padded - self._cell(self.ragged, rows, width)) / span

    def _cell(self, table: tuple[tuple[float, ...], ...], rows: int, width: int) -> float:
        """``table`` (sizes x widths) at (rows, width), bilinear, linear past either end."""
        return _linear(self.sizes, [_linear(self.widths, line, width) for line in table], rows)

    @classmethod
    def from_chain(cls, chain: Sequence[float], sizes: Sequence[int] = (1, 2, 4, 8), max_width: int = 9,
                   step_s: float = 0.0) -> BatchCostTable:
        """A stand-in when only a single-row table is known: B rows of w tokens cost what one row of
        B * w tokens does (``chain`` is v(n) for n = 1.., continued linearly)."""

        def v(n: int) -> float:
            if n <= len(chain):
                return chain[n - 1]
            slope = max(chain[-1] - chain[-2], 0.0) if len(chain) > 1 else chain[-1]
            return chain[-1] + slope * (n - len(chain))

        widths = tuple(range(1, max_width + 1))
        body = tuple(tuple(v(b * w) for w in widths) for b in sizes)
        return cls(tuple(sizes), widths, body, 0.0, step_s)


def _linear(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys) (xs increasing), continued linearly past either end."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


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
        return self.draft_fixed + self.draft_per_token * k if k > 0 else 0.0


def batch_cost(costs: BatchCostTable, rows: Sequence[RowPlan], lengths: Sequence[int], sunk: float = 0.0) -> float:
    """The step's cost with row i verifying lengths[i] drafts."""
    width = max(row.feed + k for row, k in zip(rows, lengths, strict=True))
    tokens = sum(row.feed + k for row, k in zip(rows, lengths, strict=True))
    verify = costs.verify(len(rows), width, sum(k + 1 for k in lengths), tokens)
    return verify + sunk + sum(row.draft(k) for row, k in zip(rows, lengths, strict=True))


def batch_rate(costs: BatchCostTable, rows: Sequence[RowPlan], lengths: Sequence[int], sunk: float = 0.0) -> float:
    """Expected committed tokens (each weighted by its row's value) per unit of cost of the plan ``lengths``."""
    gained = sum(row.value * expected_tokens(row.rates[:k])[k] for row, k in zip(rows, lengths, strict=True))
    return gained / batch_cost(costs, rows, lengths, sunk)


def plan_batch(costs: BatchCostTable, rows: Sequence[RowPlan], sunk: float = 0.0) -> list[int]:
    """Drafts to verify per row (0 = a plain row) maximising the batch's committed tokens per cost.

    For every width the batch could have, each row's length is chosen by Dinkelbach's
    iteration (given the width the cost is a constant plus per-row terms: a row's drafting,
    its logits rows and its real tokens, so each row on its own maximises expected tokens
    minus rate x its own cost); the best width wins. Ties keep the shorter plan:
    speculation must pay to be chosen.
    """
    if not rows:
        return []
    if any(row.low > len(row.rates) for row in rows):
        raise ValueError("a row's low exceeds its drafts")
    gains = [[row.value * e for e in expected_tokens(row.rates)] for row in rows]
    size, head = len(rows), costs.head

    def rate_of(lengths: list[int]) -> float:
        width = max(row.feed + k for row, k in zip(rows, lengths))
        tokens = sum(row.feed + k for row, k in zip(rows, lengths))
        cost = costs.verify(size, width, tokens=tokens) + sunk
        return sum(gain[k] for gain, k in zip(gains, lengths)) / \
            (cost + sum(head * k + row.draft(k) for row, k in zip(rows, lengths)))

    best = [row.low for row in rows]
    best_rate = rate_of(best)
    floor = max(row.feed + row.low for row in rows)
    ceiling = max(row.feed + len(row.rates) for row in rows)
    for width in range(floor, ceiling + 1):
        rate, lengths = best_rate, best
        per_token = head + costs.padding_saving(size, width)  # a real token's cost over a padded one
        for _ in range(8):  # Dinkelbach: converges in a few steps
            chosen = []
            for row, gain in zip(rows, gains):
                top, pick = None, row.low
                for k in range(row.low, min(len(row.rates), width - row.feed) + 1):
                    value = gain[k] - rate * (row.draft(k) + per_token * k)
                    if top is None or value > top + 1e-12:
                        top, pick = value, k
                chosen.append(pick)
            new = rate_of(chosen)
            if new <= rate * (1 + 1e-9):
                break
            rate, lengths = new, chosen
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = lengths, rate
    return list(best)


def token_values(costs: BatchCostTable, remaining: Sequence[int], draining: bool) -> list[float]:
    """What one committed token of each row is worth, for :attr:`RowPlan.value`.

    While requests wait for a free row (``draining`` False) every row's token is worth the
    same: a row that finishes early is refilled, so the batch's throughput is what counts.
    When nothing waits, the batch ends with its *laggards*, the rows with the most tokens
    still to make (``remaining``: each row's budget left). A token of a row ahead of them
    only frees that row one step sooner, worth the marginal cost of a row in a plain step
    (``verify(B, 1) - verify(B - 1, 1)``); a token of one of n tied laggards brings the end
    1/n step closer, worth ``verify(n, 1) / n``. Both are in units of an average token of a
    plain step, ``verify(B, 1) / B``, so all rows tied is the same as not draining. Without
    this, a batch of 7 equal-length requests sped up the rows that prompt lookup matched,
    which then idled in the batch while the rest finished: 0.85-0.95x a plain batch.
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
