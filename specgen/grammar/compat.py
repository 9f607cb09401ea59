"""A grammar together with ``min_new_tokens`` and ``bad_words``: refuse what can never finish.

``min_new_tokens`` forbids EOS for the first tokens and ``bad_words`` forbids
tokens; with a grammar that may leave nothing to sample. :func:`check_reachable`
searches the grammar's token automaton from its start, a bounded number of
states, for a way to a complete output that both allow. When the search ends
without one, every run would dead-end, so the combination is refused up front
(ConfigError). When the search runs past its budget the combination may be
fine; a run that does meet a dead end finishes with ``finish_reason="dead_end"``
and the reason (see :meth:`~specgen.grammar.processor.GrammarProcessor.bind`).
"""

from __future__ import annotations

from collections import deque

import torch

from specgen.errors import ConfigError

#: States the search may expand before it gives up (and refuses nothing).
SEARCH_BUDGET = 2000
#: Allowed tokens followed per state (the rest are assumed to lead on).
BRANCHES_PER_STATE = 64


def check_reachable(grammar) -> None:
    """ConfigError if no output of ``grammar`` (a bound GrammarProcessor) can ever end.

    An output can end at a final state reached after at least ``min_new_tokens``
    tokens, with EOS not banned there; tokens banned by single-token bad words are
    never taken. Multi-token bad words are left to the run-time check.
    """
    if not (grammar.min_new_tokens or grammar.bad_words) or not grammar.automaton.eos_ids:
        return
    automaton = grammar.automaton
    banned = torch.zeros(automaton.vocab_size, dtype=torch.bool)
    for seq in grammar.bad_words:
        if len(seq) == 1 and seq[0] < automaton.vocab_size:
            banned[seq[0]] = True
    eos = sorted(automaton.eos_ids)
    eos_banned = bool(banned[eos].all())
    frontier = deque([(automaton.initial_state, 0)])
    seen = {(automaton.initial_state, 0)}
    expanded = 0
    while frontier:
        state, depth = frontier.popleft()
        if automaton.is_accepting(state) and depth >= grammar.min_new_tokens and not eos_banned:
            return
        expanded += 1
        if expanded > SEARCH_BUDGET:
            return
        allowed = automaton.mask(state).clone()
        allowed[eos] = False
        allowed &= ~banned
        ids = torch.nonzero(allowed).flatten()
        if len(ids) > BRANCHES_PER_STATE:
            return
        for token in ids.tolist():
            nxt = automaton.advance(state, token)
            key = (nxt, min(depth + 1, grammar.min_new_tokens))
            if nxt is not None and key not in seen:
                seen.add(key)
                frontier.append(key)
    raise ConfigError(f"grammar {automaton.description} cannot produce any output with "
                      f"sampling.min_new_tokens={grammar.min_new_tokens} and the given sampling.bad_words: every "
                      "output the grammar allows is shorter or uses a banned token; lower min_new_tokens or "
                      "change the grammar")
