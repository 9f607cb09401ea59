"""Grammar backends side by side: keyword coverage, refusals, bounded compiles, tree exactness,
ASCII regex classes, device mask caching, and min_new_tokens / bad_words with a grammar.

Char tokenizers and the tiny random models only (threads=1); fixed seeds.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from conftest import TINY, tiny_pipeline
from exact import exact_distribution, goodness_of_fit, sample_counts
from grammar_helpers import PRINTABLE_ASCII, byte_level_tokenizer, char_info, history, order_model

import specgen
import specgen.grammar
from specgen.errors import ConfigError, DeadEndError
from specgen.grammar import backend as grammar_backend
from specgen.grammar import registry as grammar_registry
from specgen.grammar import grammar_processor, token_bytes
from specgen.models.tokenizer import TokenizerInfo
from specgen.processors.standard import BadWords

jsonschema = pytest.importorskip("jsonschema")
BACKENDS = ["llguidance", "outlines_core"]


@pytest.fixture(autouse=True)
def grammar_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(grammar_backend, "cache_dir", lambda: tmp_path / "grammars")
    specgen.grammar._compiled.clear()


def automaton_for(schema, backend="auto", info=None):
    info = info or char_info(PRINTABLE_ASCII)
    return grammar_processor({"kind": "json_schema", "schema": schema, "backend": backend}, info).automaton, info


def accepts(automaton, info, text: str) -> bool:
    state = automaton.state_after(info.tokenizer.encode(text))
    return state is not None and automaton.is_accepting(state)


ITEM = {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}
FORMAT = jsonschema.Draft202012Validator.FORMAT_CHECKER
# name: (schema, valid documents, invalid documents); every valid one must validate with jsonschema.
COVERAGE = {
    "integer range": ({"type": "integer", "minimum": 1, "maximum": 99}, ["1", "42", "99"], ["0", "100", "-5"]),
    "exclusive bounds": ({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5}, ["1", "4"], ["0", "5"]),
    "number bounds": ({"type": "number", "minimum": 0.5, "maximum": 10}, ["0.5", "9.75", "10"], ["0.4", "10.5"]),
    "items of objects": ({"type": "array", "items": ITEM, "minItems": 2, "maxItems": 3},
                         ['[{"sku": "AB12", "qty": 3}, {"sku": "CD34", "qty": 99}]'],
                         ['[{"sku": "AB12", "qty": 3}]', '[{"sku": "ab12", "qty": 3}, {"sku": "CD34", "qty": 1}]']),
    "long bounded string": ({"type": "string", "minLength": 3, "maxLength": 400}, ['"abc"', '"' + "x" * 400 + '"'],
                            ['"ab"', '"' + "x" * 401 + '"']),
    "pattern": ({"type": "string", "pattern": "^[a-z]+-[0-9]+$"}, ['"ab-12"'], ['"AB-12"', '"ab-"']),
    "formats": ({"type": "object", "properties": {k: {"type": "string", "format": k} for k in
                 ("date", "time", "date-time", "email", "uuid", "uri")}, "required": ["date", "uuid"]},
                ['{"date": "2024-02-29", "time": "10:20:30Z", "date-time": "2024-01-01T00:00:00Z", '
                 '"email": "a@b.co", "uuid": "123e4567-e89b-12d3-a456-426614174000", "uri": "https://example.com/x"}'],
                ['{"date": "2024-13-01", "uuid": "123e4567-e89b-12d3-a456-426614174000"}',
                 '{"date": "2024-01-01", "uuid": "xyz"}']),
    "recursive $ref": ({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}, ['{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}'], ['{"v": 1, "kids": [{}]}']),
    "anyOf / const / enum": ({"anyOf": [{"const": "none"}, {"enum": [1, 2, 3]}]}, ['"none"', "2"], ["4", '"x"']),
    "exclusive oneOf": ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ['"a"', "3"], ["true"]),
    "additionalProperties typed": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                   ['{"a": 1, "b": 2}'], ['{"a": "x"}']),
    "required via additionalProperties": ({"type": "object", "properties": {"a": {"type": "string"}},
                                           "required": ["b"]}, ['{"a": "x", "b": 1}', '{"b": null}'], ['{"a": "x"}']),
}


@pytest.mark.parametrize("name", list(COVERAGE))
def test_auto_enforces_each_keyword(name):
    schema, valid, invalid = COVERAGE[name]
    automaton, info = automaton_for(schema)
    checker = jsonschema.Draft202012Validator(schema, format_checker=FORMAT)
    for text in valid:
        assert checker.is_valid(json.loads(text)), f"bad test data {text!r}"
        assert accepts(automaton, info, text), f"{automaton.backend} refuses {text!r}"
    for text in invalid:
        assert not accepts(automaton, info, text), f"{automaton.backend} accepts {text!r}"


def test_refusals_name_keyword_and_pointer_per_backend():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    for backend in BACKENDS:
        with pytest.raises(ConfigError, match=rf"'uniqueItems' at #/properties/tags .*backend={backend}"):
            automaton_for(schema, backend)
    with pytest.raises(ConfigError, match="'minimum' at #/properties/qty/minimum|'minimum' at #/items/properties/qty"):
        automaton_for({"type": "array", "items": ITEM}, "outlines_core")


@pytest.mark.parametrize("backend", ["llguidance", "outlines_core"])
def test_a_schema_pattern_that_is_not_a_regex_is_named_with_its_pointer_and_reason(backend):
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(a"}}}
    with pytest.raises(ConfigError, match=r"invalid regex '\(a' \(.*\) in #/properties/code/pattern of json_schema"):
        automaton_for(schema, backend)


def test_auto_falls_back_to_a_backend_that_supports_the_schema(monkeypatch):
    monkeypatch.setattr(grammar_registry, "AUTO_ORDER", ("outlines_core", "llguidance"))
    automaton, info = automaton_for({"type": "integer", "minimum": 3, "maximum": 7})
    assert automaton.backend == "llguidance" and accepts(automaton, info, "5") and not accepts(automaton, info, "8")
    automaton, _ = automaton_for({"type": "string", "maxLength": 3})
    assert automaton.backend == "outlines_core"


DRUPAL_ASSET = {"type": "object", "properties": {
    "attributes": {"type": "object", "additionalProperties": {"type": "string"}}, "minified": {"type": "boolean"},
    "preprocess": {"type": "boolean"}, "weight": {"type": "number"}, "type": {"enum": ["file", "external"]},
    "browsers": {"type": "object", "additionalProperties": {"type": "boolean"}}, "group": {"type": "integer"},
    "media": {"type": "string"}}}
#: The shape of the Drupal "libraries" schema that exhausted memory: an additionalProperties object
#: of optional properties, some with oneOf.
DRUPAL = {"type": "object", "additionalProperties": {"type": "object", "properties": {
    "version": {"oneOf": [{"type": "string"}, {"type": "number"}]}, "header": {"type": "boolean"},
    "remote": {"type": "string"}, "license": {"oneOf": [{"type": "string"}, {"type": "object", "properties": {
        "name": {"type": "string"}, "url": {"type": "string"}, "gpl-compatible": {"type": "boolean"}}}]},
    "js": {"type": "object", "additionalProperties": DRUPAL_ASSET},
    "css": {"type": "object", "additionalProperties": {"type": "object", "additionalProperties": DRUPAL_ASSET}},
    "dependencies": {"type": "array", "items": {"type": "string"}}, "drupalSettings": {"type": "object"},
    "deprecated": {"type": "string"}, "moved_files": {"type": "object"}}}}


def test_drupal_shaped_schema_compiles_within_budget_or_is_refused_by_name():
    start = time.monotonic()
    automaton, info = automaton_for(DRUPAL)
    assert automaton.backend == "llguidance" and time.monotonic() - start < 20
    doc = '{"core": {"version": "1.x", "js": {"a.js": {"minified": true}}, "dependencies": ["b/c"]}}'
    assert accepts(automaton, info, doc) and not accepts(automaton, info, '{"core": {"header": 1}}')
    start = time.monotonic()
    too_large = r"too large for grammar.backend=outlines_core.*mostly from #/additionalProperties"
    with pytest.raises(ConfigError, match=too_large):
        automaton_for(DRUPAL, "outlines_core")
    assert time.monotonic() - start < 20


def test_outlines_core_compiles_in_a_bounded_child():
    automaton, info = automaton_for({"type": "object", "properties": {"a": {"type": "integer"}}}, "outlines_core")
    assert accepts(automaton, info, '{"a": 12}')
    spec = {"kind": "regex", "pattern": "(a|b)*a(a|b){22}", "backend": "outlines_core", "compile_timeout_s": 2}
    start = time.monotonic()
    with pytest.raises(ConfigError, match="did not compile within 2 s"):
        grammar_processor(spec, char_info(PRINTABLE_ASCII))
    assert time.monotonic() - start < 10


def test_slow_compiles_report_progress(monkeypatch, capsys):
    monkeypatch.setattr(grammar_backend, "PROGRESS_AFTER_S", 0.0)
    enum = {"enum": [f"item-{i}" for i in range(3000)]}
    automaton_for(enum, "llguidance")
    assert "specgen: compiling grammar json_schema" in capsys.readouterr().err


def test_regex_classes_are_ascii():
    info = TokenizerInfo(byte_level_tokenizer())
    vocab = token_bytes(info)
    for backend in BACKENDS:
        automaton = grammar_processor({"kind": "regex", "pattern": r"\d{3}\s\w", "backend": backend}, info).automaton
        allowed = {vocab.by_id[i] for i in automaton.allowed(automaton.initial_state)}
        assert allowed and all(data[:1].isdigit() for data in allowed), backend
        assert accepts_bytes(automaton, info, "123 x") and not accepts_bytes(automaton, info, "١٢٣ x")


def accepts_bytes(automaton, info, text):
    state = automaton.state_after(info.tokenizer.encode(text, add_special_tokens=False))
    return state is not None and automaton.is_accepting(state)


def test_masks_are_cached_on_the_logits_device():
    automaton, _ = automaton_for({"type": "integer"}, "llguidance")
    state = automaton.initial_state
    first = automaton.mask(state, "meta")
    assert first.device.type == "meta" and automaton.mask(state, "meta") is first
    assert automaton.mask(state) is automaton.mask(state, "cpu")


# --- exactness of each backend with a tree drafter ------------------------------------------

TINY_REGEX = "(at|ta)[en]{0,3}"



@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_drafter_under_each_backend_is_exact(backend, tiny_eagle_head):
    pipe = specgen.pipeline(*TINY, "target.source.vocab_size=8", "drafter=eagle", f"drafter.head_file={tiny_eagle_head}",
                            "sampling.temperature=1.0", "drafter.num_tokens=3", progress=False)
    proc = grammar_processor({"kind": "regex", "pattern": TINY_REGEX, "backend": backend}, pipe.tokenizer)
    pipe.stack = pipe.stack.with_grammar(proc)
    expected = exact_distribution(pipe, [1, 2, 3], 6)
    counts = sample_counts(pipe, [1, 2, 3], 6, 1500)
    assert all(re.fullmatch(TINY_REGEX, pipe.tokenizer.decode(seq)) for seq in counts)
    assert pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=6, seed=0).stats.drafted > 0
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"{backend}: chi-square p={p_value:.2e}, TV={tv:.3f}"


# --- min_new_tokens and bad_words with a grammar ---------------------------------------------

def test_min_new_tokens_that_no_output_can_meet_is_refused_up_front():
    pipe = tiny_pipeline("sampling.temperature=1.0", "sampling.min_new_tokens=4")
    for backend in BACKENDS:
        proc = grammar_processor({"kind": "regex", "pattern": "(at|ta)[en]?", "backend": backend}, pipe.tokenizer)
        with pytest.raises(ConfigError, match="min_new_tokens=4"):
            proc.bind(pipe.stack.processors)
        longer = grammar_processor({"kind": "regex", "pattern": "(at|ta)[en]{0,3}", "backend": backend},
                                   pipe.tokenizer).bind(pipe.stack.processors)
        pipe.stack = pipe.stack.with_grammar(longer)
        for seed in range(5):
            gen = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=8, seed=seed)
            assert gen.finish_reason == "eos" and len(gen.token_ids) >= 5 and re.fullmatch(TINY_REGEX, gen.text)


def test_bad_words_that_the_grammar_needs_end_with_a_clear_dead_end():
    pipe = tiny_pipeline("sampling.temperature=1.0", "sampling.bad_words=[[3]]")  # 't'
    proc = grammar_processor({"kind": "regex", "pattern": "at"}, pipe.tokenizer)
    with pytest.raises(ConfigError, match="bad_words"):
        proc.bind(pipe.stack.processors)
    maybe = grammar_processor({"kind": "regex", "pattern": "a(t|e)?n"}, pipe.tokenizer).bind(pipe.stack.processors)
    history_t = history(pipe.tokenizer, [1], [4])
    maybe(torch.zeros(1, 16), history_t)
    stuck = grammar_processor({"kind": "regex", "pattern": "a[nt]|e"}, pipe.tokenizer)
    bound = stuck.bind([*pipe.stack.processors, BadWords([[4, 7]], vocab_size=16)])
    with pytest.raises(DeadEndError, match="bad_words forbid every token"):
        bound(torch.zeros(1, 16), history(pipe.tokenizer, [1], [4]))


# --- pydantic models with bounds, datetimes, enums, nested lists and optionals ---------------

@pytest.mark.parametrize("speculative", [True, False])
def test_pydantic_model_outputs_validate_whenever_finished_by_eos(speculative):
    model = order_model(sku_max=6, lines_max=2, note_max=5)
    chars = '{}[]":,-.+ 0123456789abcdefghijklmnopqrstuvwxyzTZ'
    pipe = specgen.pipeline(*TINY, f"target.source.vocab_size={len(chars) + 1}", "drafter=tiny",
                            f"drafter.source.vocab_size={len(chars) + 1}", "sampling.temperature=1.0",
                            "drafter.num_tokens=3", progress=False)
    pipe.tokenizer = char_info(chars)
    finished = 0
    for seed in range(6):
        gen = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=300, seed=seed, schema=model,
                            speculative=speculative)
        if gen.finish_reason == "eos":
            finished += 1
            model.model_validate_json(gen.text)
            jsonschema.validate(json.loads(gen.text), model.model_json_schema())
    assert finished >= 3
    if speculative:
        assert gen.stats.drafted > 0 and str(pipe.guarantee) == "exact"


def test_unknown_meta_schema_uri_is_not_fetched():
    automaton, info = automaton_for({"$schema": "http://json-schema.org/schema", "type": "integer", "maximum": 9},
                                    "llguidance")
    assert accepts(automaton, info, "7") and not accepts(automaton, info, "10")


def test_objects_that_list_properties_get_no_invented_keys():
    listed = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for backend in BACKENDS:
        automaton, info = automaton_for(listed, backend)
        assert accepts(automaton, info, '{"a": 1}') and not accepts(automaton, info, '{"a": 1, "zz": 2}'), backend
    merged = {"allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "integer"}}}],
              "$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
    automaton, info = automaton_for(merged, "llguidance")
    assert accepts(automaton, info, '{"a": 1, "b": 2}')
