"""Grammar states of a draft tree's nodes, and their masks over a head's draft vocabulary.

A tree drafter (EAGLE, Medusa) under a grammar ranks each node's children by the
*masked* draft distribution: the head's logits with every token the grammar
forbids after that node's path set to -inf, renormalised. The grammar is a pure
function of a row's tokens, so a node's state is its parent's state advanced by
the node's token; the root's state is that of the committed generated tokens.
States are kept on the host (the automaton's API), masks come from the
automaton's per-state device cache.

The stack's ``min_new_tokens`` (bound into the grammar by
:meth:`specgen.processors.ProcessorStack.with_grammar`) is applied too: EOS is
masked at a node whose position has seen fewer generated tokens. Other
processors (penalties, ``bad_words``, top-k/p) are left to verification: the
trees are deterministic (q one-hot), so the choice of nodes never affects
exactness, only how many are accepted.
"""

from __future__ import annotations

import torch

from specgen.drafters.base import DraftContext
from specgen.drafters.grammar_lookahead import grammar_of
from specgen.processors import CommittedCounts, GrammarSlot

NEG_INF = float("-inf")


class TreeGrammar:
    """grammar: the stack's GrammarProcessor; vocab_ids: [Vd] target ids of the head's draft vocabulary.

    Built once per draft session (:func:`tree_grammar`); each round starts from
    :meth:`root`, the state after the committed generated tokens."""

    def __init__(self, grammar: GrammarSlot, vocab_ids: torch.Tensor):
        self.grammar = grammar
        self.automaton = grammar.automaton
        self.min_new_tokens = grammar.min_new_tokens
        width = self.automaton.vocab_size
        self.columns = vocab_ids.clamp(max=width - 1)  # [Vd] mask columns of the draft vocabulary
        self.in_grammar = vocab_ids < width  # [Vd] bool: ids past the grammar's vocabulary are never allowed
        eos = torch.tensor(sorted(self.automaton.eos_ids), dtype=torch.long, device=vocab_ids.device)
        self.is_eos = torch.isin(vocab_ids, eos)  # [Vd] bool
        self.num_generated = 0
        self.timer = grammar.timer  # the request's GrammarTimer, if any

    def root(self, committed: CommittedCounts):
        """The state after the committed generated tokens; None when they are already outside
        the grammar (the grammar processor then leaves logits unchanged, and so does drafting)."""
        self.num_generated = committed.num_generated
        timer = self.timer
        start = timer.now() if timer is not None else 0.0
        state = self.grammar.state_for(committed.tokens[committed.num_prompt :])
        if timer is not None:
            timer.spent(start)
        return state

    def advance(self, state, token: int):
        """The state after ``token``; None (no children) when it is forbidden, follows a
        forbidden token, or is EOS (the output ends there, so drafting past it is wasted)."""
        if token in self.automaton.eos_ids:
            return None
        timer = self.timer
        if timer is None:
            return self.automaton.advance(state, token)
        start = timer.now()
        child = self.automaton.advance(state, token)
        timer.spent(start)
        return child

    def allowed(self, states: list, depth: int) -> torch.Tensor:
        """[len(states), Vd] bool: the draft-vocabulary tokens allowed as a child of
        nodes in ``states`` (None: nothing), at tree depth ``depth`` (1 = the root's
        children), for the committed tokens of the last :meth:`root` call. Under the
        request's timer each node is one mask-time sample."""
        timer = self.timer
        start = last = timer.now(sync=True) if timer is not None else 0.0
        device = self.columns.device
        rows = []
        for s in states:
            rows.append(self.automaton.mask(s, device)[self.columns] if s is not None
                        else torch.zeros_like(self.in_grammar))  # [Vd]
            if timer is not None:
                last = timer.position(last)
        allowed = torch.stack(rows) & self.in_grammar  # [F, Vd]
        if self.num_generated + depth - 1 < self.min_new_tokens:
            allowed &= ~self.is_eos
        if timer is not None:
            timer.spent(start, last, len(states), sync=True)
        return allowed


def tree_grammar(ctx: DraftContext, vocab_ids: torch.Tensor) -> TreeGrammar | None:
    """The tree grammar of a request's stack, or None without a grammar."""
    grammar = grammar_of(ctx)
    return None if grammar is None else TreeGrammar(grammar, vocab_ids)


def masked_log_softmax(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [F, Vd], allowed [F, Vd] bool -> float32 log-probabilities of the masked,
    renormalised distribution [F, Vd]; -inf where forbidden (a row with nothing allowed is all -inf)."""
    logp = torch.log_softmax(logits.float().masked_fill(~allowed, NEG_INF), dim=-1)  # NaN on all -inf rows
    return logp.masked_fill(~allowed, NEG_INF)
