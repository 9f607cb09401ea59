"""The round planner: how many draft tokens (or tree nodes) to verify this round.

Pure functions, no models. Inputs are a :class:`CostTable`
(measured by :mod:`specgen.planning.measure`), the drafter's own confidence numbers
for this round and the request's :class:`AcceptanceHistory`; the output is a
budget (0 = a plain step) or the number of drafted tokens to keep.

The objective is committed tokens per unit of cost. For a chain of k drafts with
estimated conditional acceptance a_1, a_2, ... (a_i: token i is accepted given
1..i-1 were), a round commits E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens and
costs draft + v(k + 1), in units of one single-token target forward.

Exactness (the non-anticipation rule). The planner never sees the target's
probabilities for the tokens being verified. Two legal forms are used:

* :func:`plan_budget` decides before drafting, from past rounds only;
* :func:`truncate_chain` keeps a prefix of the drafted chain. Whether token i
  is kept depends only on ``confidences[:i + 1]``, and a drafter's
  ``confidences[i]`` is computed from what it knew *before* drawing token i (for
  a sampling drafter: from q_i, never from the drawn token), so the kept length
  is a stopping time of the drafter's information. A deterministic drafter's
  tokens are functions of the committed context, so any rule is legal for it;
  :func:`truncate_tree` relies on that and only runs on deterministic trees.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from specgen.planning.costs import CostTable
from specgen.planning.acceptance import AcceptanceHistory, expected_tokens, planning_rates

#: The planner's setting in ``drafter.num_tokens``.
AUTO = "auto"


def plan_budget(costs: CostTable, history: AcceptanceHistory, max_tokens: int, *, tree_width: int = 1,
                online: bool = False) -> int:
    """Draft tokens (tree depth) to ask for before drafting; 0 = a plain step.

    Maximises E(k) / (draft(k) + v(1 + k)) with the history's per-position
    estimates. For a tree (``tree_width`` > 1) the estimates are per depth level
    and v is the tree table's: the cheapest tree reaching depth k has k nodes,
    and :func:`truncate_tree` keeps only the nodes that pay. When drafting is
    cheap (:func:`specgen.planning.costs.is_cheap`) the best estimate of any
    confidence bin is used (:func:`specgen.planning.acceptance.planning_rates`),
    because truncation after drafting removes what does not pay; a cheap chain
    drafter that reports confidences then drafts all ``max_tokens`` whenever any
    draft could pay, and :func:`truncate_chain` keeps what its confidences justify.
    ``online``: the drafter stops itself with a :class:`ChainStopper`, so once
    drafting pays it is asked for all ``max_tokens``. Whether to start is judged
    with the rates for its cost like any drafter's: its first token is drafted,
    and paid for, before the stopper can judge it.
    """
    if max_tokens <= 0:
        return 0
    history.price_probes(costs)
    cheap = costs.cheap
    gains = expected_tokens(planning_rates(history, max_tokens, cheap))
    best, best_rate = 0, 1.0 / costs.verify(1)
    for k in range(1, max_tokens + 1):
        rate = gains[k] / (costs.draft(k) + costs.verify(1 + k, tree=tree_width > 1))
        if rate > best_rate:
            best, best_rate = k, rate
    if best == 0 and history.probe_due and costs.ceiling(max_tokens, tree_width > 1) > 1.0:
        return 1  # a probe, unless no draft could pay even if always accepted (then it could only lose)
    if best and online and tree_width == 1:  # the stopper judges each token as it is drafted
        return max_tokens
    if best and cheap and tree_width == 1 and history.by_bin:  # truncation judges each drafted token
        return max_tokens
    return best


def pays_to_go_on(rates: Sequence[float], cost: Callable[[int], float], length: int, longest: int) -> bool:
    """The chain stopping rule: does some length in (``length``, ``longest``] commit more tokens
    per unit of ``cost(k)`` than stopping at ``length``? ``rates``: the per-position estimates
    (at least ``longest`` of them)."""
    gains = expected_tokens(rates)
    stop = gains[length] / cost(length)
    return any(gains[k] / cost(k) > stop for k in range(length + 1, longest + 1))


def truncate_chain(costs: CostTable, history: AcceptanceHistory, confidences: Sequence[float | None],
                   sunk: float = 0.0) -> int:
    """How many of the drafted chain's tokens to verify (a stopping rule, :func:`pays_to_go_on`).

    Token i is kept iff, with ``confidences[:i + 1]`` known and the history's
    estimates for later positions, some length > i beats stopping at i.
    sunk: the drafting cost already paid (part of every length's cost).
    """
    num = len(confidences)
    bases = history.bases(num)
    known: list[float] = []

    def cost(k: int) -> float:
        return sunk + costs.verify(k + 1)

    for i in range(num):
        known.append(history.estimate(i, confidences[i], bases[i]))
        if not pays_to_go_on(known + bases[i + 1:], cost, i, num):
            return 1 if i == 0 and history.probe_due else i
    return num


class ChainStopper:
    """:func:`truncate_chain`'s stopping rule, asked while a chain is drafted, so a drafter
    that pays per drafted token (a draft model) stops paying for drafts the rule would cut.

    The drafter calls :meth:`keep` with its confidence for token i (computed from
    q_i, before drawing token i) and draws token i only on True; after the draw,
    :meth:`more` says whether drafting token i + 1 can still pay. Both read only
    confidences already given and past rounds (through ``history``), so the drafted
    length is a stopping time of the drafter's information and exactness holds.
    A length k costs ``draft(max(k, drafted)) + v(k + 1)``: a draft computed and then
    cut is paid for all the same.
    """

    def __init__(self, costs: CostTable, history: AcceptanceHistory, budget: int):
        self.costs, self.history, self.budget = costs, history, budget
        self.bases = history.bases(budget)
        self.known: list[float] = []  # estimates of the kept tokens, from their confidences

    def _pays_to_go_on(self, rates: list[float], length: int, drafted: int) -> bool:
        """Does some chain longer than ``length`` beat stopping at ``length``, ``drafted`` drafts paid?"""
        return pays_to_go_on(rates, lambda k: self.costs.draft(max(k, drafted)) + self.costs.verify(k + 1),
                             length, self.budget)

    def keep(self, confidence: float | None) -> bool:
        """Draw and keep token ``i = len(known)`` (its draft already computed, so paid for)?"""
        i = len(self.known)
        if i >= self.budget:
            return False
        estimate = self.history.estimate(i, confidence, self.bases[i])
        if not self._pays_to_go_on(self.known + [estimate] + self.bases[i + 1:], i, i + 1):
            if not (i == 0 and self.history.probe_due):
                return False
        self.known.append(estimate)
        return True

    def more(self) -> bool:
        """Is drafting the next token (paying for it) still worth it, given the tokens kept?"""
        i = len(self.known)
        return i < self.budget and self._pays_to_go_on(self.known + self.bases[i:], i, i)


def truncate_tree(costs: CostTable, history: AcceptanceHistory, scores: Sequence[float], parents: Sequence[int],
                  sunk: float = 0.0) -> tuple[list[int], float]:
    """Nodes of a deterministic draft tree to verify: an ancestor-closed set, best scores first.

    scores[i]: the drafter's estimate that node i's whole path is accepted (e.g.
    EAGLE's cumulative draft probability). The kept count m maximises
    (1 + sum of calibrated path estimates) / (sunk + v_tree(m + 1)); a path
    estimate is ``score`` scaled by ``history.tree_scale`` (how well this
    drafter's scores predicted acceptance so far). Returns (kept node indices
    in increasing order ([] = a plain step), their unscaled score sum for
    :meth:`AcceptanceHistory.observe_tree`).
    """
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    frontier = [(-scores[i], i) for i in children.get(-1, [])]
    heapq.heapify(frontier)
    kept: list[int] = []  # best-first: a node becomes available once its parent is kept
    while frontier:
        _, node = heapq.heappop(frontier)
        kept.append(node)
        for child in children.get(node, []):
            heapq.heappush(frontier, (-scores[child], child))
    scale = history.tree_scale
    best, best_rate, total, raw = 0, 1.0 / (sunk + costs.verify(1, tree=True)), 1.0, [0.0]
    for m, node in enumerate(kept, start=1):
        total += min(1.0, scale * scores[node])
        raw.append(raw[-1] + min(1.0, scores[node]))
        rate = total / (sunk + costs.verify(m + 1, tree=True))
        if rate > best_rate:
            best, best_rate = m, rate
    if best == 0 and kept and history.probe_due:
        best = 1
    return sorted(kept[:best]), raw[best]
