"""Grammar constraints (JSON schema / regex) as a pure processor in the stack.

>>> from specgen.grammar import grammar_processor
>>> proc = grammar_processor({"kind": "regex", "pattern": "(at|ta)e*"}, tokenizer_info)  # doctest: +SKIP

``grammar_processor`` validates the spec, compiles it for the tokenizer with the
chosen backend (``auto``: the first of :data:`~specgen.grammar.registry.AUTO_ORDER`
that supports it; cached in memory, and on disk where the backend can) and
returns a :class:`GrammarProcessor` to put at the front of the processor stack,
so it shapes both the target's p and the drafter's q. Every bad input raises
:class:`~specgen.errors.ConfigError` here, before any generation starts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

from specgen.errors import ConfigError
from specgen.grammar.automaton import TokenAutomaton
from specgen.grammar.backend import CompiledAutomaton, GrammarBackend
from specgen.grammar.registry import AUTO_ORDER, BACKENDS, candidates, get_backend
from specgen.grammar.processor import GrammarProcessor
from specgen.grammar.schema_check import Unsupported
from specgen.grammar.spec import GrammarSpec, load_schema, parse_spec
from specgen.grammar.vocabulary import TokenBytes, token_bytes

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "CompiledAutomaton",
    "GrammarBackend",
    "GrammarProcessor",
    "GrammarSpec",
    "TokenAutomaton",
    "TokenBytes",
    "Unsupported",
    "compile_grammar",
    "grammar_processor",
    "load_schema",
    "parse_spec",
    "token_bytes",
]

_compiled: OrderedDict[tuple, TokenAutomaton] = OrderedDict()
_compiled_lock = threading.Lock()
_COMPILED_CAPACITY = 16


def compile_grammar(spec: GrammarSpec, tokenizer) -> TokenAutomaton:
    """The token automaton of ``spec`` for ``tokenizer`` (a TokenizerInfo); memoised.

    With several candidate backends (``auto``), one that raises
    :class:`Unsupported` passes the spec to the next; if none takes it, the
    first refusal is raised (it names the keyword and its JSON pointer).
    """
    vocab = token_bytes(tokenizer)
    key = (spec, vocab.fingerprint)
    with _compiled_lock:
        if key in _compiled:
            _compiled.move_to_end(key)
            return _compiled[key]
    refusals: list[Unsupported] = []
    for name in candidates(spec.backend):
        try:
            backend = get_backend(name)
            backend.check(spec)
            compiled = backend.compile(spec, vocab)
        except Unsupported as exc:
            refusals.append(exc)
            continue
        automaton = TokenAutomaton(compiled, vocab.eos_ids, vocab.vocab_size, spec.description,
                                   vocab.single_byte_ids(), backend=backend.name)
        _check_ends(automaton, spec)
        with _compiled_lock:
            _compiled[key] = automaton
            while len(_compiled) > _COMPILED_CAPACITY:
                _compiled.popitem(last=False)
        return automaton
    raise refusals[0]


def _check_ends(automaton: TokenAutomaton, spec: GrammarSpec) -> None:
    """Without an EOS id a complete match must be continuable, else generation would dead-end."""
    if automaton.eos_ids:
        return
    finals = automaton.compiled.final_states()
    states = [automaton.initial_state] if finals is None else [automaton.initial_state, *finals]
    if any(automaton.is_dead_end(state) for state in states):
        raise ConfigError(f"{spec.description}: the tokenizer has no EOS id, so an output that completes "
                          "the grammar could never end; add the EOS id (target.eos_ids=[...])")


def grammar_processor(spec: Mapping | None, tokenizer) -> GrammarProcessor | None:
    """spec: the ``grammar`` config (see :mod:`specgen.grammar.spec`); tokenizer: a TokenizerInfo.

    Returns None for ``{"kind": "none"}``. Raises ConfigError for an invalid or
    unsupported schema, an invalid regex, an empty language, a missing schema
    file, or a grammar the tokenizer cannot spell.
    """
    parsed = parse_spec(spec)
    if parsed is None:
        return None
    return GrammarProcessor(compile_grammar(parsed, tokenizer))
