"""One request's planner: how much to draft each round, where to cut the draft, what to learn.

A :class:`Planner` belongs to one request (``Request.planner``) and holds everything planning
keeps across its rounds: the cost table it plans with (loaded on first use), the pipeline's
running verify timings (:class:`~specgen.planning.observed.ObservedCosts`), the drafter's limits
and the request's :class:`~specgen.planning.acceptance.AcceptanceHistory`. A round asks it three
things, in order: :meth:`Planner.draft` (the draft length or tree node budget, the drafting, and
the cut of what was drafted), :meth:`Planner.observe_verify` (the verify forward's time), and
:meth:`Planner.learn` (the verdict, once the round committed). The batched step asks the same
per row (:mod:`specgen.batch.drafting`), its lengths chosen together by
:mod:`specgen.planning.batch`.

Exactness (contract 5, :mod:`specgen.planning.chain`): every decision here reads the drafter's
output, the cost table and past rounds only, never the target's p for the tokens about to be
verified, so a planned draft length is a stopping time of the drafter's own information.
:meth:`Planner.learn` runs after the round committed; what it learns is a past round for the next.
"""

from __future__ import annotations

from collections.abc import Callable

from specgen.drafters.base import EMPTY, Proposal
from specgen.planning.acceptance import AcceptanceHistory
from specgen.planning.chain import AUTO, ChainStopper, plan_budget, truncate_chain, truncate_tree
from specgen.planning.costs import CostTable
from specgen.planning.observed import ObservedCosts


def prefills(feed: int) -> bool:
    """Whether a round whose forward feeds ``feed`` tokens before its draft prefills prompt tokens (a
    request's first round, past what the prefix cache held). A planned round that prefills drafts
    nothing, so its first token waits on the prefill alone (time to first token): a verify beside it
    would add its width to that forward, or a decode of its own where a backend splits prompt decodes
    from the rows it reads (llama.cpp). It looks at the request's own state, never at the target's p.
    """
    return feed > 1


