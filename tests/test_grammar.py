"""Grammar constraints: masks, EOS, dead ends, exactness with speculation, grammars/, bad input.

Everything here runs on character tokenizers, small tokenizers trained in code
and the tiny random models (threads=1); the real model is in test_grammar_model.py.
"""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from conftest import tiny_pipeline
from exact import exact_distribution, goodness_of_fit, sample_counts
from grammar_helpers import (
    GRAMMARS,
    PRINTABLE_ASCII,
    allowed_rows,
    byte_level_tokenizer,
    char_info,
    history,
    sentencepiece_tokenizer,
)

import specgen.grammar
from specgen.config.compose import compose, to_container
from specgen.errors import ConfigError, DeadEndError
from specgen.grammar import (
    GrammarProcessor,
    TokenAutomaton,
    grammar_processor,
    token_bytes,
)
from specgen.grammar import backend as grammar_backend
from specgen.grammar.backend import CompiledAutomaton
from specgen.grammar.spec import GRAMMAR_FILE_BYTES, MAX_SCHEMA_DEPTH
from specgen.models.tiny import TinyTokenizer
from specgen.models.tokenizer import TokenizerInfo
from specgen.processors import History

TINY_REGEX = "(at|ta)[en]{0,3}"  # over the tiny alphabet: ids a=4, t=3, e=2, n=7
JSON_CHARS = '{}":,[] ab0123-'  # 15 characters + EOS = the tiny models' 16 ids
TINY_SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]},
               "b": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 3}}, "required": ["a", "b"],
               "additionalProperties": False}
BACKEND_NAMES = ["llguidance", "outlines_core"]
NUM_SAMPLES = 1200  # the count test_exactness justifies (a half-wrong residual is still caught there)
MIN_P_VALUE = 1e-3


@pytest.fixture(autouse=True)
def grammar_cache(tmp_path, monkeypatch):
    """Compiled grammars go to a per-test directory; the in-memory cache starts empty."""
    monkeypatch.setattr(grammar_backend, "cache_dir", lambda: tmp_path / "grammars")
    specgen.grammar._compiled.clear()
    yield tmp_path / "grammars"


def regex_proc(pattern: str, info: TokenizerInfo, backend: str = "auto") -> GrammarProcessor:
    return grammar_processor({"kind": "regex", "pattern": pattern, "backend": backend}, info)


def with_grammar(pipe, processor):
    """The pipeline's stack with ``processor`` in front (what build.py / generate(regex=) do)."""
    return pipe.stack.with_grammar(processor)


# --- masks on the tiny char tokenizer -------------------------------------------------

def test_regex_masks_follow_the_automaton():
    info = TokenizerInfo(TinyTokenizer(30))
    a, b, c = (info.tokenizer.encode(ch)[0] for ch in "abc")
    proc = regex_proc("(ab|ba)c*", info)
    logits = proc(torch.zeros(4, 30), history(info, [5, 6], [], [a, b, c]))  # [4, vocab]
    assert allowed_rows(logits) == [sorted([a, b]), [b], sorted([0, c]), sorted([0, c])]
    after_b = proc(torch.zeros(2, 30), history(info, [5], [b], [a]))
    assert allowed_rows(after_b) == [[a], sorted([0, c])]


def test_eos_only_in_accepting_states_and_never_advances():
    info = TokenizerInfo(TinyTokenizer(30))
    a, b = info.tokenizer.encode("ab")
    automaton = regex_proc("(ab|ba)c*", info).automaton
    start = automaton.initial_state
    done = automaton.state_after([a, b])
    assert not automaton.is_accepting(start) and automaton.is_accepting(done)
    assert automaton.advance(start, 0) is None
    assert automaton.advance(done, 0) == done
    assert not automaton.mask(start)[0] and automaton.mask(done)[0]


def test_unreachable_rows_are_left_unmasked():
    info = TokenizerInfo(TinyTokenizer(30))
    a, b = info.tokenizer.encode("ab")
    proc = regex_proc("(ab|ba)c*", info)
    raw = torch.randn(4, 30)
    out = proc(raw.clone(), history(info, [1], [], [a, a, b]))  # the second 'a' is forbidden
    assert allowed_rows(out[:2]) == [sorted([a, b]), [b]]
    assert torch.equal(out[2:], raw[2:])
    committed_bad = proc(raw[:1].clone(), history(info, [1], [a, a]))
    assert torch.equal(committed_bad, raw[:1])


