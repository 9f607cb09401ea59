"""Verify costs as this process sees them: a running correction of the cost table's chain.

The cost table (:mod:`specgen.planning.measure`) times each forward width back to back
on a synthetic context, once per machine. Inside a run the same forwards can cost
another multiple of the 1-token forward: other host work runs between them, the
machine's load and its caches differ. :class:`ObservedCosts` watches a pipeline's
chain verify forwards (seconds of a forward that fed exactly n tokens, nothing
uncached before them) and rescales the table's verify *excess* v(n) - 1:

    s = sum_w (t_n / t_1 - 1) / sum_w (v(n) - 1),
    v'(n) = 1 + s (v(n) - 1),

where t_1 is the running mean of 1-token forwards and both sums start at ``prior``
(pseudo-evidence of s = 1, in units of the table's excess) and forget with
``decay`` per sample, so s stays at 1 until forwards wider than one token have been
seen and then follows them alone. One sample's ratio is clipped to
[1, ``clip`` * v(n)] so a stall cannot swing the plan. Only the chain's verify
cells change; the tree cells, draft costs and overhead stay as measured.

Exactness: a forward's time depends on its shape, not on the values the target
computes, and only forwards of past rounds are observed, so plans read from the
corrected table stay non-anticipating (see :mod:`specgen.planning.chain`). The
plans do depend on timings: a fixed table (``$SPECGEN_COST_TABLE``) or
``observe_costs=false`` turns the correction off for reproducible plans.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specgen.planning.costs import CostTable


@dataclass
class ObservedCosts:
    """Running verify timings of one pipeline (state shared by its requests, see the module docstring).

    decay: forgetting per wide sample; step_decay: forgetting per 1-token sample (faster,
    so a machine that speeds up or slows down moves t_1 within a few rounds).
    warm: 1-token samples before wider ones count. resolution: the scale is rounded to
    this step before a corrected table is built (one table per step, reused).
    """

    decay: float = 0.97
    step_decay: float = 0.8
    prior: float = 1.0
    clip: float = 3.0
    warm: int = 4
    resolution: float = 0.02
    step_s: float = field(default=0.0, init=False)  # t_1, seconds
    steps: int = field(default=0, init=False)  # 1-token forwards seen
    wide: int = field(default=0, init=False)  # wider forwards counted
    observed_excess: float = field(init=False)  # the sums of the module docstring
    table_excess: float = field(init=False)
    _cached: tuple[CostTable, float, CostTable] | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.observed_excess = self.table_excess = self.prior

    def observe(self, width: int, seconds: float, table: CostTable | None) -> None:
        """A chain verify forward that fed exactly ``width`` tokens and took ``seconds``; ``table``:
        the one the round planned from (None: only a 1-token forward can count)."""
        if width < 1 or seconds <= 0:
            return
        if width == 1:
            if self.steps >= self.warm:
                seconds = min(seconds, 2.0 * self.step_s)  # a stall is not the machine's speed
            share = max(1.0 - self.step_decay, 1.0 / (self.steps + 1))
            self.step_s += share * (seconds - self.step_s)
            self.steps += 1
            return
        if table is None or self.steps < self.warm or width > len(table.chain):
            return
        expected = table.chain[width - 1]
        ratio = min(max(seconds / self.step_s, 1.0), self.clip * expected)
        self.observed_excess = self.observed_excess * self.decay + ratio - 1.0
        self.table_excess = self.table_excess * self.decay + max(expected - 1.0, 0.0)
        self.wide += 1

    @property
    def scale(self) -> float:
        """s: observed over tabled verify excess (1 while only the prior speaks)."""
        return self.observed_excess / self.table_excess if self.table_excess > 0 else 1.0

    def table(self, table: CostTable) -> CostTable:
        """``table`` with its chain's excess scaled by :attr:`scale` (rounded to ``resolution``)."""
        scale = round(self.scale / self.resolution) * self.resolution
        if abs(scale - 1.0) < self.resolution / 2:
            return table
        cached = self._cached
        if cached is not None and cached[0] is table and cached[1] == scale:
            return cached[2]
        chain = tuple(1.0 + scale * (v - 1.0) if n else v for n, v in enumerate(table.chain))
        corrected = dataclasses.replace(table, chain=chain)
        self._cached = (table, scale, corrected)
        return corrected


def describe_observed(observed: ObservedCosts) -> str:
    """One line for humans: what the run's own verify forwards showed against the table."""
    return (f"verify forwards in the run: 1-token {1e3 * observed.step_s:.2f} ms (running mean of "
            f"{observed.steps}); v(n) - 1 x{observed.scale:.2f} of the table's ({observed.wide} wider forwards)")
