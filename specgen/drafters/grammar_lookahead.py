"""Draft the text a grammar forces next (e.g. the JSON key a schema requires).

When the request's processor stack holds a grammar, the bytes every valid
continuation must start with are known without running any model. Their
canonical tokenisation is a cheap deterministic proposal; the target still
verifies every token (q is one-hot), so exactness is unaffected. Only the
prefix that the grammar itself accepts is proposed.
"""

from __future__ import annotations

from collections.abc import Callable

from specgen.drafters.base import DraftContext
from specgen.processors import GrammarSlot

#: Upper bound on the forced text looked at per round, in bytes.
FORCED_BYTES = 64


def grammar_of(ctx: DraftContext) -> GrammarSlot | None:
    """The grammar in the request's stack (its grammar slot), or None."""
    return ctx.stack.grammar


def forced_tokens(ctx: DraftContext, encode: Callable[[str], list[int]], budget: int) -> list[int]:
    """Up to ``budget`` tokens of the text the grammar forces after the committed tokens.

    Under the request's grammar timer this is grammar work (charged out of the draft stage)."""
    grammar = grammar_of(ctx)
    if grammar is None or budget <= 0:
        return []
    timer = grammar.timer
    start = timer.now() if timer is not None else 0.0
    try:
        return _forced(grammar, ctx, encode, budget)
    finally:
        if timer is not None:
            timer.spent(start)


def _forced(grammar, ctx: DraftContext, encode: Callable[[str], list[int]], budget: int) -> list[int]:
    committed = ctx.committed
    state = grammar.state_for(committed.tokens[committed.num_prompt :])
    text = grammar.automaton.forced_bytes(state, limit=FORCED_BYTES).decode("utf-8", errors="ignore")
    if not text:
        return []
    proposal: list[int] = []
    for token in encode(text)[:budget]:
        state = grammar.automaton.advance(state, token)
        if state is None:
            break
        proposal.append(token)
    return proposal