class Planner:
    """One request's planning state and decisions (module docstring).

    max_tokens / tree_width: the drafter's limits. load_costs: () -> the pipeline's cost table
    (None: a request that never plans with num_tokens="auto"); costs: the table once loaded
    (:meth:`attach`, or :meth:`load` on first use). observed: the pipeline's running verify
    timings (None: plan from the table alone); :meth:`table` reads the table through it and
    chain rounds and plain steps feed it (:meth:`observe_verify`). read_once: the round reads
    back once per verification, so a drafter that stops itself token by token (one read a
    token) is not asked to.
    """

    def __init__(self, *, max_tokens: int = 8, tree_width: int = 1,
                 load_costs: Callable[[], CostTable] | None = None, observed: ObservedCosts | None = None,
                 read_once: bool = False):
        self.max_tokens, self.tree_width = max_tokens, tree_width
        self.load_costs = load_costs
        self.costs: CostTable | None = None
        self.observed = observed
        self.read_once = read_once
        self.history = AcceptanceHistory()

    def attach(self, costs: CostTable, observed: ObservedCosts | None = None) -> None:
        """Plan with ``costs`` from now on (and through ``observed``, unless None: keep the current)."""
        self.costs = costs
        if observed is not None:
            self.observed = observed

    def load(self) -> CostTable:
        """``costs``, loaded (read from the cache, or measured) on first use."""
        if self.costs is None:
            self.costs = self.load_costs()
        return self.costs

    def table(self) -> CostTable:
        """The table a round plans with: ``costs`` (loaded on first use), corrected by ``observed``."""
        costs = self.load()
        return costs if self.observed is None else self.observed.table(costs)

    def draft(self, session, num_tokens: int | str, room: int, feed: int = 1) -> tuple[Proposal, float]:
        """The plan + draft stages -> (proposal, predicted accepted tokens of a planned tree).

        session: the request's draft session (None: nothing is drafted); num_tokens: γ, or
        "auto" to plan; room: the most draft tokens the request can take this round (its
        token limit and context); feed: the tokens the round's forward feeds before any draft
        (more than one where it prefills: :func:`prefills`, where a planned round drafts
        nothing and records no shadow). Planned: a budget from past rounds (:func:`plan_budget`), the
        drafting, then the cut from the drafter's own confidence (:meth:`cut`), or a drafter
        that stops itself with a :class:`ChainStopper`. A planned round that verifies no draft
        records the first token a shadowing session drafts (:meth:`shadow`), which
        :meth:`learn` settles against the committed token. Call inside the round's transaction.
        """
        auto = num_tokens == AUTO
        costs = self.table() if auto else None
        limit = min(self.max_tokens, costs.max_tokens) if auto else num_tokens
        prefill = auto and prefills(feed)
        budget = 0 if prefill else max(0, min(limit, room))
        # A chain drafted token by token stops itself (one host read a token: a CPU's way, not read_once's).
        online = auto and session is not None and session.stops_online and not self.read_once
        if auto:
            budget = plan_budget(costs, self.history, budget, tree_width=self.tree_width, online=online)
        if session is None or not budget:
            proposal: Proposal = EMPTY
        elif online:
            proposal = session.propose(budget, stopper=ChainStopper(costs, self.history, budget))
        else:
            proposal = session.propose(budget)
        predicted, drafted = 0.0, proposal
        if auto and not online and len(proposal):
            proposal, predicted = self.cut(proposal, costs, budget)
        if auto and not len(proposal) and not prefill:  # a prefill round asks the drafter nothing
            self.shadow(session, drafted)
        return proposal, predicted

    def cut(self, proposal: Proposal, costs: CostTable, budget: int) -> tuple[Proposal, float]:
        """The planner's cut of a drafted proposal (see :mod:`specgen.planning.chain` for why it
        stays exact); -> (kept proposal, predicted accepted tokens for a tree)."""
        sunk = costs.draft(budget)
        if proposal.parents is None:
            confidence = proposal.confidence or [None] * len(proposal)
            return chain_prefix(proposal, truncate_chain(costs, self.history, confidence, sunk)), 0.0
        if proposal.draft_probs is not None or proposal.confidence is None:
            return proposal, 0.0  # a sampled tree (or one without scores) is verified whole
        nodes, predicted = truncate_tree(costs, self.history, proposal.confidence, proposal.parents, sunk)
        index = {old: new for new, old in enumerate(nodes)}
        parents = [-1 if proposal.parents[i] < 0 else index[proposal.parents[i]] for i in nodes]
        return Proposal([proposal.tokens[i] for i in nodes], None, parents,
                        [proposal.confidence[i] for i in nodes]), predicted

    def shadow(self, session, drafted: Proposal = EMPTY) -> None:
        """Before a planned round that verifies no draft: the first token a shadowing session drafts
        (:meth:`AcceptanceHistory.expect`; nothing for other sessions). That is ``drafted``'s first,
        where the round drafted and the planner cut all of it, else a one-token proposal's."""
        if session is None or not session.shadows:
            proposal = EMPTY
        else:
            proposal = drafted if len(drafted) else session.propose(1)
        confidence = proposal.confidence[0] if len(proposal) and proposal.confidence else None
        self.history.expect(int(proposal.tokens[0]) if len(proposal) else None, confidence)

    def observe_verify(self, width: int, seconds: float) -> None:
        """A verify forward that fed exactly ``width`` tokens took ``seconds`` (the observed timings learn)."""
        if self.observed is not None:
            self.observed.observe(width, seconds, self.costs)

    def learn(self, proposal: Proposal, predicted: float, num_accepted: int, depth: int,
              committed: int | None) -> None:
        """After a committed planned round: what its verdict says about this drafter's acceptance.

        proposal: what was verified; predicted: the cut's predicted accepted tokens of a tree;
        num_accepted / depth: the verdict's accepted nodes and the tree's depth; committed: the
        first token the round committed (settles a shadow when nothing was verified)."""
        if proposal.parents is None:
            self.history.observe(proposal.confidence or [None] * len(proposal), num_accepted)
        else:
            self.history.observe_tree(predicted, num_accepted, depth)
        self.history.settle(committed if not len(proposal) else None)


def chain_prefix(proposal: Proposal, keep: int) -> Proposal:
    """The first ``keep`` tokens of a drafted chain (the proposal itself when it keeps them all;
    the empty proposal for none)."""
    if keep >= len(proposal):
        return proposal
    if keep == 0:
        return EMPTY
    return Proposal(proposal.tokens[:keep], None if proposal.draft_probs is None else proposal.draft_probs[:keep],
                    None, None if proposal.confidence is None else proposal.confidence[:keep])
