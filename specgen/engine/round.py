"""One speculative round as a transaction, and one plain decoding step.

Stages, in order: plan + draft (the planner, for num_tokens="auto") -> verify ->
process -> accept -> commit (or rollback) -> emit. The round either commits the accepted prefix plus one target token to
the whole request state, or -- on any exception, including a consumer closing
the stream -- restores the snapshot taken before it started. A "dead_end" verdict
(the target allows nothing after the accepted prefix, see
:mod:`specgen.sampling.rejection`) commits the accepted prefix only and ends the
request with ``finish_reason="dead_end"`` unless the commit ended it first (EOS,
a stop string, the length limit: plain decoding would stop there too).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specgen.drafters import Proposal
from specgen.drafters.base import EMPTY
from specgen.events import TokenEvent
from specgen.models.target import Target, TreeRows
from specgen.planning import (
    AUTO,
    AcceptanceHistory,
    ChainStopper,
    CostTable,
    plan_budget,
    truncate_chain,
    truncate_tree,
)
from specgen.planning.observed import ObservedCosts
from specgen.processors import History, PathHistory, ProcessorStack
from specgen.sampling import (
    Verdict,
    ancestor_matrix,
    argmax_or_none,
    argmax_tokens,
    chain_parents,
    normalise,
    sample_token,
    tree_depths,
    tree_paths,
    verify,
)
from specgen.engine.scoring import kept_scores, score_committed, scored, tree_scores
from specgen.engine.state import Request
from specgen.stats import Clock, RoundResult, Stats


@dataclass
class RoundContext:
    """feature_layers: target features the drafter reads (None: it reads none).
    costs: the pipeline's cost table for num_tokens="auto" (None: ``load_costs()``
    supplies it on the first planned round); history: this request's acceptance
    estimates; max_tokens / tree_width: the drafter's limits. observed: the pipeline's
    running verify timings (None: plan from the table alone); chain rounds feed it, and
    :meth:`planning_costs` reads the table through it.
    read_once: spend FLOPs to read back once per verification (what an accelerator,
    where every read stalls the stream, wants): a tree is verified from every node's
    row, computed and read back together, instead of the LM head and processors of
    the root and accepted nodes only with one read per visited node; a chain draws
    every possible final token ahead (``verify(draw_ahead=True)``) and leaves
    the NaN check to the verifier's read. Off, rounds do less arithmetic (what a CPU
    wants). Same verdict law either way.
    logprobs: alternatives per committed token's logprob (None: no logprobs); raw_logprobs:
    report them under the raw target logits instead of the processed ones (see
    :func:`score_committed`). scored: the logprobs of the tokens the last commit kept
    (what the emit stage puts on their events).
    """

    target: Target
    stack: ProcessorStack
    stats: Stats
    clock: Clock
    feature_layers: list[int] | None = None
    costs: CostTable | None = None
    history: AcceptanceHistory = field(default_factory=AcceptanceHistory)
    max_tokens: int = 8
    tree_width: int = 1
    load_costs: Callable[[], CostTable] | None = None
    read_once: bool = False
    observed: ObservedCosts | None = None
    logprobs: int | None = None
    raw_logprobs: bool = False
    scored: list | None = None  # [TokenLogprob]

    def planning_costs(self) -> CostTable:
        """The table this round plans with: ``costs`` (loaded on first use), corrected by ``observed``."""
        if self.costs is None:
            self.costs = self.load_costs()
        return self.costs if self.observed is None else self.observed.table(self.costs)


def draft_budget(request: Request, num_tokens: int, context_length: int) -> int:
    """Draft tokens this round may propose: never past max_new_tokens or the context."""
    room = context_length - len(request.committed.tokens) - 1
    return max(0, min(num_tokens, request.remaining - 1, room))


def speculative_round(request: Request, ctx: RoundContext, num_tokens: int | str) -> list[TokenEvent]:
    """Run one round; return an event per committed token.

    num_tokens: γ, or "auto" for the planner (plan before drafting from past
    rounds, truncate after drafting from the drafter's own confidence).
    """
    ctx.clock.take_laps()
    with request.transaction():
        proposal, predicted = plan_and_draft(request, ctx, num_tokens)
        if proposal.parents is None and ctx.feature_layers is None:
            verdict, kept, depth = _chain(request, ctx, proposal)
        else:
            verdict, kept, depth = _tree(request, ctx, proposal)
    return round_events(ctx, proposal, predicted, num_tokens == AUTO, verdict, kept, depth)


def plan_and_draft(request: Request, ctx: RoundContext, num_tokens: int | str) -> tuple[Proposal, float]:
    """The plan + draft stages -> (proposal, predicted accepted tokens of a planned tree).

    Looks only at the drafter's output and past rounds, never at the target's p for
    the tokens it drafts. A planned round that verifies no draft records the first token
    a shadowing session drafts (:func:`shadow`), which :func:`round_events` settles against
    the committed token. Call inside the round's transaction.
    """
    auto = num_tokens == AUTO
    costs = ctx.planning_costs() if auto else None
    with ctx.clock.stage("draft"):
        limit = min(ctx.max_tokens, costs.max_tokens) if auto else num_tokens
        budget = draft_budget(request, limit, ctx.target.context_length)
        session = request.draft
        # A chain drafted token by token stops itself (one host read a token: a CPU's way, not read_once's).
        online = auto and session is not None and session.stops_online and not ctx.read_once
        if auto:
            budget = plan_budget(costs, ctx.history, budget, tree_width=ctx.tree_width, online=online)
        if session is None or not budget:
            proposal: Proposal = EMPTY
        elif online:
            proposal = session.propose(budget, stopper=ChainStopper(costs, ctx.history, budget))
        else:
            proposal = session.propose(budget)
        predicted, drafted = 0.0, proposal
        if auto and not online and len(proposal):
            proposal, predicted = _truncate(proposal, ctx, costs, budget)
        if auto and not len(proposal):
            shadow(session, ctx.history, drafted)
    return proposal, predicted


def shadow(session, history: AcceptanceHistory, drafted: Proposal = EMPTY) -> None:
    """Before a planned round that verifies no draft: the first token a shadowing session drafts
    (:meth:`AcceptanceHistory.expect`; nothing for other sessions). That is ``drafted``'s first,
    where the round drafted and the planner cut all of it, else a one-token proposal's."""
    if session is None or not session.shadows:
        proposal = EMPTY
    else:
        proposal = drafted if len(drafted) else session.propose(1)
    confidence = proposal.confidence[0] if len(proposal) and proposal.confidence else None
    history.expect(int(proposal.tokens[0]) if len(proposal) else None, confidence)


def round_events(ctx: RoundContext, proposal: Proposal, predicted: float, auto: bool, verdict: Verdict,
                 kept: list[tuple[int, str]], depth: int) -> list[TokenEvent]:
    """After a committed round: record its stats, teach the planner, and emit an event per kept token."""
    result = RoundResult(len(proposal), verdict.num_accepted, depth, auto, True, ctx.clock.take_laps())
    ctx.stats.record(result)
    if auto:
        if proposal.parents is None:
            ctx.history.observe(proposal.confidence or [None] * len(proposal), verdict.num_accepted)
        else:
            ctx.history.observe_tree(predicted, verdict.num_accepted, depth)
        ctx.history.settle(kept[0][0] if kept and not len(proposal) else None)
    # emit
    round_index = ctx.stats.rounds
    events = []
    if not len(proposal):  # nothing drafted: the target's own token, as in plain decoding
        return [TokenEvent(token, text, "plain", None, None, round_index, 0, scored(ctx, i))
                for i, (token, text) in enumerate(kept)]
    for i, (token, text) in enumerate(kept):
        if i < verdict.num_accepted:
            kind, prob = "accepted", verdict.emitted_probs[i]
        else:
            kind = verdict.kind
            prob = verdict.emitted_probs[i] if kind == "resampled" else None
        events.append(TokenEvent(token, text, kind, i + 1, prob, round_index, len(proposal), scored(ctx, i)))
    return events


def _truncate(proposal: Proposal, ctx: RoundContext, costs: CostTable, budget: int) -> tuple[Proposal, float]:
    """The planner's cut of a drafted proposal (see :mod:`specgen.planning.chain` for why it stays exact);
    -> (kept proposal, predicted accepted tokens for a tree)."""
    sunk = costs.draft(budget)
    if proposal.parents is None:
        confidence = proposal.confidence or [None] * len(proposal)
        keep = truncate_chain(costs, ctx.history, confidence, sunk)
        return chain_prefix(proposal, keep), 0.0
    if proposal.draft_probs is not None or proposal.confidence is None:
        return proposal, 0.0  # a sampled tree (or one without scores) is verified whole
    nodes, predicted = truncate_tree(costs, ctx.history, proposal.confidence, proposal.parents, sunk)
    index = {old: new for new, old in enumerate(nodes)}
    parents = [-1 if proposal.parents[i] < 0 else index[proposal.parents[i]] for i in nodes]
    return Proposal([proposal.tokens[i] for i in nodes], None, parents,
                    [proposal.confidence[i] for i in nodes]), predicted


def chain_prefix(proposal: Proposal, keep: int) -> Proposal:
    """The first ``keep`` tokens of a drafted chain (the proposal itself when it keeps them all;
    the empty proposal for none)."""
    if keep >= len(proposal):
        return proposal
    if keep == 0:
        return EMPTY
    return Proposal(proposal.tokens[:keep], None if proposal.draft_probs is None else proposal.draft_probs[:keep],
                    None, None if proposal.confidence is None else proposal.confidence[:keep])


def _chain(request: Request, ctx: RoundContext, proposal: Proposal):
    """Verify + process + accept + commit a chain; -> (verdict, kept, depth)."""
    feed = chain_feed(request, proposal)
    with ctx.clock.stage("verify") as lap:  # one target forward over the uncached committed tokens + candidates
        raw = ctx.target.forward(request.target_cache, feed, keep=len(proposal) + 1,
                                 check=not ctx.read_once)  # [num_draft + 1, vocab]; NaN refused by verification
    if ctx.observed is not None and len(feed) == len(proposal) + 1:
        ctx.observed.observe(len(feed), lap.seconds, ctx.costs)
    return accept_chain(request, ctx, proposal, raw)


def chain_feed(request: Request, proposal: Proposal) -> list[int]:
    """What a chain's verify forward feeds: the uncached committed tokens, then the candidates."""
    return request.target_cache.uncached(request.committed.tokens) + proposal.tokens


def accept_chain(request: Request, ctx: RoundContext, proposal: Proposal, raw):
    """Process + accept + commit a chain from its verify rows.

    raw: [num_draft + 1, vocab] raw target logits of the last fed committed token and
    each candidate. -> (verdict, kept, depth).
    """
    clock, committed = ctx.clock, request.committed
    with clock.stage("process"):  # process + accept
        history = History(committed, proposal.tokens, num_positions=len(proposal) + 1)
        if ctx.stack.greedy:
            logits = ctx.stack.read_only(raw, history)  # [num_draft + 1, vocab]
            verdict = verify(proposal.tokens, None, argmax_or_none(logits), greedy=True)
        else:
            logits = ctx.stack.logits(raw, history)  # [num_draft + 1, vocab]
            verdict = verify(proposal.tokens, None, normalise(logits), request.target_rng,
                             draft_probs=proposal.draft_probs, draw_ahead=ctx.read_once)
        tokens = proposal.tokens[: verdict.num_accepted]
        tokens = tokens if verdict.next_token is None else [*tokens, verdict.next_token]
        scores = score_committed(ctx, raw, logits, tokens)
    with clock.stage("commit"):
        kept = _commit(request, tokens, verdict, ctx, scores)
    return verdict, kept, len(proposal)


def _commit(request: Request, tokens: list[int], verdict: Verdict, ctx: RoundContext,
            scores: list[TokenLogprob] | None) -> list[tuple[int, str]]:
    """Commit a verdict's tokens (with their logprobs, see :func:`kept_scores`); a dead end then ends
    the request unless the commit already did."""
    kept = request.commit(tokens, verdict.num_accepted)
    kept_scores(request, ctx, scores, len(kept))
    if verdict.kind == "dead_end" and request.finish_reason is None:
        request.finish_reason = "dead_end"
    return kept


def _tree(request: Request, ctx: RoundContext, proposal: Proposal):
    """Verify + process + accept + commit a tree (a chain is a tree with one child
    per node); also hands the drafter its target feature. -> as :func:`_chain`."""
    clock = ctx.clock
    committed = request.committed
    parents = proposal.parents if proposal.parents is not None else chain_parents(len(proposal))
    depths = tree_depths(parents)
    cache = request.target_cache
    with clock.stage("verify"):  # one forward over the uncached committed tokens + every node
        chain = cache.uncached(committed.tokens)
        prefix = len(cache) + len(chain)
        out = ctx.target.forward_tree(cache, chain, proposal.tokens, ancestor_matrix(parents), depths,
                                      ctx.feature_layers)  # rows: 0 = root, 1 + i = node i
    paths = [[proposal.tokens[j] for j in path] for path in tree_paths(parents)]

    row_logits = functools.cache(out.logits)  # a lazily computed row once, for the walk and the logprobs
    if ctx.read_once:
        tree = _walk_prefetched(request, ctx, proposal, parents, paths, out)
    else:
        tree = _walk_lazy(request, ctx, proposal, parents, paths, row_logits)
    scores = None
    if ctx.logprobs is not None:
        with clock.stage("process"):
            scores = tree_scores(request, ctx, tree, paths, row_logits)
    with clock.stage("commit"):  # keep the accepted path's keys/values, then the tokens
        cache.keep_rows(prefix, tree.path)
        kept = _commit(request, tree.emitted, tree, ctx, scores)
        if out.features is not None and request.draft is not None:  # every newly committed position's row
            rows = out.features[[0, *(node + 1 for node in tree.path)]]  # [1 + num_accepted, F]
            request.draft.observe_features(prefix - 1 + tree.num_accepted, torch.cat([out.chain_features, rows]))
    return tree, kept, max(depths, default=0)


def _walk_lazy(request: Request, ctx: RoundContext, proposal: Proposal, parents: list[int],
               paths: list[list[int]], row_logits: Callable[[int], torch.Tensor]) -> Verdict:
    """Process + accept walking down the tree, computing p only on the walked path."""
    clock, committed = ctx.clock, request.committed

    def history(node: int) -> History:
        path = paths[node] if node >= 0 else []
        return History(committed, path, num_positions=1, start=len(path))

    def rows(node: int):
        with clock.stage("verify"):  # the lazy LM head is part of the verify pass
            return row_logits(node + 1)  # [1, vocab]

    with clock.stage("process"):
        if ctx.stack.greedy:
            return verify(proposal.tokens, parents, lambda n: ctx.stack.argmax_or_none(rows(n), history(n))[0],
                          greedy=True)
        return verify(proposal.tokens, parents, lambda n: ctx.stack.probs(rows(n), history(n))[0],
                      request.target_rng, draft_probs=proposal.draft_probs)


def _walk_prefetched(request: Request, ctx: RoundContext, proposal: Proposal, parents: list[int],
                     paths: list[list[int]], out: TreeRows) -> Verdict:
    """Process every node's row at once, read back once, then walk on the host."""
    with ctx.clock.stage("verify"):
        raw = out.all_logits()  # [num_nodes + 1, vocab]
    with ctx.clock.stage("process"):
        history = PathHistory(request.committed, [[], *paths])
        if ctx.stack.greedy:
            best = ctx.stack.argmax_or_none(raw, history)  # root, then each node
            return verify(proposal.tokens, parents, best, greedy=True)
        return verify(proposal.tokens, parents, ctx.stack.probs(raw, history), request.target_rng,
                      draft_probs=proposal.draft_probs)


def plain_step(request: Request, ctx: RoundContext) -> list[TokenEvent]:
    """Plain decoding: one target forward, one token from p. The reference path."""
    clock = ctx.clock
    clock.take_laps()
    with request.transaction():
        feed = request.target_cache.uncached(request.committed.tokens)
        with clock.stage("verify") as lap:
            raw = ctx.target.forward(request.target_cache, feed, keep=1)
        if ctx.observed is not None and len(feed) == 1:
            ctx.observed.observe(1, lap.seconds, ctx.costs)
        kept = accept_plain(request, ctx, raw)
    return plain_events(ctx, kept)


def accept_plain(request: Request, ctx: RoundContext, raw) -> list[tuple[int, str]]:
    """Process + commit a plain step from its verify row (raw: [1, vocab] raw logits) -> kept (token, text).
    Call inside the step's transaction."""
    clock = ctx.clock
    with clock.stage("process"):
        history = History(request.committed, [], num_positions=1)
        if ctx.stack.greedy:
            logits = ctx.stack.read_only(raw, history)  # [1, vocab]
            token = argmax_tokens(logits)[0]
        else:
            logits = ctx.stack.logits(raw, history)  # [1, vocab]
            token = sample_token(normalise(logits)[0], request.target_rng)
        scores = score_committed(ctx, raw, logits, [token])
    with clock.stage("commit"):
        kept = request.commit([token], 0)
        kept_scores(request, ctx, scores, len(kept))
        return kept


def plain_events(ctx: RoundContext, kept: list[tuple[int, str]]) -> list[TokenEvent]:
    """After a committed plain step: record its stats and emit its event."""
    ctx.stats.record(RoundResult(speculative=False, timings=ctx.clock.take_laps()))
    return [TokenEvent(token, text, "plain", None, None, ctx.stats.rounds, None, scored(ctx, i))
            for i, (token, text) in enumerate(kept)]
