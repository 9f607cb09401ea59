"""The grammar as a pure processor at the front of the stack.

For each row ``r`` of a batch the processor derives the grammar state from the
row's generated tokens, ``history.full(r)[num_prompt:]``, and sets every token
the grammar does not allow there to ``-inf``. Being a pure function of the
history is what keeps speculation exact: the engine evaluates the same stack
for the target at every candidate position (committed + candidates before it)
and for the drafter, so a candidate the grammar forbids has p = 0 and is
rejected, and nothing needs rolling back when a round is discarded.

Row outcomes:

* reachable and some token allowed -> masked logits;
* unreachable (the history contains a token the grammar forbids, i.e. a draft
  candidate that is rejected anyway) -> logits unchanged;
* reachable with no token allowed (a final state with no continuation and no
  EOS id in the vocabulary) -> :class:`~specgen.errors.DeadEndError`; the
  engine ends the request with ``finish_reason="dead_end"``.

The processor remembers the states along the most recent token path (a pure
cache): each round only walks the tokens added since the previous call.
"""

from __future__ import annotations

import threading

import torch

from specgen.errors import DeadEndError
from specgen.grammar.automaton import TokenAutomaton
from specgen.processors.history import History
from specgen.processors.standard import NEG_INF, Processor


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (slice compares run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class GrammarProcessor(Processor):
    """automaton: the compiled grammar for the pipeline's tokenizer."""

    name = "grammar"
    pure = True
    argmax_invariant = False

    def __init__(self, automaton: TokenAutomaton):
        self.automaton = automaton
        self._path: list[int] = []
        self._states: list[int | None] = [automaton.initial_state]  # _states[i]: state after _path[:i]
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"grammar({self.automaton.description})"

    def state_for(self, generated: list[int]) -> int | None:
        """The grammar state after the generated tokens ``generated`` (None if unreachable)."""
        with self._lock:
            keep = common_prefix_length(self._path, generated)
            if keep == len(generated):
                return self._states[keep]
            del self._path[keep:]
            del self._states[keep + 1 :]
            state = self._states[-1]
            for token in generated[keep:]:
                state = self.automaton.advance(state, token)
                self._path.append(token)
                self._states.append(state)
            return state

    def __call__(self, logits: torch.Tensor, history: History) -> torch.Tensor:
        """logits: [num_positions, width] -> the same tensor with forbidden tokens at -inf."""
        num_prompt = history.committed.num_prompt
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        for row in range(logits.shape[0]):
            generated = history.full(row)[num_prompt:]
            state = self.state_for(generated)
            if state is None:
                continue
            if self.automaton.is_dead_end(state):
                raise DeadEndError(self._dead_end_message(state, len(generated)))
            rows.append(row)
            masks.append(self.automaton.mask(state))  # [vocab] bool
        if not rows:
            return logits
        allowed = torch.stack(masks).to(logits.device)  # [num_reachable, vocab]
        width = logits.shape[-1]
        if allowed.shape[-1] < width:
            allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[-1]), value=False)
        elif allowed.shape[-1] > width:
            allowed = allowed[:, :width]
        if len(rows) == logits.shape[0]:
            return logits.masked_fill_(~allowed, NEG_INF)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, NEG_INF)
        return logits

    def _dead_end_message(self, state: int, num_generated: int) -> str:
        where = f"after {num_generated} generated tokens"
        if self.automaton.is_accepting(state):
            return (f"grammar {self.automaton.description}: the output is complete {where} but the "
                    "tokenizer has no EOS id to end it and the grammar allows nothing more")
        return f"grammar {self.automaton.description}: no token can continue the output {where}"
