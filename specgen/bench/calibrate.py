"""The speed model's cost terms, from the pipeline's cost table (:mod:`specgen.planning.measure`).

The planner and the bench use the same measurement: v(n) for chains and for
trees (n verified tokens = |T| + 1 for a tree of |T| nodes) and the drafting
cost, each over ``step_s`` (one target forward of 1 token), measured after an
untimed prefill and cached per model/dtype/device/threads.
``specgen-bench bench.show_costs=true`` prints the table;
``bench.remeasure_costs=true`` measures it again.
"""

from __future__ import annotations

from specgen.planning import CostTable


def from_cost_table(table: CostTable) -> dict:
    """``{step_s, v, v_tree: {n: ratio}, c, draft_fixed, context_tokens}`` for the speed model."""
    from specgen.planning.measure import CONTEXT_TOKENS

    return {"step_s": table.step_s, "v": {n + 1: r for n, r in enumerate(table.chain)},
            "v_tree": {n + 1: r for n, r in enumerate(table.tree)}, "c": table.draft_per_token,
            "draft_fixed": table.draft_fixed, "context_tokens": int(table.facts.get("context", CONTEXT_TOKENS))}


def verify_ratio(v: dict, num_tokens: float) -> float:
    """v at a fractional number of verified tokens, by linear interpolation (clamped to the measured range)."""
    table = {int(n): float(ratio) for n, ratio in v.items()}
    sizes = sorted(table)
    num_tokens = min(max(num_tokens, sizes[0]), sizes[-1])
    low = max(n for n in sizes if n <= num_tokens)
    high = min(n for n in sizes if n >= num_tokens)
    if low == high:
        return table[low]
    weight = (num_tokens - low) / (high - low)
    return table[low] * (1 - weight) + table[high] * weight