def test_prompt_is_not_part_of_the_constrained_output():
    info = TokenizerInfo(TinyTokenizer(30))
    a, b = info.tokenizer.encode("ab")
    proc = regex_proc("(ab|ba)c*", info)
    assert allowed_rows(proc(torch.zeros(1, 30), history(info, [a, b, a], []))) == [sorted([a, b])]


def test_json_schema_masks_on_a_char_tokenizer():
    info = char_info(PRINTABLE_ASCII)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    automaton = grammar_processor({"kind": "json_schema", "schema": schema}, info).automaton
    assert automaton.allowed(automaton.initial_state) == info.tokenizer.encode("{")
    text = '{"ok": true}'
    state = automaton.initial_state
    for i, token in enumerate(info.tokenizer.encode(text)):
        assert automaton.mask(state)[token], f"{text[i]!r} refused after {text[:i]!r}"
        assert not automaton.mask(state)[0], "EOS before the document is complete"
        state = automaton.advance(state, token)
    assert automaton.is_accepting(state) and automaton.allowed(state) == [0]
    assert automaton.state_after(info.tokenizer.encode('{"no')) is None


@pytest.mark.parametrize("pattern, text", [
    ("(at)*", "atatat"),                      # outlines-core 0.2.14 alone refuses the second "at"
    ("[0-9]+(\\.[0-9]+)?", "12.5"),           # ... and any decimals
    ("^[0-9]{4}$", "2024"),                   # anchors are implicit
])
def test_continuations_after_a_complete_match_are_kept(pattern, text):
    info = char_info(PRINTABLE_ASCII)
    automaton = regex_proc(pattern, info).automaton
    state = automaton.state_after(info.tokenizer.encode(text))
    assert state is not None and automaton.is_accepting(state)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_bounded_string_lengths_compile_quickly(backend):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 60}}, "required": ["a"]}
    info = char_info(PRINTABLE_ASCII)
    automaton = grammar_processor({"kind": "json_schema", "schema": schema, "backend": backend}, info).automaton
    long_value = info.tokenizer.encode('{"a": "' + "x" * 60)
    assert automaton.state_after(long_value) is not None
    assert automaton.allowed(automaton.state_after(long_value)) == info.tokenizer.encode('"')


def test_forced_bytes_are_what_every_continuation_starts_with():
    info = char_info(PRINTABLE_ASCII)
    spaced = grammar_processor({"kind": "json_schema", "schema": str(GRAMMARS / "person.schema.json")}, info).automaton
    assert spaced.forced_bytes(spaced.initial_state) == b"{"
    assert spaced.forced_bytes(spaced.state_after(info.tokenizer.encode("{"))) == b""
    assert spaced.forced_bytes(spaced.state_after(info.tokenizer.encode("{ "))) == b'"name"'
    compact = grammar_processor({"kind": "json_schema", "schema": str(GRAMMARS / "person.schema.json"),
                                 "whitespace": ""}, info).automaton
    assert compact.forced_bytes(compact.initial_state) == b'{"name":"'
    done = compact.state_after(info.tokenizer.encode('{"name":"A","birth_year":null,"occupation":"x"}'))
    assert compact.is_accepting(done) and compact.forced_bytes(done) == b""


def test_memo_is_only_a_cache():
    """Any order of histories gives what a fresh processor gives for each one."""
    info = TokenizerInfo(TinyTokenizer(16))
    shared = regex_proc("[eaoiu]{2,8}( [tnsh]{1,3}){0,2}", info)
    rng = random.Random(0)
    for _ in range(60):
        generated = [rng.choice([2, 4, 5, 6, 13, 1, 3, 7]) for _ in range(rng.randrange(0, 8))]
        candidates = [rng.choice([2, 4, 1, 3, 0]) for _ in range(rng.randrange(0, 4))]
        h = history(info, [9], generated, candidates)
        fresh = GrammarProcessor(shared.automaton)
        raw = torch.randn(len(candidates) + 1, 16)
        assert torch.equal(shared(raw.clone(), h), fresh(raw.clone(), h))


