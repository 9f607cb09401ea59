"""Planning: how many draft tokens each round (or each row of a batched step) verifies.

Pure modules (no models): :mod:`~specgen.planning.costs` (cost tables, single
and batched, one interpolation and draft-cost core), :mod:`~specgen.planning.acceptance`
(a request's acceptance estimates), :mod:`~specgen.planning.chain` (the round
planner and its stopping rule), :mod:`~specgen.planning.batch` (the batch
planner) and :mod:`~specgen.planning.fit` (the batched table's fit). A request's
:class:`~specgen.planning.planner.Planner` (:mod:`~specgen.planning.planner`) holds its
planning state and asks those. Measuring touches a model through the target protocol
only: :mod:`~specgen.planning.measure` (timings), :mod:`~specgen.planning.calibration`
(the draft session it times) and :mod:`~specgen.planning.cost_cache` (memory, disk
cache, fixed table); import those, and the planner, explicitly.
"""

from specgen.planning.batch import (DraftedRow, RowPlan, auto_row, batch_cost, batch_rate, drafted_row, plan_batch,
                                    token_values, truncate_batch)
from specgen.planning.chain import AUTO, ChainStopper, pays_to_go_on, plan_budget, truncate_chain, truncate_tree
from specgen.planning.costs import BatchCostTable, CostTable, draft_cost, interpolate, is_cheap
from specgen.planning.acceptance import AcceptanceHistory, expected_tokens, planning_rates

__all__ = [
    "AUTO", "AcceptanceHistory", "BatchCostTable", "ChainStopper", "CostTable", "DraftedRow", "RowPlan", "auto_row",
    "batch_cost", "batch_rate", "draft_cost", "drafted_row", "expected_tokens", "interpolate", "is_cheap",
    "pays_to_go_on", "plan_batch", "plan_budget", "planning_rates", "token_values", "truncate_batch",
    "truncate_chain", "truncate_tree",
]
