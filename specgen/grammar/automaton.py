"""The grammar cursor: states after token sequences and allowed-token masks.

:class:`TokenAutomaton` wraps a backend's :class:`CompiledAutomaton` with the
rules every backend shares:

* EOS ids are allowed exactly in final (accepting) states and never move the
  state;
* a token the grammar forbids makes the sequence *unreachable* (state None);
  so does anything after it;
* masks are cached per state (bounded LRU), since generation revisits few
  states (inside a JSON string the state barely changes), and per device: a
  mask is copied to the logits' device once per state, not once per call.

States are hashable values (integers for outlines-core, prefix nodes for
llguidance), so a round can keep one per candidate (chain or tree node) and
roll back by forgetting them: the API is ``advance(state,
token)`` and ``mask(state)``, nothing is mutated. All caching here is a pure
cache: results depend only on the arguments.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from specgen.grammar.backend import CompiledAutomaton

#: Byte budget of the per-state mask cache.
MASK_CACHE_BYTES = 64 * 1024 * 1024


class TokenAutomaton:
    """compiled: the backend automaton; eos_ids: ids that end generation;
    vocab_size: width of the masks; description: a short name for messages;
    single_bytes: {byte: id of the one-byte token}, used by :meth:`forced_bytes`."""

    def __init__(self, compiled: CompiledAutomaton, eos_ids: Sequence[int], vocab_size: int, description: str,
                 single_bytes: Mapping[int, int] | None = None, backend: str = "custom"):
        self.compiled = compiled
        self.backend = backend
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.vocab_size = int(vocab_size)
        self.description = description
        self._eos_index = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        self._masks: OrderedDict = OrderedDict()  # state -> (mask, any allowed, {device: mask there})
        self._capacity = max(16, MASK_CACHE_BYTES // max(self.vocab_size, 1))
        self._lock = threading.Lock()
        singles = sorted((single_bytes or {}).items())
        self._single_values = [b for b, _ in singles]
        self._single_ids = torch.tensor([i for _, i in singles], dtype=torch.long)  # [num_single_byte_tokens]

    @property
    def initial_state(self):
        return self.compiled.initial_state

    def is_accepting(self, state) -> bool:
        """True if the tokens that led to ``state`` form a complete match."""
        return self.compiled.is_final(state)

    def advance(self, state, token: int):
        """The state after ``token``; None if ``state`` is None or the token is forbidden."""
        if state is None:
            return None
        if token in self.eos_ids:
            return state if self.compiled.is_final(state) else None
        if not 0 <= token < self.vocab_size:
            return None
        return self.compiled.next_state(state, token)

    def state_after(self, tokens: Sequence[int], state=None):
        """The state after ``tokens`` from ``state`` (default: the initial state)."""
        state = self.initial_state if state is None else state
        for token in tokens:
            state = self.advance(state, token)
            if state is None:
                return None
        return state

    def mask(self, state, device: torch.device | str | None = None) -> torch.Tensor:
        """[vocab_size] bool, True where a token is allowed in ``state`` (EOS included when final).

        device: where the mask is wanted (default CPU); each state's mask is copied
        there once and cached. The returned tensor is shared with the cache: do not modify it.
        """
        mask, _, copies = self._entry(state)
        if device is None or torch.device(device) == mask.device:
            return mask
        device = torch.device(device)
        if device not in copies:
            copies[device] = mask.to(device)
        return copies[device]

    def is_dead_end(self, state) -> bool:
        """True if no token at all (EOS included) is allowed in ``state``."""
        return not self._entry(state)[1]

    def _entry(self, state) -> tuple[torch.Tensor, bool, dict]:
        with self._lock:
            cached = self._masks.get(state)
            if cached is not None:
                self._masks.move_to_end(state)
                return cached
        mask = self._build_mask(state)
        entry = (mask, bool(mask.any()), {})
        with self._lock:
            self._masks[state] = entry
            while len(self._masks) > self._capacity:
                self._masks.popitem(last=False)
        return entry

    def _build_mask(self, state) -> torch.Tensor:
        mask = self.compiled.allowed_mask(state, self.vocab_size)  # [vocab]
        if len(self._eos_index):
            mask[self._eos_index] = self.compiled.is_final(state)
        return mask

    def forced_bytes(self, state, limit: int = 64) -> bytes:
        """The text every continuation from ``state`` starts with (up to ``limit`` bytes).

        Walks one-byte tokens while exactly one is allowed and the match is not
        complete, e.g. a JSON key the schema requires next; a drafter can propose
        its tokenization at no model cost. Exact when every byte has a one-byte
        token (byte-level vocabularies), a guess otherwise; empty without any.
        """
        if state is not None and not self.is_accepting(state):
            native = self.compiled.forced_bytes(state, limit)
            if native is not None:
                return native
        out = bytearray()
        while state is not None and len(out) < limit and len(self._single_ids) and not self.is_accepting(state):
            allowed = torch.nonzero(self.mask(state)[self._single_ids]).flatten()  # [num_allowed_single]
            if len(allowed) != 1:
                break
            index = int(allowed[0])
            out.append(self._single_values[index])
            state = self.advance(state, int(self._single_ids[index]))
        return bytes(out)

    def allowed(self, state) -> list[int]:
        """The allowed ids in ``state`` (for tests and debugging)."""
        return torch.nonzero(self.mask(state)).flatten().tolist()