# --- dead ends ---------------------------------------------------------------------------

class DeadEndAutomaton(CompiledAutomaton):
    """'a' (id 4), then a non-final state that allows nothing."""

    initial_state = 0

    def next_state(self, state, token):
        return 1 if state == 0 and token == 4 else None

    def allowed_ids(self, state):
        return torch.tensor([4] if state == 0 else [], dtype=torch.long)

    def is_final(self, state):
        return False


def test_dead_end_raises_in_the_processor_and_ends_generation():
    proc = GrammarProcessor(TokenAutomaton(DeadEndAutomaton(), [0], 16, "dead-end test"))
    info = TokenizerInfo(TinyTokenizer(16))
    with pytest.raises(DeadEndError, match="no token can continue"):
        proc(torch.zeros(1, 16), history(info, [1], [4]))
    for speculative in (False, True):
        pipe = tiny_pipeline("sampling.temperature=1.0")
        pipe.stack = with_grammar(pipe, proc)
        gen = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=6, speculative=speculative)
        assert gen.finish_reason == "dead_end"
        assert gen.token_ids == [4], "the dead end after 'a' ends the run after 'a', speculative or not"


def test_eosless_tokenizer_dead_ends_at_a_complete_match():
    pipe = tiny_pipeline("sampling.temperature=1.0")
    pipe.tokenizer = char_info(" etaoinshrdlucm", eos=False)
    gen = pipe.generate(prompt_ids=[1, 2, 3], regex="at", max_new_tokens=5, speculative=False)
    assert (gen.finish_reason, gen.text) == ("dead_end", "at")
    with pytest.raises(DeadEndError, match="complete"):
        regex_proc("at", pipe.tokenizer)(torch.zeros(1, 16), history(pipe.tokenizer, [1], [4, 3]))
    with pytest.raises(ConfigError, match="no EOS id"):
        regex_proc("", pipe.tokenizer)


# --- exactness with speculation ------------------------------------------------------------

EXACT_CASES = {
    "tiny_drafter": ("tiny", [1, 2, 3]),
    "ngram_forbidden_drafts": ("ngram", [4, 3, 8, 4, 3, 2, 2, 7, 1, 3, 4, 8]),  # "atsateen tas"
}


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_constrained_speculation_matches_constrained_target(name, backend):
    drafter, prompt = EXACT_CASES[name]
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3", drafter=drafter)
    assert str(pipe.guarantee) == "exact"
    proc = regex_proc(TINY_REGEX, pipe.tokenizer, backend)
    assert proc.automaton.backend == backend
    pipe.stack = with_grammar(pipe, proc)
    stack = pipe.stack
    expected = exact_distribution(pipe, prompt, 6, stack=stack)
    assert sum(expected.values()) == pytest.approx(1.0, abs=1e-6)
    assert len(expected) == 30, "every output ends with EOS inside 6 tokens"
    counts = sample_counts(pipe, prompt, 6, NUM_SAMPLES)
    for seq in counts:
        assert seq[-1] == 0 and re.fullmatch(TINY_REGEX, pipe.tokenizer.decode(seq))
    stats = pipe.generate(prompt_ids=prompt, max_new_tokens=6, seed=3).stats
    assert stats.drafted > 0
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > MIN_P_VALUE, f"{name}: chi-square p={p_value:.2e}, TV={tv:.3f}"


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_negative_control_masks_ignoring_candidates_fail(monkeypatch, backend):
    """If candidate positions were masked with the committed state, the same test must fail."""
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3")
    pipe.stack = with_grammar(pipe, regex_proc(TINY_REGEX, pipe.tokenizer, backend))
    expected = exact_distribution(pipe, [1, 2, 3], 6)
    monkeypatch.setattr(History, "full", lambda self, row: list(self.committed.tokens))
    counts = sample_counts(pipe, [1, 2, 3], 6, 400)
    p_value, _ = goodness_of_fit(counts, expected)
    assert p_value < MIN_P_VALUE


