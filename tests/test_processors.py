"""Processors: agreement with HF's implementations, batching, history, config."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specgen.errors import ConfigError
from specgen.processors import (
    BadWords,
    CommittedCounts,
    FrequencyPresencePenalty,
    History,
    MinNewTokens,
    MinP,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
    build_stack,
)

VOCAB = 12


def _history(prompt, generated=(), candidates=(), positions=1, start=0):
    counts = CommittedCounts.start(list(prompt), VOCAB, torch.device("cpu"))
    counts.commit(list(generated))
    return History(counts, list(candidates), positions, start=start)


def _logits(rows=1, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (Temperature(0.7), TemperatureLogitsWarper(0.7)),
        (TopK(4), TopKLogitsWarper(4)),
        (TopP(0.8), TopPLogitsWarper(0.8)),
        (MinP(0.1), MinPLogitsWarper(0.1)),
        (RepetitionPenalty(1.3), RepetitionPenaltyLogitsProcessor(1.3)),
    ],
)
def test_matches_hf(ours, theirs):
    history = _history([1, 2, 3], [5, 5])
    ids = torch.tensor([history.full(0)])
    for seed in range(5):
        logits = _logits(seed=seed)
        expected = theirs(ids, logits.clone())
        got = ours(logits.clone(), history)
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        finite = torch.isfinite(expected)
        assert torch.allclose(got[finite], expected[finite], atol=1e-5)


def test_frequency_presence_counts_generated_only():
    history = _history(prompt=[1, 1], generated=[2, 2, 3])
    out = FrequencyPresencePenalty(0.5, 1.0)(torch.zeros(1, VOCAB), history)
    assert out[0, 1] == 0.0  # prompt tokens are not penalised
    assert out[0, 2] == pytest.approx(-2.0)  # 0.5 * 2 + 1
    assert out[0, 3] == pytest.approx(-1.5)


def test_candidate_prefix_is_part_of_history():
    # Row j sees candidates[:j]: penalty for token 4 appears only after it was drafted.
    history = _history([1], [], candidates=[4, 4, 7], positions=4)
    out = FrequencyPresencePenalty(1.0, 0.0)(torch.zeros(4, VOCAB), history)
    assert out[:, 4].tolist() == [0.0, -1.0, -2.0, -2.0]
    assert out[:, 7].tolist() == [0.0, 0.0, 0.0, -1.0]


def test_batched_rows_equal_single_rows():
    """Evaluating N positions at once equals N one-position evaluations (start offset)."""
    stack = build_stack(
        [{"name": "repetition_penalty", "penalty": 1.4},
         {"name": "frequency_presence_penalty", "frequency_penalty": 0.3, "presence_penalty": 0.2},
         {"name": "min_new_tokens", "min_new_tokens": 3},
         {"name": "bad_words", "bad_words": [[5, 6]]},
         {"name": "temperature", "temperature": 0.9},
         {"name": "top_k", "top_k": 6},
         {"name": "top_p", "top_p": 0.9}],
        greedy=False, eos_ids=[0], vocab_size=VOCAB,
    )
    candidates = [5, 6, 5, 2]
    raw = _logits(rows=5, seed=3)
    batched = stack.probs(raw, _history([1, 5], [2], candidates, positions=5))
    for j in range(5):
        single = stack.probs(raw[j : j + 1], _history([1, 5], [2], candidates, positions=1, start=j))
        assert torch.allclose(batched[j], single[0])


def test_min_new_tokens_blocks_eos_until_reached():
    history = _history([1], generated=[2], candidates=[3, 4], positions=3)
    out = MinNewTokens(3, eos_ids=[0])(torch.zeros(3, VOCAB), history)
    assert torch.isinf(out[:, 0]).tolist() == [True, True, False]


def test_bad_words_single_and_sequence():
    history = _history([1], [5], candidates=[6, 5], positions=3)
    out = BadWords([[9], [5, 6]], VOCAB)(torch.zeros(3, VOCAB), history)
    assert torch.isinf(out[:, 9]).all()
    assert torch.isinf(out[:, 6]).tolist() == [True, False, True]


def test_noop_entries_are_dropped_and_greedy_skips_warpers():
    entries = [{"name": "temperature", "temperature": 1.0}, {"name": "top_k", "top_k": 0},
               {"name": "top_p", "top_p": 1.0}, {"name": "repetition_penalty", "penalty": 1.0}]
    assert build_stack(entries, greedy=False, eos_ids=[0], vocab_size=VOCAB).processors == []
    greedy = build_stack([{"name": "top_k", "top_k": 3}, {"name": "repetition_penalty", "penalty": 2.0}],
                         greedy=True, eos_ids=[0], vocab_size=VOCAB)
    assert [p.name for p in greedy._active] == ["repetition_penalty"]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"name": "top_p", "top_p": 1.5}, "top_p"),
        ({"name": "top_k", "top_k": -2}, "top_k"),
        ({"name": "min_p", "min_p": 2}, "min_p"),
        ({"name": "temperature", "temperature": -1}, "temperature"),
        ({"name": "repetition_penalty", "penalty": -1}, "repetition_penalty"),
        ({"name": "bad_words", "bad_words": [[99]]}, "outside the vocabulary"),
        ({"name": "warp_drive"}, "unknown processor"),
        ({"top_p": 0.5}, "needs a 'name'"),
    ],
)
def test_invalid_arguments_are_clear(entry, message):
    with pytest.raises(ConfigError, match=message):
        build_stack([entry], greedy=False, eos_ids=[0], vocab_size=VOCAB)


def test_hf_processor_is_impure_unless_declared():
    entry = {"_target_": "transformers.TopKLogitsWarper", "top_k": 3}
    stack = build_stack([entry], greedy=False, eos_ids=[0], vocab_size=VOCAB)
    assert [p.name for p in stack.impure] == ["hf:TopKLogitsWarper"]
    declared = build_stack([{**entry, "pure": True}], greedy=False, eos_ids=[0], vocab_size=VOCAB)
    assert declared.impure == []
    out = declared.logits(_logits(), _history([1]))
    assert int(torch.isfinite(out).sum()) == 3


def test_committed_counts_follow_commits_and_rollbacks_whenever_they_are_read():
    """The count vectors are brought up to date on read; any interleaving of commits, rollbacks
    (also past the last read) and reads gives the counts of the tokens held."""
    rng = __import__("random").Random(0)
    prompt = [1, 2, 2, 5]
    counts = CommittedCounts.start(prompt, VOCAB, torch.device("cpu"))
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            counts.commit([rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))])
        elif op < 0.75:
            counts.truncate(rng.randint(len(prompt), len(counts.tokens)))
        else:
            seen = torch.bincount(torch.tensor(counts.tokens), minlength=VOCAB).float()
            generated = torch.bincount(torch.tensor(counts.tokens[len(prompt):], dtype=torch.long),
                                       minlength=VOCAB).float()
            assert torch.equal(counts.seen, seen) and torch.equal(counts.generated, generated)
    with pytest.raises(ValueError, match="prompt"):
        counts.truncate(len(prompt) - 1)


def test_a_target_that_builds_no_processor_names_the_entry_and_what_it_returned():
    """A `_target_` whose result is neither a Processor nor callable: the message names the entry
    (its index and target) and shows the value it returned, not just "not callable"."""
    entries = [{"name": "top_k", "top_k": 3}, {"_target_": "builtins.dict", "a": 1}]
    with pytest.raises(ConfigError) as caught:
        build_stack(entries, greedy=False, eos_ids=[0], vocab_size=VOCAB)
    message = str(caught.value)
    assert "processors[1] (_target_: builtins.dict)" in message
    assert "returned dict {'a': 1}" in message and "not callable" not in message
