"""Per-request temperature / top_p: the served pipeline with another processor stack.

A request's ``temperature`` and ``top_p`` replace the values of the config's
``temperature`` and ``top_p`` processor entries; the stack is then rebuilt by
the same code the build uses (:func:`specgen.processors.build_stack`, the
config's grammar in front), so p and q both come from the new stack and the
drafter sees it through the request's draft context. The guarantee follows:
an ``exact`` or ``greedy`` pipeline becomes ``greedy`` at temperature 0 and
``exact`` otherwise (with any CUDA condition kept); ``approximate`` and ``off``
are unchanged, since the stack does not decide them.

Both schedulers get a request's pipeline from :class:`Variants`: the serial worker
runs it, the batched one plans the request's row with it (the row then carries
that stack and guarantee while sharing forwards with rows of other stacks).
"""

from __future__ import annotations

import copy

from specgen.engine.pipeline import Pipeline
from specgen.errors import ConfigError
from specgen.guarantee import Guarantee
from specgen.serve.protocol import Sampling

#: Sampling variants of the pipeline kept (least recently used dropped): each holds a rebuilt stack.
MAX_VARIANTS = 16


def configured(pipe: Pipeline) -> Sampling:
    """The sampling values the pipeline was built with (from its processor entries)."""
    values = {}
    for entry in pipe.config.processors:
        if entry.get("name") == "temperature":
            values["temperature"] = float(entry.get("temperature") or 0.0)
        if entry.get("name") == "top_p":
            values["top_p"] = float(1.0 if entry.get("top_p") is None else entry["top_p"])
    return Sampling(values.get("temperature"), values.get("top_p"))


def differs(pipe: Pipeline, sampling: Sampling) -> bool:
    """Whether ``sampling`` asks for anything other than the pipeline's own values."""
    base = configured(pipe)
    return any(value is not None and value != getattr(base, name)
               for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)))


def with_sampling(pipe: Pipeline, sampling: Sampling) -> Pipeline:
    """A pipeline sharing ``pipe``'s models and drafter, with ``sampling`` in its processor stack.

    ConfigError when the config's processor list has no entry for a value the
    request sets (a custom stack), or the grammar in the config cannot be rebuilt.
    """
    from specgen.engine.assemble import processor_entries
    from specgen.grammar import grammar_processor
    from specgen.processors import build_stack

    entries = [dict(entry) for entry in pipe.config.processors]
    for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p)):
        if value is None:
            continue
        matching = [entry for entry in entries if entry.get("name") == name]
        if not matching:
            raise ConfigError(f"{name} cannot be set per request: this server's processor stack has no {name} entry")
        for entry in matching:
            entry[name] = value
    greedy = pipe.stack.greedy if sampling.temperature is None else sampling.temperature == 0.0
    tokenizer = pipe.tokenizer
    stack = build_stack(processor_entries(entries, tokenizer), greedy=greedy,
                        eos_ids=tokenizer.eos_ids, vocab_size=tokenizer.vocab_size)
    grammar = grammar_processor(pipe.config.grammar or {"kind": "none"}, tokenizer)
    if grammar is not None:
        stack = stack.with_grammar(grammar)
    variant = copy.copy(pipe)
    variant.stack = stack
    variant.guarantee = _guarantee(pipe.guarantee, stack.greedy)
    return variant


def _guarantee(guarantee: Guarantee, greedy: bool) -> Guarantee:
    if not guarantee.exact:
        return guarantee
    return guarantee.with_kind("greedy" if greedy else "exact")


class Variants:
    """``pipe`` as each request's sampling asks (:func:`with_sampling`), the last ``size`` variants
    kept. Used from one thread (the scheduler's)."""

    def __init__(self, pipe: Pipeline, size: int = MAX_VARIANTS):
        self.pipe, self.size = pipe, size
        self._kept: dict[Sampling, Pipeline] = {}

    def get(self, sampling: Sampling) -> Pipeline:
        """``pipe`` itself when ``sampling`` changes nothing; else a variant (ConfigError as with_sampling)."""
        if not differs(self.pipe, sampling):
            return self.pipe
        variant = self._kept.pop(sampling, None) or with_sampling(self.pipe, sampling)
        self._kept[sampling] = variant  # most recently used last
        while len(self._kept) > self.size:
            self._kept.pop(next(iter(self._kept)))
        return variant
