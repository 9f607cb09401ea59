"""What drafters declare on their classes, and the one batchability rule that reads it."""

from __future__ import annotations

import pytest

from specgen.config.checks import check_batch_size
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
        check_batch_size({"batch_size": 2, "drafter": {"kind": "mtp"}, "speculative": True, "compile": False})
    assert check_batch_size({"batch_size": 2, "drafter": {"kind": "mtp"}, "speculative": False, "compile": False}) == 2
    assert check_batch_size({"batch_size": 4, "drafter": {"kind": "ngram"}, "speculative": True, "compile": False}) == 4
    with pytest.raises(ConfigError, match="speculative is missing from the config"):
        check_batch_size({"batch_size": 2, "drafter": {"kind": "mtp"}})


def test_ngram_names_its_hf_counterpart():
    drafter = NgramDrafter(max_ngram=5)
    assert drafter.hf_assistant == HFAssistant("hf_prompt_lookup", max_ngram=5)
    assert drafter.draft_model is None


def test_stack_without_grammar_has_an_empty_slot():
    stack = ProcessorStack([Temperature(0.5)], greedy=False)
    assert stack.grammar is None and stack.with_timer(object()) is stack
    assert [p.name for p in stack.processors] == [p.name for p in stack.others]


def test_the_ngram_index_answers_what_the_scan_does_as_the_list_grows_and_is_cut():
    import random

    from specgen.drafters.ngram import NgramIndex, lookup

    rng = random.Random(0)
    for max_ngram, min_ngram in ((3, 1), (4, 2), (1, 1)):
        index, tokens = NgramIndex(max_ngram, min_ngram), []
        for step in range(600):
            move = rng.random()
            if move < 0.6:
                tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]  # commits
            elif move < 0.8:
                tokens = tokens[: max(0, len(tokens) - rng.randrange(1, 5))]  # a rollback
            else:
                cut = rng.randrange(len(tokens) + 1)  # rolled back and grown otherwise in one update
                tokens = tokens[:cut] + [rng.randrange(9) for _ in range(rng.randrange(1, 4))]
            index.update(tokens)
            budget = rng.randrange(0, 6)
            assert index.lookup(budget) == lookup(tokens, budget, max_ngram, min_ngram), (step, tokens)
        fresh = NgramIndex(max_ngram, min_ngram)
        fresh.update(tokens)
        assert index.ends == fresh.ends, "cutting leaves exactly the index of the list as it is"


def test_the_ngram_index_skips_comparing_a_list_that_only_grew():
    """Fed the committed list's truncation count, the index compares the list again only after a
    rollback, and still answers what the scan does. Control: a count that misses a rollback followed
    by other tokens of the same length leaves the index stale, so the count is what keeps it right."""
    import random

    import torch

    from specgen.drafters.ngram import NgramIndex, lookup
    from specgen.processors import CommittedCounts

    rng = random.Random(1)
    committed = CommittedCounts.start([1, 2, 3], 9, torch.device("cpu"))
    index = NgramIndex(3, 1)
    for step in range(600):
        if rng.random() < 0.75 or committed.num_generated < 4:
            committed.commit([rng.randrange(6) for _ in range(rng.randrange(1, 4))])
        else:
            committed.truncate(len(committed.tokens) - rng.randrange(1, 4))
            committed.commit([rng.randrange(9) for _ in range(rng.randrange(0, 4))])
        index.update(committed.tokens, committed.truncations)
        budget = rng.randrange(1, 6)
        assert index.lookup(budget) == lookup(committed.tokens, budget, 3, 1), step
    fresh = NgramIndex(3, 1)
    fresh.update(committed.tokens)
    assert index.ends == fresh.ends
    stale = NgramIndex(3, 1)
    stale.update([1, 2, 3, 4, 5, 1, 2], 0)
    stale.update([1, 2, 3, 4, 9, 1, 2], 0)  # cut by three and regrown, but the count claims it only grew
    fresh = NgramIndex(3, 1)
    fresh.update([1, 2, 3, 4, 9, 1, 2])
    assert stale.ends != fresh.ends
