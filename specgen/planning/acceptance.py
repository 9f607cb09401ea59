"""A request's acceptance record: running, non-anticipating estimates of how often drafts are accepted.

Pure state, no models. :class:`AcceptanceHistory` learns from verified rounds
only (past rounds), so anything planned from it is decided before the target
sees this round's drafts. :func:`expected_tokens` turns per-position estimates
into committed tokens per draft length, and :func:`planning_rates` is the one
place that chooses which estimates a plan reads (the cheap-drafter rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specgen.planning.costs import CostTable


#: ``probe_gap`` where no spacing keeps a probe's price under its share: probes stop.
NO_PROBES = 1 << 30


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

    A shadowing drafter (a deterministic one that proposes cheaply) needs no probes:
    before a plain step the round records the token it would have drafted
    (:meth:`expect`), and after it :meth:`settle` counts that draft as accepted iff it
    equals the committed token. For a one-hot draft q = δ_d exact verification accepts
    d with probability p(d) = P(committed token = d), so this is an unbiased acceptance
    sample at any temperature, learned from the step just committed (a past round).
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
    pending: tuple[int, float | None] | None = None
    shadowed: int = 0

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

    def expect(self, token: int | None, confidence: float | None = None) -> None:
        """The first token a shadowing drafter would draft before this plain step (None: no draft)."""
        self.pending = None if token is None else (int(token), confidence)

    def settle(self, committed: int | None) -> None:
        """After the plain step: its committed token (None: it committed none) settles :meth:`expect`'s
        draft as a position-0 observation, which also counts as the probe it makes unnecessary."""
        pending, self.pending = self.pending, None
        if pending is None or committed is None:
            return
        token, confidence = pending
        accepted = token == int(committed)
        self._position(0).add(accepted, self.decay)
        if confidence is not None:
            self.by_bin.setdefault(self._bin(confidence), _Rate()).add(accepted, self.decay)
        self.plain_streak = 0
        self.shadowed += 1

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
        return self.optimistic_all([base])[0]

    def optimistic_all(self, bases: Sequence[float]) -> list[float]:
        """:meth:`optimistic` of each position whose confidence-free estimate is ``bases[i]``, in one pass:
        a bin's estimate grows with its centre, so among unseen bins only the highest can be the best."""
        if not self.by_bin:
            return list(bases)
        bins, weight = self.bins, self.weight
        seen = [((b + 0.5) / bins, rate.accepted, rate.seen + weight) for b, rate in self.by_bin.items()]
        unseen = [b for b in range(bins) if b not in self.by_bin]
        top = (unseen[-1] + 0.5) / bins if unseen else None
        out = []
        for base in bases:
            best = base if top is None else max(base, (base + top) / 2)
            for centre, accepted, total in seen:
                estimate = (accepted + weight * (base + centre) / 2) / total
                if estimate > best:
                    best = estimate
            out.append(best)
        return out

    @property
    def probe_due(self) -> bool:
        return self.plain_streak >= max(self.probe_every, self.probe_gap)

    def price_probes(self, costs: CostTable) -> None:
        """Space probes so a rejected one costs at most ``probe_share`` of the plain steps before it.

        A probe after g plain steps costs draft(1) + v(2) - v(1) plus g times the drafter's
        catch-up per committed token (``costs.draft_catch_up``), so g >= extra / (share - catch-up);
        where the catch-up alone reaches the share, no gap prices a probe and none is made."""
        extra = max(0.0, costs.draft(1) + costs.verify(2) - costs.verify(1))
        room = self.probe_share - costs.draft_catch_up
        if self.probe_share <= 0:
            self.probe_gap = 0
        elif room <= 0:
            self.probe_gap = NO_PROBES
        else:
            self.probe_gap = math.ceil(extra / room - 1e-9)


def expected_tokens(rates: Sequence[float]) -> list[float]:
    """E[committed tokens] for k = 0..len(rates) drafts: 1 + sum_i prod_{j<=i} rates[j]."""
    out, survive, total = [1.0], 1.0, 1.0
    for rate in rates:
        survive *= min(max(rate, 0.0), 1.0)
        total += survive
        out.append(total)
    return out


def planning_rates(history: AcceptanceHistory, count: int, cheap: bool) -> list[float]:
    """The per-position estimates a plan made before drafting reads, positions 0 .. count - 1.

    A cheap drafter (or one that stops itself) is planned with the best estimate any
    confidence could give (:meth:`AcceptanceHistory.optimistic`): truncation after drafting
    cuts what does not pay. Otherwise the confidence-free estimates (:meth:`AcceptanceHistory.bases`).
    """
    bases = history.bases(count)
    return history.optimistic_all(bases) if cheap else bases