@pytest.mark.parametrize("drafter", ["tiny", "ngram"])
def test_constrained_greedy_speculation_equals_plain_greedy(drafter):
    pipe = tiny_pipeline(drafter=drafter)
    assert str(pipe.guarantee) == "greedy"
    pattern = "[eaoiu]{3,10}( [tnshrdlcm]{1,4}){0,3}"
    for prompt in ([1, 2, 3], [4, 3, 8, 4, 3, 2], [5, 5, 5, 6, 7]):
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=24, regex=pattern)
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=24, regex=pattern, speculative=False)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.drafted > 0
        if spec.finish_reason == "eos":
            assert re.fullmatch(pattern, spec.text)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_json_schema_on_tiny_models_gives_valid_documents(backend):
    jsonschema = pytest.importorskip("jsonschema")
    pipe = tiny_pipeline("sampling.temperature=1.0")
    pipe.tokenizer = char_info(JSON_CHARS)
    pipe.stack = with_grammar(pipe, grammar_processor({"kind": "json_schema", "schema": TINY_SCHEMA,
                                                       "backend": backend}, pipe.tokenizer))
    for seed in range(25):
        gen = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=40, seed=seed)
        assert gen.finish_reason == "eos", gen.text
        jsonschema.validate(json.loads(gen.text), TINY_SCHEMA)
    greedy = tiny_pipeline()
    greedy.tokenizer = char_info(JSON_CHARS)
    spec = greedy.generate(prompt_ids=[1, 2], max_new_tokens=40, schema=json.dumps(TINY_SCHEMA))
    plain = greedy.generate(prompt_ids=[1, 2], max_new_tokens=40, schema=json.dumps(TINY_SCHEMA), speculative=False)
    assert spec.token_ids == plain.token_ids


# --- byte-exact vocabularies -------------------------------------------------------------

def test_byte_level_vocabulary_is_byte_exact_for_multibyte_text():
    tokenizer = byte_level_tokenizer()
    info = TokenizerInfo(tokenizer)
    vocab = token_bytes(info)
    assert vocab.style == "byte_level"
    text = "café naïve 日本語 🙂 Zürich"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(vocab.by_id[i] for i in ids) == text.encode("utf-8")
    automaton = regex_proc("[é日]+", info).automaton
    words = [b""]
    for _ in range(4):
        words = [w + ch.encode() for w in words for ch in "é日"] + words
    expected = [i for i, data in enumerate(vocab.by_id)
                if data and any(w.startswith(data) and len(w) > len(data) - 1 for w in words if w)]
    assert automaton.allowed(automaton.initial_state) == expected
    assert automaton.is_accepting(automaton.state_after(tokenizer.encode("日é日", add_special_tokens=False)))


@pytest.mark.parametrize("backend, spellings", [
    ("outlines_core", {"▁", "▁a", "▁ab", "<0x20>"}),   # every token sequence that spells the text
    ("llguidance", {"▁ab"}),                          # forced text only as the tokenizer spells it
])
def test_sentencepiece_vocabulary_maps_spaces_and_byte_fallback(backend, spellings):
    tokenizer = sentencepiece_tokenizer()
    info = TokenizerInfo(tokenizer)
    vocab = token_bytes(info)
    assert vocab.style == "sentencepiece"
    ids = tokenizer.encode("ab é", add_special_tokens=False)
    assert b"".join(vocab.by_id[i] for i in ids) == " ab é".encode()
    automaton = regex_proc("( ab)+", info, backend).automaton
    allowed = {tokenizer.convert_ids_to_tokens(i) for i in automaton.allowed(automaton.initial_state)}
    assert allowed == spellings


def test_compiled_grammars_are_cached_on_disk(grammar_cache):
    info = char_info(PRINTABLE_ASCII)
    first = regex_proc("[0-9]{4}-[0-9]{2}", info, "outlines_core").automaton
    files = list(grammar_cache.glob("*.bin"))
    assert len(files) == 1
    files[0].write_bytes(b"corrupt")
    specgen.grammar._compiled.clear()
    again = regex_proc("[0-9]{4}-[0-9]{2}", info, "outlines_core").automaton
    assert again is not first
    assert again.allowed(again.initial_state) == first.allowed(first.initial_state)
    assert files[0].read_bytes() != b"corrupt"


# --- grammars/ ---------------------------------------------------------------------------

