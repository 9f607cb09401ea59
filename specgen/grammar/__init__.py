"""Grammar constraints (JSON schema / regex) as a pure processor in the stack.

>>> from specgen.grammar import grammar_processor
>>> proc = grammar_processor({"kind": "regex", "pattern": "(at|ta)e*"}, tokenizer_info)  # doctest: +SKIP

``grammar_processor`` validates the spec, compiles it for the tokenizer (cached in
memory and on disk) and returns a :class:`GrammarProcessor` to put at the front
of the processor stack, so it shapes both the target's p and the drafter's q.
Every bad input raises :class:`~specgen.errors.ConfigError` here, before any
generation starts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

from specgen.errors import ConfigError
from specgen.grammar.automaton import TokenAutomaton
from specgen.grammar.backend import BACKENDS, CompiledAutomaton, GrammarBackend, get_backend
from specgen.grammar.processor import GrammarProcessor
from specgen.grammar.spec import GrammarSpec, load_schema, parse_spec, schema_to_regex
from specgen.grammar.vocabulary import TokenBytes, token_bytes

__all__ = [
    "BACKENDS",
    "CompiledAutomaton",
    "GrammarBackend",
    "GrammarProcessor",
    "GrammarSpec",
    "TokenAutomaton",
    "TokenBytes",
    "compile_grammar",
    "grammar_processor",
    "load_schema",
    "parse_spec",
    "schema_to_regex",
    "token_bytes",
]

_compiled: OrderedDict[tuple, TokenAutomaton] = OrderedDict()
_compiled_lock = threading.Lock()
_COMPILED_CAPACITY = 16


def compile_grammar(spec: GrammarSpec, tokenizer) -> TokenAutomaton:
    """The token automaton of ``spec`` for ``tokenizer`` (a TokenizerInfo); memoised."""
    vocab = token_bytes(tokenizer)
    key = (spec.backend, spec.regex, spec.description, vocab.fingerprint)
    with _compiled_lock:
        if key in _compiled:
            _compiled.move_to_end(key)
            return _compiled[key]
    backend = get_backend(spec.backend)
    automaton = TokenAutomaton(backend.compile(spec.regex, vocab), vocab.eos_ids, vocab.vocab_size,
                               spec.description, vocab.single_byte_ids())
    _check_ends(automaton, spec)
    with _compiled_lock:
        _compiled[key] = automaton
        while len(_compiled) > _COMPILED_CAPACITY:
            _compiled.popitem(last=False)
    return automaton


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
