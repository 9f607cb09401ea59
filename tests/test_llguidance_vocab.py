"""llguidance over vocabularies that may not spell what a grammar needs.

Property: for any vocabulary, compiling either refuses with ConfigError, or
every token the mask allows is one the parser accepts (advancing never raises)
and a complete walk is a match. Small random vocabularies with fixed seeds:
some hold every one-byte token of the grammars' alphabet, some only random
strings, some every byte of UTF-8 text (the vocabularies compiled with forcing).
"""

from __future__ import annotations

import json
import random
import re
import sys

import pytest

from specgen.errors import ConfigError
from specgen.grammar.spec import GrammarSpec
from specgen.grammar.vocabulary import TokenBytes

llguidance_backend = pytest.importorskip("specgen.grammar.llguidance_backend")

ALPHABET = b'{}[]":,-0123456789abcdmnegyos '
UTF8_BYTES = [b for b in range(256) if b < 0xC0 or 0xC2 <= b < 0xF5]
OBJECT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# (kind, schema or regex, whether a complete output is a match)
GRAMMARS = [
    ("json_schema", {"type": "string", "maxLength": 6}, lambda v: isinstance(v, str) and len(v) <= 6),
    ("json_schema", OBJECT, lambda v: set(v) == {"name", "age"} and isinstance(v["age"], int)),
    ("json_schema", {"enum": ["yes", "no", "maybe"]}, lambda v: v in ("yes", "no", "maybe")),
    ("json_schema", {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
     lambda v: isinstance(v, list) and len(v) <= 3 and all(isinstance(i, int) for i in v)),
    ("regex", "[a-c]{2}-[0-9]+", None),
    ("regex", '"(ab|cd)*"', None),
]
SEEDS = range(30)
WALKS, STEPS = 3, 40


def _spec(kind: str, source) -> GrammarSpec:
    if kind == "regex":
        return GrammarSpec("regex", source, f"regex {source}")
    text = json.dumps(source)
    return GrammarSpec("json_schema", text, f"json_schema {text}", whitespace="")


def _vocabulary(seed: int) -> tuple[TokenBytes, str]:
    """A vocabulary of 20-80 random strings over ALPHABET (id 0 is EOS), and its class."""
    rng = random.Random(seed)
    kind = ("alphabet", "random", "utf8")[seed % 3]
    words = {bytes([b]) for b in ALPHABET} if kind == "alphabet" else set()
    if kind == "utf8":
        words = {bytes([b]) for b in UTF8_BYTES}
    target = len(words) + rng.randint(20, 80)
    while len(words) < target:
        words.add(bytes(rng.choice(ALPHABET) for _ in range(rng.randint(1, 4))))
    ordered = sorted(words)
    rng.shuffle(ordered)
    return TokenBytes((None, *ordered), (0,), "text", f"random-vocab-{seed}"), kind


def _complete(kind: str, source, check, data: bytes) -> bool:
    text = data.decode("utf-8")
    if kind == "regex":
        return re.fullmatch(source, text) is not None
    return check(json.loads(text))


def _walk(automaton, vocab: TokenBytes, rng: random.Random) -> bytes | None:
    """Random allowed tokens from the start; the bytes if the walk ended in a final state."""
    state, out = automaton.initial_state, b""
    for _ in range(STEPS):
        ids = automaton.allowed_ids(state).tolist()
        if automaton.is_final(state) and (not ids or rng.random() < 0.3):
            return out
        if not ids:
            return None  # a dead end: the vocabulary cannot spell what comes next
        token = rng.choice(ids)
        state = automaton.next_state(state, token)
        assert state is not None, f"the mask allowed token {vocab.by_id[token]!r} after {out!r}"
        out += vocab.by_id[token]
    return None


def test_random_vocabularies_allow_only_what_the_parser_accepts():
    backend = llguidance_backend.LLGuidanceBackend()
    refused = completed = 0
    for seed in SEEDS:
        vocab, vocab_kind = _vocabulary(seed)
        rng = random.Random(1000 + seed)
        for kind, source, check in GRAMMARS:
            try:
                automaton = backend.compile(_spec(kind, source), vocab)
            except ConfigError as exc:
                assert vocab_kind == "random", f"seed {seed}: refused {source} over every byte it needs: {exc}"
                assert "the tokenizer cannot express this grammar" in str(exc)
                refused += 1
                continue
            for _ in range(WALKS):
                try:
                    out = _walk(automaton, vocab, rng)
                except ConfigError as exc:
                    pytest.fail(f"seed {seed} ({vocab_kind}), {source}: {exc}")
                if out is not None:
                    assert _complete(kind, source, check, out), f"seed {seed}: {out!r} is not a match of {source}"
                    completed += 1
    assert refused and completed > 100  # both outcomes are exercised


def test_forcing_only_for_vocabularies_with_every_utf8_byte():
    complete, _ = _vocabulary(2)
    partial, _ = _vocabulary(0)
    assert llguidance_backend.can_force(complete) and not llguidance_backend.can_force(partial)


def _words(*words: bytes) -> TokenBytes:
    return TokenBytes((None, *words), (0,), "text", "words-" + "|".join(w.decode() for w in words))


def test_an_opening_text_no_token_path_spells_is_refused_at_compile():
    backend = llguidance_backend.LLGuidanceBackend()
    vocab = _words(b"{", b"na", b"me", b"a", b"1", b":")  # '{' but no token for the '"' after it
    with pytest.raises(ConfigError, match=r"""cannot express this grammar: .*starts with \('\{"name":"'\)"""):
        backend.compile(_spec("json_schema", OBJECT), vocab)
    with pytest.raises(ConfigError, match="cannot express this grammar: no token can start an output"):
        backend.compile(_spec("json_schema", {"type": "integer"}), _words(b"a", b"b"))


def test_a_dead_end_leaves_the_automaton_usable():
    """Nothing allowed after '"c' (no 'd'); llguidance stops there, the other paths still work."""
    vocab = _words(b'"', b"a", b"ab", b"c", b'b"')
    automaton = llguidance_backend.LLGuidanceBackend().compile(_spec("regex", '"(ab|cd)"'), vocab)
    quote = automaton.next_state(automaton.initial_state, 1)
    dead = automaton.next_state(quote, 4)
    assert not automaton.is_final(dead) and automaton.allowed_ids(dead).tolist() == []
    done = automaton.next_state(automaton.next_state(quote, 2), 5)
    assert automaton.is_final(done)
    assert automaton.allowed_ids(automaton.next_state(quote, 3)).tolist() == [1]


def test_tiny_model_refuses_a_schema_it_cannot_spell_before_any_token(monkeypatch, capsys):
    """``specgen target=tiny ... grammar=json_schema grammar.schema={"type":"string"}``: no ``"`` token."""
    from specgen.cli import main as cli

    argv = ["specgen", "target=tiny", "drafter=tiny", "threads=1", "prompt=hi", "grammar=json_schema",
            'grammar.schema={"type":"string"}']
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == ""
    assert err.strip().splitlines() == [
        "specgen: error: the tokenizer cannot express this grammar: no token sequence spells the text every "
        """output starts with ('"'); grammar: json_schema {"type":"string"}"""]


@pytest.mark.parametrize("pattern,reason", [("(a", "unclosed group"), ("a{2,1}", "invalid repetition count range")])
def test_a_schema_pattern_error_names_the_pattern_its_reason_and_where(pattern, reason):
    import string

    from grammar_helpers import char_info

    from specgen.errors import ConfigError
    from specgen.grammar import grammar_processor

    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": pattern}}}
    with pytest.raises(ConfigError) as error:
        grammar_processor({"kind": "json_schema", "backend": "llguidance", "schema": schema}, char_info(string.printable))
    message = str(error.value)
    assert f"invalid regex {pattern!r} ({reason}" in message and "#/properties/name/pattern" in message
