"""An ordered processor stack: the one definition of the sampling distribution.

The same stack object produces the target distribution p at every candidate
position and the draft distribution q at every draft step; only the history
differs. Greedy mode skips argmax-invariant processors and takes the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specgen.processors.history import History
from specgen.processors.standard import Processor
from specgen.sampling import argmax_or_none, argmax_tokens, normalise


class ProcessorStack:
    """processors: applied in order. greedy: temperature 0, argmax decoding."""

    def __init__(self, processors: Sequence[Processor], greedy: bool):
        self.processors = list(processors)
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
        return argmax_tokens(self.logits(raw_logits, history))

    def argmax_or_none(self, raw_logits: torch.Tensor, history: History) -> list[int | None]:
        """[N, vocab] -> N greedy tokens in one transfer, None for a row with nothing
        allowed (a dead end; the verifiers decide what it means, see
        :func:`specgen.sampling.verify_chain_greedy`)."""
        return argmax_or_none(self.logits(raw_logits, history))

    @property
    def grammar(self) -> Processor | None:
        """The grammar processor in the stack (:class:`specgen.grammar.GrammarProcessor`), or None."""
        return next((p for p in self.processors if p.name == "grammar"), None)

    def with_timer(self, timer) -> ProcessorStack:
        """The stack one request runs: its grammar metered by ``timer`` (a
        :class:`specgen.stats.GrammarTimer`, see :meth:`specgen.grammar.GrammarProcessor.timed`);
        the same processors, order and outputs. Without a grammar that can be timed, this stack."""
        grammar = self.grammar
        if grammar is None or not hasattr(grammar, "timed"):
            return self
        timed = grammar.timed(timer)
        return ProcessorStack([timed if p is grammar else p for p in self.processors], greedy=self.greedy)

    def with_grammar(self, grammar: Processor) -> ProcessorStack:
        """A stack with ``grammar`` in front, replacing any grammar already there.

        A grammar with ``bind`` (:meth:`specgen.grammar.GrammarProcessor.bind`) is
        bound to the rest of the stack first, so a ``min_new_tokens`` / ``bad_words``
        combination that certainly leaves no output raises ConfigError here."""
        others = [p for p in self.processors if p.name != "grammar"]
        bound = grammar.bind(others) if hasattr(grammar, "bind") else grammar
        return ProcessorStack([bound, *others], greedy=self.greedy)

    def describe(self) -> list[str]:
        return [repr(p) for p in self.processors]