INVOICE = ('{{"invoice_number": "INV-001", "issue_date": "2024-03-15", "vendor": "Acme", "currency": "{currency}", '
           '"status": "paid", "line_items": [{items}], "total": 34.97}}')
ITEM = '{{"description": "{name}", "quantity": {quantity}, "unit_price": {price}}}'
WEATHER = ('{{"tool": "get_weather", "arguments": {{"location": {{"city": "Paris", "country_code": "FR"}}, '
           '"unit": "{unit}"}}}}')

EXAMPLES = {
    "person.schema.json": (
        ['{"name": "Ada Lovelace", "birth_year": 1815, "occupation": "mathematician", "nationality": "British"}',
         '{"name":"Alan Turing","birth_year":null,"occupation":"computer scientist"}'],
        ['{"name": "Ada"}', '{"name": "Ada", "birth_year": "1815", "occupation": "x"}']),
    "invoice.schema.json": (
        [INVOICE.format(currency="EUR", items=", ".join([ITEM.format(name="Widget", quantity=3, price=9.99),
                                                         ITEM.format(name="Shipping", quantity=1, price=5)]))],
        [INVOICE.format(currency="EURO", items=ITEM.format(name="W", quantity=3, price=9.99)),
         INVOICE.format(currency="EUR", items="")]),
    "tool_call.schema.json": (
        [WEATHER.format(unit="celsius"),
         '{"tool": "send_email", "arguments": {"to": ["ada@example.com"], "subject": "Hi", "body": "See you."}}',
         '{"tool": "search_web", "arguments": {"query": "speculative decoding", "max_results": 5}}'],
        [WEATHER.format(unit="kelvin"),
         '{"tool": "get_weather", "arguments": {"query": "rain", "max_results": 5}}']),
    "sentiment.schema.json": (['{"label": "positive"}', '{ "label": "neutral" }'], ['{"label": "happy"}']),
    "iso_date.regex": (["2024-02-29", "1999-12-31"], ["2024-2-29", "2024-13-01", "2024-02-32"]),
    "email.regex": (["ada.lovelace@example.co.uk", "x+tag@mail.org"], ["ada@", "ada example.com"]),
    "semver.regex": (["1.0.0", "2.10.3-rc.1+build.5", "0.1.0-alpha"], ["01.0.0", "1.0", "1.0.0-"]),
}


def _spec_for(path):
    if path.name.endswith(".schema.json"):
        return {"kind": "json_schema", "schema": str(path)}
    return {"kind": "regex", "pattern_file": str(path)}


def test_every_grammar_file_has_examples():
    assert sorted(p.name for p in GRAMMARS.iterdir() if p.is_file()) == sorted(EXAMPLES)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_grammar_file_accepts_valid_and_refuses_invalid_examples(name, backend):
    path = GRAMMARS / name
    info = char_info(PRINTABLE_ASCII)
    automaton = grammar_processor({**_spec_for(path), "backend": backend}, info).automaton
    valid, invalid = EXAMPLES[name]
    for text in valid:
        state = automaton.state_after(info.tokenizer.encode(text))
        assert state is not None and automaton.is_accepting(state), f"{name} refuses {text!r}"
    for text in invalid:
        state = automaton.state_after(info.tokenizer.encode(text))
        assert state is None or not automaton.is_accepting(state), f"{name} accepts {text!r}"
    if name.endswith(".schema.json"):
        jsonschema = pytest.importorskip("jsonschema")
        schema = json.loads(path.read_text())
        checker = jsonschema.validators.validator_for(schema)(schema)
        assert all(checker.is_valid(json.loads(t)) for t in valid)
        assert not any(checker.is_valid(json.loads(t)) for t in invalid)
    else:
        pattern = path.read_text().strip()
        assert all(re.fullmatch(pattern, t) for t in valid)
        assert not any(re.fullmatch(pattern, t) for t in invalid)


# --- configuration and bad input ---------------------------------------------------------

