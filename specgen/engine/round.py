"""One speculative round as a transaction, and one plain decoding step.

Stages, in order: plan + draft (the request's planner, :mod:`specgen.planning.planner`) -> verify ->
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
from dataclasses import dataclass

import torch

from specgen.drafters import Proposal
from specgen.events import TokenEvent
from specgen.models.target import Target, TreeRows
from specgen.planning import AUTO
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


@dataclass(frozen=True)
class RoundContext:
    """What a request's rounds run with, fixed when the request opens (per-round state lives on
    the :class:`~specgen.engine.state.Request`, planning state on its ``planner``).

    feature_layers: target features the drafter reads (None: it reads none).
    read_once: spend FLOPs to read back once per verification (what an accelerator,
    where every read stalls the stream, wants): a tree is verified from every node's
    row, computed and read back together, instead of the LM head and processors of
    the root and accepted nodes only with one read per visited node; a chain draws
    every possible final token ahead (``verify(draw_ahead=True)``) and leaves
    the NaN check to the verifier's read. Off, rounds do less arithmetic (what a CPU
    wants). Same verdict law either way.
    logprobs: alternatives per committed token's logprob (None: no logprobs); raw_logprobs:
    report them under the raw target logits instead of the processed ones (see
    :func:`score_committed`).
    """

    target: Target
    stack: ProcessorStack
    stats: Stats
    clock: Clock
    feature_layers: list[int] | None = None
    read_once: bool = False
    logprobs: int | None = None
    raw_logprobs: bool = False


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
    return round_events(request, ctx, proposal, predicted, num_tokens == AUTO, verdict, kept, depth)


def plan_and_draft(request: Request, ctx: RoundContext, num_tokens: int | str) -> tuple[Proposal, float]:
    """The plan + draft stages, timed as drafting: the request's planner decides and its draft session
    drafts (:meth:`specgen.planning.planner.Planner.draft`). Call inside the round's transaction."""
    if num_tokens == AUTO:
        request.planner.load()  # a first load (perhaps a measurement) is not drafting time
    with ctx.clock.stage("draft"):
        feed = len(request.target_cache.uncached(request.committed.tokens))
        return request.planner.draft(request.draft, num_tokens, request.draft_room(ctx.target.context_length), feed)


def round_events(request: Request, ctx: RoundContext, proposal: Proposal, predicted: float, auto: bool,
                 verdict: Verdict, kept: list[tuple[int, str]], depth: int) -> list[TokenEvent]:
    """After a committed round: record its stats, teach the planner, and emit an event per kept token."""
    result = RoundResult(len(proposal), verdict.num_accepted, depth, auto, True, ctx.clock.take_laps())
    ctx.stats.record(result)
    if auto:
        request.planner.learn(proposal, predicted, verdict.num_accepted, depth, kept[0][0] if kept else None)
    # emit
    round_index = ctx.stats.rounds
    events = []
    if not len(proposal):  # nothing drafted: the target's own token, as in plain decoding
        return [TokenEvent(token, text, "plain", None, None, round_index, 0, scored(request, i))
                for i, (token, text) in enumerate(kept)]
    probs = verdict.emitted_probs
    for i, (token, text) in enumerate(kept):
        if i < verdict.num_accepted:
            kind, prob = "accepted", probs[i]
        else:
            kind = verdict.kind
            prob = probs[i] if kind == "resampled" else None
        events.append(TokenEvent(token, text, kind, i + 1, prob, round_index, len(proposal), scored(request, i)))
    return events


def _chain(request: Request, ctx: RoundContext, proposal: Proposal):
    """Verify + process + accept + commit a chain; -> (verdict, kept, depth)."""
    feed = chain_feed(request, proposal)
    with ctx.clock.stage("verify") as lap:  # one target forward over the uncached committed tokens + candidates
        raw = ctx.target.forward(request.target_cache, feed, keep=len(proposal) + 1,
                                 check=not ctx.read_once)  # [num_draft + 1, vocab]; NaN refused by verification
    if len(feed) == len(proposal) + 1:
        request.planner.observe_verify(len(feed), lap.seconds)
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
        if len(feed) == 1:
            request.planner.observe_verify(1, lap.seconds)
        kept = accept_plain(request, ctx, raw)
    return plain_events(request, ctx, kept)


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


def plain_events(request: Request, ctx: RoundContext, kept: list[tuple[int, str]]) -> list[TokenEvent]:
    """After a committed plain step: record its stats and emit its event."""
    ctx.stats.record(RoundResult(speculative=False, timings=ctx.clock.take_laps()))
    return [TokenEvent(token, text, "plain", None, None, ctx.stats.rounds, None, scored(request, i))
            for i, (token, text) in enumerate(kept)]
