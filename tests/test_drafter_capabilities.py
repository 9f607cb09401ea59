"""What drafters declare on their classes, and the one batchability rule that reads it."""

from __future__ import annotations

import pytest

from specgen.checks import check_batch_size
from specgen.drafters import HFAssistant, NgramDrafter, batch_refusal, drafter_class
from specgen.errors import ConfigError
from specgen.processors import ProcessorStack, Temperature


@pytest.mark.parametrize("kind, shape, features, batchable", [
    ("ngram", "chain", False, True),
    ("small_model", "chain", False, True),
    ("mtp", "chain", True, False),  # a chain drafter that reads target features
    ("dspark", "chain", True, False),
    ("eagle", "tree", True, False),
    ("medusa", "tree", True, False),
])
def test_builtin_drafters_declare_shape_features_and_batchability(kind, shape, features, batchable):
    cls = drafter_class(kind)
    assert cls is not None and cls.name == kind
    assert (cls.shape, cls.needs_features, cls.batchable) == (shape, features, batchable)
    assert (batch_refusal(cls) is None) == batchable


def test_unknown_kinds_have_no_class():
    assert drafter_class("none") is None and drafter_class(None) is None


def test_batch_refusal_names_the_reason():
    assert batch_refusal(None) is None
    assert batch_refusal(drafter_class("mtp")) == "drafters that read target features (mtp) are not batched yet"
    assert batch_refusal(drafter_class("eagle")) == "tree drafters (eagle) are not batched yet"
    assert batch_refusal(NgramDrafter(), compiled=True) == "compiled targets are not batched yet"
    assert batch_refusal(None, backend="llama_cpp") == "the llama_cpp backend is not batched yet"


def test_config_check_uses_the_same_rule():
    with pytest.raises(ConfigError, match=r"batch_size=2: drafters that read target features \(mtp\)"):
        check_batch_size({"batch_size": 2, "drafter": {"kind": "mtp"}})
    assert check_batch_size({"batch_size": 2, "drafter": {"kind": "mtp"}, "speculative": False}) == 2
    assert check_batch_size({"batch_size": 4, "drafter": {"kind": "ngram"}}) == 4


def test_ngram_names_its_hf_counterpart():
    drafter = NgramDrafter(max_ngram=5)
    assert drafter.hf_assistant == HFAssistant("hf_prompt_lookup", max_ngram=5)
    assert drafter.draft_model is None


def test_stack_without_grammar_has_an_empty_slot():
    stack = ProcessorStack([Temperature(0.5)], greedy=False)
    assert stack.grammar is None and stack.with_timer(object()) is stack
    assert [p.name for p in stack.processors] == [p.name for p in stack.others]
