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
from specgen.sampling import greedy_token, normalise


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

    def logits(self, raw_logits: torch.Tensor, history: History) -> torch.Tensor:
        """raw_logits: [N, vocab] -> processed logits [N, vocab] (float32, a new tensor)."""
        out = raw_logits.to(torch.float32, copy=True)
        for processor in self._active:
            out = processor(out, history)
        return out

    def probs(self, raw_logits: torch.Tensor, history: History) -> torch.Tensor:
        """[N, vocab] -> float64 distributions [N, vocab] (sampling mode)."""
        return normalise(self.logits(raw_logits, history))

    def argmax(self, raw_logits: torch.Tensor, history: History) -> list[int]:
        """[N, vocab] -> N greedy tokens."""
        processed = self.logits(raw_logits, history)
        return [greedy_token(row) for row in processed]

    def with_grammar(self, grammar: Processor) -> ProcessorStack:
        """A stack with ``grammar`` in front, replacing any grammar already there."""
        others = [p for p in self.processors if p.name != "grammar"]
        return ProcessorStack([grammar, *others], greedy=self.greedy)

    def describe(self) -> list[str]:
        return [repr(p) for p in self.processors]