def test_config_groups_build_grammars():
    info = char_info(PRINTABLE_ASCII)
    cfg = to_container(compose(["grammar=json_schema", f"grammar.schema={GRAMMARS / 'person.schema.json'}"]))
    assert isinstance(grammar_processor(cfg["grammar"], info), GrammarProcessor)
    cfg = to_container(compose(["grammar=regex", f"grammar.pattern_file={GRAMMARS / 'semver.regex'}"]))
    assert isinstance(grammar_processor(cfg["grammar"], info), GrammarProcessor)
    assert grammar_processor(to_container(compose([]))["grammar"], info) is None
    for group in ("json_schema", "regex"):
        with pytest.raises(ConfigError, match="needs grammar"):
            grammar_processor(to_container(compose([f"grammar={group}"]))["grammar"], info)


def test_pydantic_models_are_schemas():
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    class Adult(pydantic.BaseModel):
        age: int = pydantic.Field(ge=18)

    info = char_info(PRINTABLE_ASCII)
    automaton = grammar_processor({"kind": "json_schema", "schema": Person}, info).automaton
    assert automaton.is_accepting(automaton.state_after(info.tokenizer.encode('{"name": "Al", "age": 3}')))
    adult = grammar_processor({"kind": "json_schema", "schema": Adult}, info).automaton
    assert adult.backend == "llguidance"
    assert adult.state_after(info.tokenizer.encode('{"age": 17}')) is None
    assert adult.is_accepting(adult.state_after(info.tokenizer.encode('{"age": 18}')))
    with pytest.raises(ConfigError, match="'minimum' at #/properties/age"):
        grammar_processor({"kind": "json_schema", "schema": Adult, "backend": "outlines_core"}, info)


