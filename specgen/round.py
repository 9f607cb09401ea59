"""One speculative round as a transaction, and one plain decoding step.

Stages, in order: draft -> verify -> process -> accept -> commit (or rollback)
-> emit. The round either commits the accepted prefix plus one target token to
the whole request state, or -- on any exception, including a consumer closing
the stream -- restores the snapshot taken before it started.
"""

from __future__ import annotations

from dataclasses import dataclass

from specgen.drafters import Proposal
from specgen.events import TokenEvent
from specgen.models import CausalLM
from specgen.processors import History, ProcessorStack
from specgen.sampling import (
    TreeVerdict,
    Verdict,
    ancestor_matrix,
    sample_token,
    tree_depths,
    tree_paths,
    verify_chain,
    verify_chain_greedy,
    verify_tree,
    verify_tree_greedy,
)
from specgen.state import Request
from specgen.stats import Clock, Stats


@dataclass
class RoundContext:
    """feature_layers: target features the drafter reads (None: it reads none)."""

    target: CausalLM
    stack: ProcessorStack
    stats: Stats
    clock: Clock
    feature_layers: list[int] | None = None


def draft_budget(request: Request, num_tokens: int, context_length: int) -> int:
    """Draft tokens this round may propose: never past max_new_tokens or the context."""
    room = context_length - len(request.committed.tokens) - 1
    return max(0, min(num_tokens, request.remaining - 1, room))


def speculative_round(request: Request, ctx: RoundContext, num_tokens: int) -> list[TokenEvent]:
    """Run one round; return an event per committed token."""
    clock, timings = ctx.clock, ctx.stats.timings
    with request.transaction():
        t0 = clock()
        # draft
        budget = draft_budget(request, num_tokens, ctx.target.context_length)
        proposal: Proposal = request.draft.propose(budget) if request.draft is not None else Proposal([])
        t1 = clock()
        if proposal.parents is None and ctx.feature_layers is None:
            verdict, kept, depth, t2, t3 = _chain(request, ctx, proposal)
        else:
            verdict, kept, depth, t2, t3 = _tree(request, ctx, proposal)
        t4 = clock()
    timings.draft += t1 - t0
    timings.verify += t2 - t1
    timings.process += t3 - t2
    timings.commit += t4 - t3
    ctx.stats.record_round(len(proposal), verdict.num_accepted, depth)
    # emit
    round_index = ctx.stats.rounds
    events = []
    for i, (token, text) in enumerate(kept):
        if i < verdict.num_accepted:
            kind, prob = "accepted", verdict.accept_probs[i]
        else:
            kind = verdict.kind
            prob = verdict.accept_probs[i] if kind == "resampled" else None
        events.append(TokenEvent(token, text, kind, i + 1, prob, round_index))
    return events


def _chain(request: Request, ctx: RoundContext, proposal: Proposal):
    """Verify + process + accept + commit a chain; -> (verdict, kept, depth, t_verified, t_processed)."""
    # verify: one target forward over the uncached committed tokens + candidates
    committed = request.committed
    feed = request.target_cache.uncached(committed.tokens) + proposal.tokens
    raw = ctx.target.forward(request.target_cache, feed, keep=len(proposal) + 1)  # [num_draft + 1, vocab]
    t2 = ctx.clock()
    # process + accept
    history = History(committed, proposal.tokens, num_positions=len(proposal) + 1)
    if ctx.stack.greedy:
        verdict = verify_chain_greedy(ctx.stack.argmax(raw, history), proposal.tokens)
    else:
        target_probs = ctx.stack.probs(raw, history)  # [num_draft + 1, vocab]
        verdict = verify_chain(target_probs, proposal.draft_probs, proposal.tokens, request.target_rng)
    t3 = ctx.clock()
    # commit
    kept = request.commit(proposal.tokens[: verdict.num_accepted] + [verdict.next_token], verdict.num_accepted)
    return verdict, kept, len(proposal), t2, t3


def _tree(request: Request, ctx: RoundContext, proposal: Proposal):
    """Verify + process + accept + commit a tree (a chain is a tree with one child
    per node); also hands the drafter its target feature. -> as :func:`_chain`."""
    committed = request.committed
    parents = proposal.parents if proposal.parents is not None else list(range(-1, len(proposal) - 1))
    depths = tree_depths(parents)
    cache = request.target_cache
    chain = cache.uncached(committed.tokens)
    prefix = len(cache) + len(chain)
    # verify: one forward over the uncached committed tokens + every node
    out = ctx.target.forward_tree(cache, chain, proposal.tokens, ancestor_matrix(parents), depths,
                                  ctx.feature_layers)  # rows: 0 = root, 1 + i = node i
    t2 = ctx.clock()
    # process + accept, walking down the tree; p only on the walked path
    paths = [[proposal.tokens[j] for j in path] for path in tree_paths(parents)]

    def history(node: int) -> History:
        path = paths[node] if node >= 0 else []
        return History(committed, path, num_positions=1, start=len(path))

    def rows(node: int):
        return out.logits(node + 1)  # [1, vocab]

    if ctx.stack.greedy:
        tree = verify_tree_greedy(proposal.tokens, parents, lambda n: ctx.stack.argmax(rows(n), history(n))[0])
    else:
        tree = verify_tree(proposal.tokens, parents, proposal.draft_probs,
                           lambda n: ctx.stack.probs(rows(n), history(n))[0], request.target_rng)
    t3 = ctx.clock()
    # commit: keep the accepted path's keys/values, then the tokens
    cache.keep_rows(prefix, tree.path)
    kept = request.commit(tree.emitted, tree.num_accepted)
    if out.features is not None and request.draft is not None:
        last = tree.path[-1] + 1 if tree.path else 0
        request.draft.observe_features(prefix - 1 + tree.num_accepted, out.features[last])
    return _as_chain_verdict(tree), kept, max(depths, default=0), t2, t3


def _as_chain_verdict(tree: TreeVerdict) -> Verdict:
    """The emitted tokens' view of a tree verdict: accept probabilities of the
    path's nodes, then (after a rejection) that of the last rejected sibling."""
    checked = {node: prob for node, prob in zip(tree.checked, tree.accept_probs, strict=True)}
    probs = [checked.get(node, 1.0) for node in tree.path]
    if tree.kind == "resampled" and tree.checked:
        probs.append(tree.accept_probs[-1])
    return Verdict(tree.num_accepted, tree.next_token, tree.kind, tuple(probs))


def plain_step(request: Request, ctx: RoundContext) -> list[TokenEvent]:
    """Plain decoding: one target forward, one token from p. The reference path."""
    clock, timings = ctx.clock, ctx.stats.timings
    with request.transaction():
        t0 = clock()
        committed = request.committed
        raw = ctx.target.forward(request.target_cache, request.target_cache.uncached(committed.tokens), keep=1)
        t1 = clock()
        history = History(committed, [], num_positions=1)
        if ctx.stack.greedy:
            token = ctx.stack.argmax(raw, history)[0]
        else:
            token = sample_token(ctx.stack.probs(raw, history)[0], request.target_rng)
        t2 = clock()
        kept = request.commit([token], 0)
        t3 = clock()
    timings.verify += t1 - t0
    timings.process += t2 - t1
    timings.commit += t3 - t2
    ctx.stats.rounds += 1
    ctx.stats.target_calls += 1
    return [TokenEvent(token, text, "plain", None, None, ctx.stats.rounds) for token, text in kept]
