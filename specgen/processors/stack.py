"""An ordered processor stack: the one definition of the sampling distribution.

The same stack object produces the target distribution p at every candidate
position and the draft distribution q at every draft step; only the history
differs. Greedy mode skips argmax-invariant processors and takes the argmax.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from specgen.processors.history import History
from specgen.processors.standard import Processor
from specgen.sampling import argmax_or_none, argmax_tokens, normalise


class GrammarSlot(Processor, ABC):
    """What the stack's grammar slot holds (:class:`specgen.grammar.GrammarProcessor`): a pure
    processor masking what the grammar forbids, whose automaton drafters may also walk.

    automaton: the compiled grammar; min_new_tokens: the stack's minimum it was bound to;
    timer: the request's :class:`specgen.stats.GrammarTimer` (None: untimed).
    """

    name = "grammar"
    automaton: object
    min_new_tokens = 0
    timer = None

    @abstractmethod
    def bind(self, processors: Sequence[Processor]) -> GrammarSlot:
        """This grammar aware of the other ``processors`` of the stack it joins."""

    @abstractmethod
    def timed(self, timer) -> GrammarSlot:
        """This grammar for one request, metered by ``timer``: the same masks."""

    @abstractmethod
    def state_for(self, generated: list[int]):
        """The automaton state after the generated tokens ``generated`` (None if unreachable)."""


class ProcessorStack:
    """processors: applied in order, after ``grammar`` when there is one. greedy: temperature 0,
    argmax decoding. ``processors`` (the attribute) lists every processor in the order applied."""

    def __init__(self, processors: Sequence[Processor], greedy: bool, grammar: GrammarSlot | None = None):
        self.others = list(processors)
        self.grammar = grammar
        self.processors = [grammar, *self.others] if grammar is not None else list(self.others)
        self.greedy = greedy
        self._active = [p for p in self.processors if not (greedy and p.argmax_invariant)]

    @property
    def impure(self) -> list[Processor]:
        """Processors that cannot be evaluated on hypothetical histories."""
        return [p for p in self.processors if not p.pure]

    @property
    def host_tokens(self) -> bool:
        """Whether a processor in use reads token ids of the history (see Processor.host_tokens)."""
        return any(p.host_tokens for p in self._active)

    def logits(self, raw_logits: torch.Tensor, history: History) -> torch.Tensor:
        """raw_logits: [N, vocab] -> processed logits [N, vocab] (float32, a new tensor)."""
        out = raw_logits.to(torch.float32, copy=True)
        for processor in self._active:
            out = processor(out, history)
        return out

    def probs(self, raw_logits: torch.Tensor, history: History) -> torch.Tensor:
        """[N, vocab] -> float64 distributions [N, vocab] (sampling mode), without a host read:
        a row with NaN logits comes out NaN and a row with nothing allowed all zero, and
        the consumer refuses it (see :func:`specgen.sampling.normalise`)."""
        return normalise(self.logits(raw_logits, history))

    def argmax(self, raw_logits: torch.Tensor, history: History) -> list[int]:
        """[N, vocab] -> N greedy tokens, read back in one transfer (NoAllowedToken for
        a row with nothing allowed)."""
        return argmax_tokens(self.read_only(raw_logits, history))

    def argmax_or_none(self, raw_logits: torch.Tensor, history: History) -> list[int | None]:
        """[N, vocab] -> N greedy tokens in one transfer, None for a row with nothing
        allowed (a dead end; the verifiers decide what it means, see
        :func:`specgen.sampling.verify.verify_greedy`)."""
        return argmax_or_none(self.read_only(raw_logits, history))

    def read_only(self, raw_logits: torch.Tensor, history: History) -> torch.Tensor:
        """Processed logits for a consumer that only reads them: the raw float32 rows
        themselves where no processor is active (no copy)."""
        if not self._active and raw_logits.dtype == torch.float32:
            return raw_logits
        return self.logits(raw_logits, history)

    def with_timer(self, timer) -> ProcessorStack:
        """The stack one request runs: its grammar metered by ``timer`` (a
        :class:`specgen.stats.GrammarTimer`, see :meth:`specgen.grammar.GrammarProcessor.timed`);
        the same processors, order and outputs. Without a grammar, this stack."""
        if self.grammar is None:
            return self
        return ProcessorStack(self.others, greedy=self.greedy, grammar=self.grammar.timed(timer))

    def with_grammar(self, grammar: GrammarSlot) -> ProcessorStack:
        """A stack with ``grammar`` in its slot (in front), replacing any grammar already there.

        The grammar is bound to the rest of the stack first
        (:meth:`specgen.grammar.GrammarProcessor.bind`), so a ``min_new_tokens`` /
        ``bad_words`` combination that certainly leaves no output raises ConfigError here."""
        return ProcessorStack(self.others, greedy=self.greedy, grammar=grammar.bind(self.others))

    def describe(self) -> list[str]:
        return [repr(p) for p in self.processors]