BAD_INPUT = {
    "invalid schema": ({"kind": "json_schema", "schema": {"type": "strng"}}, "invalid or unsupported JSON schema"),
    "schema not JSON": ({"kind": "json_schema", "schema": '{"type": '}, "not valid JSON"),
    "required not in properties (outlines_core)": ({"kind": "json_schema", "backend": "outlines_core", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}}, "not listed in properties"),
    "unsupported feature": ({"kind": "json_schema", "schema": {"type": "array", "uniqueItems": True}},
                            "JSON schema keyword 'uniqueItems' at # is not supported by grammar.backend=llguidance"),
    "nested unsupported feature": ({"kind": "json_schema", "schema": {"type": "object", "properties": {
        "n": {"type": "array", "items": {"not": {"type": "null"}}}}}}, "'not' at #/properties/n/items"),
    "nested unsupported (outlines_core)": ({"kind": "json_schema", "backend": "outlines_core", "schema": {
        "type": "object", "properties": {"n": {"type": "number", "maximum": 3}}}}, "'maximum' at #/properties/n"),
    "remote $ref": ({"kind": "json_schema", "schema": {"$ref": "https://example.com/s.json"}},
                    "is not a local reference"),
    "overlapping oneOf": ({"kind": "json_schema", "schema": {"type": "object", "properties": {"v": {
        "oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, "'oneOf' at #/properties/v"),
    "unknown format": ({"kind": "json_schema", "schema": {"type": "string", "format": "color"}}, "'format'"),
    "missing schema file": ({"kind": "json_schema", "schema": "no/such/file.schema.json"}, "does not exist"),
    "empty-language regex": ({"kind": "regex", "pattern": r"[^\s\S]"}, "empty language"),
    "invalid regex": ({"kind": "regex", "pattern": "(ab"}, "invalid regex (missing ), unterminated subpattern"),
    "unterminated class": ({"kind": "regex", "pattern": "[a-z"}, "invalid regex (unterminated character set"),
    "lookaround": ({"kind": "regex", "pattern": "a(?=b)"}, "lookaround"),
    "backreference": ({"kind": "regex", "pattern": "(a)\\1"}, "backreferences are not supported"),
    "bad whitespace": ({"kind": "json_schema", "schema": {"type": "string"}, "whitespace": "["},
                       "grammar.whitespace '[' is not a valid regex: unterminated character set at position 0"),
    "unknown kind": ({"kind": "cfg"}, "grammar.kind"),
    "unknown key": ({"kind": "regex", "pattern": "a", "patern": "b"}, "unknown grammar keys"),
    "unknown backend": ({"kind": "regex", "pattern": "a", "backend": "nope"}, "unknown grammar.backend"),
}


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_is_a_clear_config_error(name):
    spec, message = BAD_INPUT[name]
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        grammar_processor(spec, char_info(PRINTABLE_ASCII))
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 300, "one short line"


def test_grammar_files_that_are_not_text_are_one_config_error(tmp_path):
    """A regex file that was not UTF-8 raised UnicodeDecodeError (a traceback, status 1); a directory was said
    not to exist; inline JSON that is not an object was taken for a file name."""
    info = char_info(PRINTABLE_ASCII)
    latin = tmp_path / "latin1.re"
    latin.write_bytes(b"caf\xe9[0-9]+\n")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (GRAMMAR_FILE_BYTES + 1))
    cases = [({"kind": "regex", "pattern_file": str(latin)}, f"regex file '{latin}' is not UTF-8 text (byte 0xe9 at "
              "offset 3)"),
             ({"kind": "regex", "pattern_file": str(tmp_path)}, f"regex file '{tmp_path}' is a directory"),
             ({"kind": "json_schema", "schema": str(latin)}, f"schema file '{latin}' is not UTF-8 text (byte 0xe9"),
             ({"kind": "json_schema", "schema": str(tmp_path)}, f"schema file '{tmp_path}' is a directory"),
             ({"kind": "json_schema", "schema": str(big)}, f"schema file '{big}' holds more than 4,194,304 bytes"),
             ({"kind": "json_schema", "schema": "[1, 2]"}, "grammar.schema must be a JSON object (a JSON schema), "
              "not list")]
    for spec, message in cases:
        with pytest.raises(ConfigError) as caught:
            grammar_processor(spec, info)
        assert str(caught.value).startswith(message), caught.value


def test_a_schema_nested_too_deeply_is_one_config_error():
    """A 500-level schema (20 KB of JSON) ran _plain out of Python's stack: RecursionError, a 500 from the
    server, a traceback from the CLI, a JSONL run stopped mid-file. MAX_SCHEMA_DEPTH levels still compile."""
    info = char_info(PRINTABLE_ASCII)

    def nested(levels: int) -> str:
        return '{"type": "array", "items": ' * (levels - 1) + '{"type": "string"}' + "}" * (levels - 1)

    grammar_processor({"kind": "json_schema", "schema": json.loads(nested(MAX_SCHEMA_DEPTH))}, info)
    for schema in (json.loads(nested(MAX_SCHEMA_DEPTH + 1)), nested(500), nested(100_000)):
        with pytest.raises(ConfigError, match="grammar.schema nests objects and arrays more than 100 levels deep"):
            grammar_processor({"kind": "json_schema", "schema": schema}, info)


def test_grammar_the_tokenizer_cannot_spell_is_refused():
    with pytest.raises(ConfigError, match="tokenizer cannot express"):
        grammar_processor({"kind": "json_schema", "schema": {"enum": ["x"]}}, TokenizerInfo(TinyTokenizer(16)))


def test_errors_come_before_generation():
    pipe = tiny_pipeline()
    with pytest.raises(ConfigError, match="not both"):
        pipe.stream(prompt_ids=[1, 2], regex="a", schema={"type": "string"})
    with pytest.raises(ConfigError, match="empty language"):
        pipe.stream(prompt_ids=[1, 2], regex=r"[^\s\S]")


def test_forced_text_lookahead_is_drafted_and_exact():
    """The ngram drafter proposes what the grammar forces ("tho"); outputs keep the target's distribution."""
    pattern = "(a|e)tho(n|s)e?"
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3", drafter="ngram")
    stack = with_grammar(pipe, regex_proc(pattern, pipe.tokenizer))
    expected = exact_distribution(pipe, [1, 2, 3], 7, stack=stack)
    assert len(expected) == 8
    gen = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=7, seed=0, regex=pattern)
    assert gen.stats.accepted >= 3 and gen.stats.target_calls <= 4
    counts = sample_counts(pipe, [1, 2, 3], 7, NUM_SAMPLES, regex=pattern)
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > MIN_P_VALUE, f"forced lookahead: chi-square p={p_value:.2e}, TV={tv:.3f}"
    off = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3", "drafter.grammar_lookahead=false",
                        drafter="ngram")
    assert off.generate(prompt_ids=[1, 2, 3], max_new_tokens=7, seed=0, regex=pattern).stats.accepted < gen.stats.accepted
