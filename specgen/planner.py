"""The round planner: how many draft tokens (or tree nodes) to verify this round.

Pure functions and small state, no models. Inputs are a :class:`CostTable`
(measured by :mod:`specgen.costmodel`), the drafter's own confidence numbers
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
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

#: The planner's setting in ``drafter.num_tokens``.
AUTO = "auto"


@dataclass(frozen=True)
class CostTable:
    """Measured costs, in units of one target forward of 1 token (``step_s`` seconds).

    chain[n - 1]: a target forward verifying n tokens as a chain (chain[0] == 1).
    tree[n - 1]: the same for a tree forward over n tokens (root + n - 1 nodes).
    draft_fixed / draft_per_token: a proposal of m tokens costs
        draft_fixed + m * draft_per_token.
    overhead: the rest of a round (processing, commit), per verified token.
    facts: what the table was measured on (the cache key).
    """

    chain: tuple[float, ...]
    tree: tuple[float, ...]
    draft_fixed: float = 0.0
    draft_per_token: float = 0.0
    overhead: float = 0.0
    step_s: float = 0.0
    facts: dict = field(default_factory=dict, compare=False)

    def verify(self, num_tokens: int, tree: bool = False) -> float:
        """Cost of verifying ``num_tokens`` tokens; linear extrapolation past the table."""
        table = self.tree if tree and self.tree else self.chain
        n = max(1, int(num_tokens))
        if n <= len(table):
            base = table[n - 1]
        else:
            slope = table[-1] - table[-2] if len(table) > 1 else table[-1]
            base = table[-1] + max(slope, 0.0) * (n - len(table))
        return base + self.overhead * n

    def draft(self, num_tokens: int) -> float:
        return self.draft_fixed + self.draft_per_token * num_tokens if num_tokens > 0 else 0.0

    @property
    def max_tokens(self) -> int:
        return len(self.chain)


class _Rate:
    """An acceptance rate estimate with exponential forgetting: (accepted + w a0) / (seen + w)."""

    __slots__ = ("accepted", "seen")

    def __init__(self):
        self.accepted = 0.0
        self.seen = 0.0

    def add(self, accepted: bool, decay: float) -> None:
        self.accepted = self.accepted * decay + float(accepted)
        self.seen = self.seen * decay + 1.0

    def mean(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.seen + weight)


@dataclass
class AcceptanceHistory:
    """Running acceptance estimates of one request (non-anticipating: past rounds only).

    Per draft position, and per confidence bin (confidence in [0, 1], ``bins``
    equal bins). An estimate for (position, confidence) shrinks the bin's rate
    towards the position's rate, which shrinks towards the previous position's
    estimate (position 0: towards ``prior``), so a position never drafted yet
    starts from what its predecessor showed, not from a fixed guess.
    ``plain_streak`` counts rounds since the last verified draft: after
    ``probe_every`` of them a round keeps one token, so estimates can recover;
    a rejected probe doubles ``probe_every`` (up to 256), an accepted one resets it.
    Probes are also spaced by their price: ``probe_gap`` (set by :func:`plan_budget`
    from the cost table) keeps a rejected probe's extra cost under ``probe_share``
    of the plain steps between probes, so probing alone can never slow a request
    down by more than that share.
    """

    prior: float = 0.5
    weight: float = 2.0
    decay: float = 0.97
    bins: int = 10
    probe_every: int = 8
    base_probe_every: int = 8
    probe_share: float = 0.02
    probe_gap: int = 0
    positions: list[_Rate] = field(default_factory=list)
    by_bin: dict[int, _Rate] = field(default_factory=dict)
    tree_predicted: float = 0.0
    tree_accepted: float = 0.0
    plain_streak: int = 0
    rounds: int = 0

    def _position(self, i: int) -> _Rate:
        while len(self.positions) <= i:
            self.positions.append(_Rate())
        return self.positions[i]

    def _bin(self, confidence: float) -> int:
        return min(self.bins - 1, max(0, int(confidence * self.bins)))

    def bases(self, count: int) -> list[float]:
        """The confidence-free estimates of positions 0 .. count - 1 (each shrinks to its predecessor's)."""
        out, prior = [], self.prior
        for position in range(count):
            prior = self.positions[position].mean(prior, self.weight) if position < len(self.positions) else prior
            out.append(prior)
        return out

    def estimate(self, position: int, confidence: float | None = None, base: float | None = None) -> float:
        """Estimated P(draft at 0-based ``position`` accepted | the ones before were).

        With a confidence, its bin's rate shrinks towards the midpoint of the position's
        estimate and the drafter's own claim (the confidence itself): a bin never verified
        yet (a long n-gram match, a confident draft model) starts from what the drafter
        says, tempered by the position's record, instead of from the position's record alone.
        ``base``: the position's estimate when the caller has it (:meth:`bases`)."""
        base = self.bases(position + 1)[position] if base is None else base
        if confidence is None:
            return base
        claim = (base + min(max(confidence, 0.0), 1.0)) / 2
        rate = self.by_bin.get(self._bin(confidence))
        return claim if rate is None else rate.mean(claim, self.weight)

    def observe(self, confidences: Sequence[float | None], num_accepted: int) -> None:
        """A verified chain (or a tree's depth levels): draft i was reached iff i <= num_accepted."""
        self.rounds += 1
        if confidences and self.probe_due:  # a probe: back off while probes fail
            self.probe_every = self.base_probe_every if num_accepted else min(2 * self.probe_every, 256)
        self.plain_streak = 0 if confidences else self.plain_streak + 1
        for i, confidence in enumerate(confidences):
            if i > num_accepted:
                break
            accepted = i < num_accepted
            self._position(i).add(accepted, self.decay)
            if confidence is not None:
                self.by_bin.setdefault(self._bin(confidence), _Rate()).add(accepted, self.decay)

    def observe_tree(self, predicted: float, num_accepted: int, depth: int) -> None:
        """A verified tree: ``predicted`` accepted tokens (sum of its kept path estimates), and what came."""
        self.observe([None] * depth, num_accepted)
        self.tree_predicted = self.tree_predicted * self.decay + predicted
        self.tree_accepted = self.tree_accepted * self.decay + num_accepted

    @property
    def tree_scale(self) -> float:
        """Accepted over predicted tokens of past trees (1 with no evidence): calibrates tree scores."""
        return (self.tree_accepted + self.weight) / (self.tree_predicted + self.weight)

    def optimistic(self, position: int, base: float | None = None) -> float:
        """The best estimate any confidence could give ``position``: once the drafter has reported
        confidences, every bin counts (an unseen one at its centre), so a cheap drafter keeps
        drafting and truncation judges each draft by its own confidence."""
        base = self.bases(position + 1)[position] if base is None else base
        if not self.by_bin:
            return base
        return max([base] + [self.estimate(position, (b + 0.5) / self.bins, base) for b in range(self.bins)])

    @property
    def probe_due(self) -> bool:
        return self.plain_streak >= max(self.probe_every, self.probe_gap)

    def price_probes(self, costs: CostTable) -> None:
        """Space probes so a rejected one (verifying one extra token) costs at most ``probe_share``."""
        extra = costs.draft(1) + costs.verify(2) - costs.verify(1)
        self.probe_gap = math.ceil(max(0.0, extra) / self.probe_share - 1e-9) if self.probe_share > 0 else 0


def expected_tokens(rates: Sequence[float]) -> list[float]:
    """E[committed tokens] for k = 0..len(rates) drafts: 1 + sum_i prod_{j<=i} rates[j]."""
    out, survive, total = [1.0], 1.0, 1.0
    for rate in rates:
        survive *= min(max(rate, 0.0), 1.0)
        total += survive
        out.append(total)
    return out


def plan_budget(costs: CostTable, history: AcceptanceHistory, max_tokens: int, *, tree_width: int = 1,
                online: bool = False) -> int:
    """Draft tokens (tree depth) to ask for before drafting; 0 = a plain step.

    Maximises E(k) / (draft(k) + v(1 + k)) with the history's per-position
    estimates. For a tree (``tree_width`` > 1) the estimates are per depth level
    and v is the tree table's: the cheapest tree reaching depth k has k nodes,
    and :func:`truncate_tree` keeps only the nodes that pay. When drafting is
    cheap (under 0.1 of a forward per token) the best estimate of any confidence
    bin is used, because truncation after drafting removes what does not pay; a
    cheap chain drafter that reports confidences then drafts all ``max_tokens``
    whenever any draft could pay, and :func:`truncate_chain` keeps what its
    confidences justify (a long prompt-lookup match is worth verifying deep).
    ``online``: the drafter stops itself with a :class:`ChainStopper`, which pays
    for no draft it would cut, so it is planned like a cheap drafter, whatever
    its cost: all ``max_tokens`` whenever any draft could pay.
    """
    if max_tokens <= 0:
        return 0
    history.price_probes(costs)
    cheap = online or costs.draft_per_token < 0.1
    bases = history.bases(max_tokens)
    rates = [history.optimistic(i, base) for i, base in enumerate(bases)] if cheap else bases
    gains = expected_tokens(rates)
    best, best_rate = 0, 1.0 / costs.verify(1)
    for k in range(1, max_tokens + 1):
        rate = gains[k] / (costs.draft(k) + costs.verify(1 + k, tree=tree_width > 1))
        if rate > best_rate:
            best, best_rate = k, rate
    if best == 0 and history.probe_due:
        return 1
    if best and online and tree_width == 1:  # the stopper judges each token as it is drafted
        return max_tokens
    if best and cheap and tree_width == 1 and history.by_bin:  # truncation judges each drafted token
        return max_tokens
    return best


def truncate_chain(costs: CostTable, history: AcceptanceHistory, confidences: Sequence[float | None],
                   sunk: float = 0.0) -> int:
    """How many of the drafted chain's tokens to verify (a stopping rule).

    Token i is kept iff, with ``confidences[:i + 1]`` known and the history's
    estimates for later positions, some length > i beats stopping at i.
    sunk: the drafting cost already paid (part of every length's cost).
    """
    num = len(confidences)
    bases = history.bases(num)
    known: list[float] = []
    for i in range(num):
        known.append(history.estimate(i, confidences[i], bases[i]))
        rates = known + bases[i + 1:]
        gains = expected_tokens(rates)

        def rate(k: int) -> float:
            return gains[k] / (sunk + costs.verify(k + 1))

        if max(rate(k) for k in range(i + 1, num + 1)) <= rate(i):
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
        gains = expected_tokens(rates)

        def rate(k: int) -> float:
            return gains[k] / (self.costs.draft(max(k, drafted)) + self.costs.verify(k + 1))

        stop = rate(length)
        return any(rate(k) > stop for k in range(length + 1, self.budget + 1))

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
