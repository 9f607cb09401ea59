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
  EOS id in the vocabulary), or none left once the stack's ``min_new_tokens``
  and ``bad_words`` are applied (see :meth:`GrammarProcessor.bind`) -- a
  *dead end*:

  - at the committed position (no draft candidate in the row's history, i.e.
    not ``history.draft_dependent(row)``) -> :class:`~specgen.errors.DeadEndError`
    naming the reason; the engine ends the request with
    ``finish_reason="dead_end"``, as plain decoding does;
  - at a position that depends on draft candidates -> the row is all ``-inf``
    (nothing allowed). The candidate that led there may yet be rejected, so this
    must not end the request; the verifier reads the empty row as "the prefix
    up to here is a dead end" and ends with ``kind="dead_end"`` only if it
    accepts that prefix (see :mod:`specgen.sampling.rejection`).

The processor remembers the states along the most recent token path (a pure
cache): each round only walks the tokens added since the previous call.

Each request runs its own copy, :meth:`GrammarProcessor.timed` (made when the
request is opened, :meth:`specgen.processors.ProcessorStack.with_timer`): same
automaton and masks, its own path cache, and a :class:`~specgen.stats.GrammarTimer`
that charges the work to the request's ``"grammar"`` stage and records the mask
time of each position. The timer only reads the clock, so outputs stay a pure
function of the history.
"""

from __future__ import annotations

import threading

import torch

from specgen.errors import DeadEndError
from specgen.grammar.automaton import TokenAutomaton
from specgen.processors.history import History
from specgen.processors.stack import GrammarSlot
from specgen.processors.standard import NEG_INF, BadWords, MinNewTokens, banned_after
from specgen.stats import GrammarTimer


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


class GrammarProcessor(GrammarSlot):
    """automaton: the compiled grammar for the pipeline's tokenizer."""

    name = "grammar"
    pure = True
    host_tokens = True
    argmax_invariant = False

    def __init__(self, automaton: TokenAutomaton, min_new_tokens: int = 0,
                 bad_words: tuple[tuple[int, ...], ...] = (), timer: GrammarTimer | None = None):
        self.automaton = automaton
        self.min_new_tokens = int(min_new_tokens)
        self.bad_words = tuple(tuple(int(t) for t in seq) for seq in bad_words if seq)
        self.timer = timer
        self._path: list[int] = []
        self._states: list[int | None] = [automaton.initial_state]  # _states[i]: state after _path[:i]
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"grammar({self.automaton.description})"

    def timed(self, timer: GrammarTimer) -> GrammarProcessor:
        """This grammar for one request, metered by ``timer``: the same masks (the timer
        only reads the clock), its own path cache. See :class:`specgen.stats.GrammarTimer`."""
        return GrammarProcessor(self.automaton, self.min_new_tokens, self.bad_words, timer)

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
        """logits: [num_positions, width] -> the same tensor with forbidden tokens at -inf.

        Raises DeadEndError for a dead end at the committed position only; a dead
        end at a draft-dependent row leaves that row all -inf (module docstring).
        With a timer, each row is one mask-time sample and the call is charged to
        the grammar stage."""
        timer = self.timer
        start = last = timer.now(sync=True) if timer is not None else 0.0
        recorded = 0
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        try:
            for row in range(logits.shape[0]):
                mask = self._row_mask(history, row, logits.device)
                if mask is not None:
                    rows.append(row)
                    masks.append(mask)
                if timer is not None:
                    last = timer.position(last)
                    recorded += 1
            return self._apply(logits, rows, masks)
        finally:
            if timer is not None:
                timer.spent(start, last, recorded, sync=True)

    def _row_mask(self, history: History, row: int, device: torch.device) -> torch.Tensor | None:
        """[vocab] bool of the tokens allowed at ``row``; None when the row is unreachable (left unmasked)."""
        generated = history.full(row)[history.committed.num_prompt :]
        state = self.state_for(generated)
        if state is None:
            return None
        reason = self._dead_end_reason(state, history, row, len(generated))
        if reason is None:
            return self.automaton.mask(state, device)  # [vocab] bool, cached on that device
        if not history.draft_dependent(row):
            raise DeadEndError(reason)
        return torch.zeros(self.automaton.vocab_size, dtype=torch.bool, device=device)  # [vocab]

    @staticmethod
    def _apply(logits: torch.Tensor, rows: list[int], masks: list[torch.Tensor]) -> torch.Tensor:
        """logits [num_positions, width] with each of ``rows`` masked by its [vocab] bool mask."""
        if not rows:
            return logits
        allowed = torch.stack(masks)  # [num_reachable, vocab]
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

    def bind(self, processors) -> GrammarProcessor:
        """This grammar aware of the stack's ``min_new_tokens`` and ``bad_words`` processors.

        Raises ConfigError when the combination certainly leaves no output
        (:func:`specgen.grammar.compat.check_reachable`); otherwise a run that
        meets such a dead end ends with ``finish_reason="dead_end"`` (DeadEndError
        with the reason at the committed position, an all -inf row at a draft
        position), instead of the sampler's "every token is forbidden".
        :meth:`specgen.processors.ProcessorStack.with_grammar` binds every grammar it adds.
        """
        from specgen.grammar.compat import check_reachable

        min_new = max((p.min_new_tokens for p in processors if isinstance(p, MinNewTokens)), default=0)
        bad = tuple(tuple(seq) for p in processors if isinstance(p, BadWords) for seq in p.sequences)
        bound = GrammarProcessor(self.automaton, min_new, bad)
        check_reachable(bound)
        return bound

    def _dead_end_reason(self, state: int, history: History, row: int, num_generated: int) -> str | None:
        """Why nothing can be sampled at ``row`` (reachable grammar state ``state``), or None if something can."""
        if self.automaton.is_dead_end(state):
            return self._dead_end_message(state, num_generated)
        if self.min_new_tokens or self.bad_words:
            return self._nothing_left(state, history, row, num_generated)
        return None

    def _nothing_left(self, state: int, history: History, row: int, num_generated: int) -> str | None:
        """The reason when ``min_new_tokens`` / ``bad_words`` ban every token the grammar allows, else None."""
        mask = self.automaton.mask(state)  # [vocab] bool (CPU, cached)
        eos = self.automaton.eos_ids
        banned = banned_after(self.bad_words, history, row) if self.bad_words else set()
        if num_generated < self.min_new_tokens:
            banned |= eos
        if not banned or any(i not in banned for i in self._first_allowed(mask, len(banned) + 1)):
            return None
        reason = (f"min_new_tokens={self.min_new_tokens} forbids EOS" if num_generated < self.min_new_tokens
                  and self.automaton.is_accepting(state) else "bad_words forbid every token it allows")
        return (f"grammar {self.automaton.description}: after {num_generated} generated tokens "
                f"the grammar allows no token that sampling allows ({reason})")

    @staticmethod
    def _first_allowed(mask: torch.Tensor, count: int) -> list[int]:
        """Up to ``count`` allowed ids (enough to tell whether one survives ``count - 1`` bans)."""
        ids = torch.nonzero(mask).flatten()
        return ids[:count].tolist()

    def _dead_end_message(self, state: int, num_generated: int) -> str:
        where = f"after {num_generated} generated tokens"
        if self.automaton.is_accepting(state):
            return (f"grammar {self.automaton.description}: the output is complete {where} but the "
                    "tokenizer has no EOS id to end it and the grammar allows nothing more")
        return f"grammar {self.automaton.description}: no token can continue the output {where}"
