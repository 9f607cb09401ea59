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
from specgen.sampling import sample_token, verify_chain, verify_chain_greedy
from specgen.state import Request
from specgen.stats import Clock, Stats


@dataclass
class RoundContext:
    target: CausalLM
    stack: ProcessorStack
    stats: Stats
    clock: Clock


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
        # verify: one target forward over the uncached committed tokens + candidates
        committed = request.committed
        feed = request.target_cache.uncached(committed.tokens) + proposal.tokens
        raw = ctx.target.forward(request.target_cache, feed, keep=len(proposal) + 1)  # [num_draft + 1, vocab]
        t2 = clock()
        # process + accept
        history = History(committed, proposal.tokens, num_positions=len(proposal) + 1)
        if ctx.stack.greedy:
            verdict = verify_chain_greedy(ctx.stack.argmax(raw, history), proposal.tokens)
        else:
            target_probs = ctx.stack.probs(raw, history)  # [num_draft + 1, vocab]
            verdict = verify_chain(target_probs, proposal.draft_probs, proposal.tokens, request.target_rng)
        t3 = clock()
        # commit
        new_tokens = proposal.tokens[: verdict.num_accepted] + [verdict.next_token]
        kept = request.commit(new_tokens, verdict.num_accepted)
        t4 = clock()
    timings.draft += t1 - t0
    timings.verify += t2 - t1
    timings.process += t3 - t2
    timings.commit += t4 - t3
    ctx.stats.record_round(len(proposal), verdict.num_accepted)
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
