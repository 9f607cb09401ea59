"""Dead ends behind draft tokens: the verdict, the grammar rows, and exactness end to end.

A target row with nothing allowed at a draft-dependent position ``i >= 1`` means
"the prefix through draft token ``i - 1`` is a dead end". Only when verification
accepts that prefix does the request end (``finish_reason="dead_end"``, after
committing it), as plain decoding would; a rejected draft token never ends it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, tiny_pipeline
from exact import exact_outcomes, goodness_of_fit, sample_outcomes
from grammar_helpers import allowed_rows, history

import specgen
from specgen.errors import ConfigError, DeadEndError, NumericalError
from specgen.events import FinishEvent
from specgen.grammar import grammar_processor
from specgen.sampling import (
    NoAllowedToken,
    argmax_or_none,
    argmax_tokens,
    verify_chain,
    verify_chain_greedy,
    verify_tree,
    verify_tree_greedy,
)

#: Over the tiny alphabet (a=4, t=3, e=2, n=7, EOS=0): "at" is complete after 2 tokens, so with
#: min_new_tokens=3 it is a dead end (EOS banned, nothing else allowed); "ta[en]{1,3}" can finish.
DEAD_END_REGEX = "at|ta[en]{0,3}"
A, T = 4, 3
NUM_SAMPLES = 1000
MIN_P_VALUE = 1e-3


def probs(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- verdicts (hand-built rows) ---------------------------------------------------------------

def test_chain_reaching_an_empty_row_is_a_dead_end_after_the_accepted_prefix():
    target = probs([0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0])  # [3, 3]: row 2 allows nothing
    verdict = verify_chain(target, None, [1, 2], _generator())
    assert (verdict.num_accepted, verdict.next_token, verdict.kind) == (2, None, "dead_end")
    assert verdict.accept_probs == (1.0, 1.0)
    middle = probs([0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.3, 0.3, 0.4])  # the empty row is row 1
    draft = probs([0.0, 1.0, 0.0], [0.5, 0.5, 0.0])  # [2, 3]
    verdict = verify_chain(middle, draft, [1, 0], _generator())
    assert (verdict.num_accepted, verdict.next_token, verdict.kind) == (1, None, "dead_end")


def test_chain_rejecting_before_the_empty_row_never_sees_it():
    target = probs([1.0, 0.0, 0.0], [0.0, 0.0, 0.0])  # draft token 1 has p = 0: rejected at position 0
    verdict = verify_chain(target, None, [1], _generator())
    assert (verdict.num_accepted, verdict.next_token, verdict.kind) == (0, 0, "resampled")


def test_chain_empty_first_row_still_raises():
    with pytest.raises(NoAllowedToken, match="first position"):
        verify_chain(probs([0.0, 0.0], [0.5, 0.5]), None, [1], _generator())
    with pytest.raises(NoAllowedToken, match="first position"):
        verify_chain_greedy([None, 1], [1])
    draft = probs([0.0, 0.0])  # an empty draft row is still an error
    with pytest.raises(NoAllowedToken):
        verify_chain(probs([0.5, 0.5], [0.5, 0.5]), draft, [1], _generator())


def test_chain_greedy_dead_end():
    verdict = verify_chain_greedy([1, 2, None], [1, 2])
    assert (verdict.num_accepted, verdict.next_token, verdict.kind) == (2, None, "dead_end")
    verdict = verify_chain_greedy([1, None, 3], [1, 2])
    assert (verdict.num_accepted, verdict.next_token, verdict.kind) == (1, None, "dead_end")
    verdict = verify_chain_greedy([0, None, 3], [1, 2])  # mismatch first: the empty row is never reached
    assert (verdict.num_accepted, verdict.next_token, verdict.kind) == (0, 0, "resampled")


def test_argmax_or_none_reports_empty_rows_in_one_read():
    logits = torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]])  # [2, 2]
    assert argmax_or_none(logits) == [1, None]
    with pytest.raises(NoAllowedToken):
        argmax_tokens(logits)


def test_argmax_codes_agree_on_every_path_with_ties_nans_and_infinities():
    """The host path (numpy's argmax of float rows) answers what torch's indexed max (the path of
    other dtypes and devices) does:
    ties to the lowest id, NaN anywhere, +inf a token, an all -inf row empty; any shape."""
    from specgen.sampling.probs import argmax_codes

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 50, generator=g)  # [12, 50]
    rows[1, 5] = rows[1, 7] = 40.0
    rows[2, 30], rows[2, 3] = float("nan"), 99.0
    rows[3] = float("-inf")
    rows[4, 10] = rows[4, 20] = float("inf")
    rows[5, 0] = rows[5, 49] = float("nan")
    rows[6, :] = 1.0
    for logits in (rows, rows.double(), rows[:, :31], rows.reshape(3, 4, 50), rows[2]):
        values, indices = logits.max(dim=-1)
        expected = torch.where(torch.isnan(values), -1, torch.where(values == float("-inf"), -2, indices))
        assert torch.equal(argmax_codes(logits), expected)
    assert argmax_codes(rows)[[1, 2, 3, 4, 5, 6]].tolist() == [5, -1, -2, 10, -1, 0]


def test_one_nan_anywhere_in_a_row_is_caught_and_infinities_are_not_nan():
    """The NaN check reads each row's max (max propagates NaN): a single NaN, before or after
    the row's largest value, is caught; +inf is a token, an all -inf row is empty."""
    for where in (0, 3, 7):
        logits = torch.zeros(3, 8)
        logits[1, 5] = 4.0
        logits[1, where] = float("nan")
        with pytest.raises(NumericalError):
            argmax_or_none(logits)
    logits = torch.full((2, 8), float("-inf"))
    logits[0, 6] = float("inf")
    assert argmax_or_none(logits) == [6, None]
    pipe = tiny_pipeline()
    raw = torch.zeros(4, 16)
    raw[2, 9] = float("nan")
    with pytest.raises(NumericalError, match="NaN logits at position 7"):
        pipe.target._checked(raw, 7)
    assert pipe.target._checked(torch.zeros(0, 16), 7).shape == (0, 16)


def _tree_rows(rows: dict[int, list[float]]):
    return lambda node: torch.tensor(rows[node], dtype=torch.float64)


def test_tree_dead_node_on_the_accepted_path_ends_with_its_path():
    # root -> node 0 (token 1) -> node 1 (token 2); node 2 (token 0) is a root sibling.
    tokens, parents = [1, 2, 0], [-1, 0, -1]
    rows = {-1: [0.0, 1.0, 0.0], 0: [0.0, 0.0, 1.0], 1: [0.0, 0.0, 0.0]}
    tree = verify_tree(tokens, parents, None, _tree_rows(rows), _generator())
    assert (tree.path, tree.next_token, tree.kind, tree.emitted) == ([0, 1], None, "dead_end", [1, 2])
    rows[0] = [0.0, 0.0, 0.0]  # node 0 dead: its child is never looked at
    tree = verify_tree(tokens, parents, None, _tree_rows(rows), _generator())
    assert (tree.path, tree.kind, tree.emitted) == ([0], "dead_end", [1])


def test_tree_dead_node_off_the_accepted_path_is_ignored():
    tokens, parents = [1, 0], [-1, -1]
    rows = {-1: [1.0, 0.0, 0.0], 0: [0.0, 0.0, 0.0], 1: [0.0, 0.0, 1.0]}  # node 0 (dead) is rejected
    tree = verify_tree(tokens, parents, None, _tree_rows(rows), _generator())
    assert (tree.path, tree.next_token, tree.kind) == ([1], 2, "bonus")
    argmax = {-1: 0, 0: None, 1: 2}
    tree = verify_tree_greedy(tokens, parents, argmax.get)
    assert (tree.path, tree.next_token, tree.kind) == ([1], 2, "bonus")


def test_tree_greedy_dead_end_and_empty_root():
    tokens, parents = [1, 2], [-1, 0]
    tree = verify_tree_greedy(tokens, parents, {-1: 1, 0: 2, 1: None}.get)
    assert (tree.path, tree.next_token, tree.kind, tree.emitted) == ([0, 1], None, "dead_end", [1, 2])
    tree = verify_tree_greedy(tokens, parents, {-1: 1, 0: None}.get)
    assert (tree.path, tree.kind, tree.emitted) == ([0], "dead_end", [1])
    with pytest.raises(NoAllowedToken, match="first position"):
        verify_tree_greedy(tokens, parents, {-1: None}.get)
    with pytest.raises(NoAllowedToken):
        verify_tree(tokens, parents, None, _tree_rows({-1: [0.0, 0.0, 0.0]}), _generator())


# --- the grammar processor's rows ---------------------------------------------------------------


def _bound_stack(*overrides: str, drafter: str = "tiny", head: str | None = None):
    if head is None:
        pipe = tiny_pipeline("sampling.min_new_tokens=3", *overrides, drafter=drafter)
    else:
        pipe = specgen.pipeline(*TINY, "target.source.vocab_size=8", "drafter=eagle", f"drafter.head_file={head}",
                                "sampling.min_new_tokens=3", *overrides, progress=False)
    pipe.stack = pipe.stack.with_grammar(grammar_processor({"kind": "regex", "pattern": DEAD_END_REGEX},
                                                           pipe.tokenizer))
    return pipe


def test_grammar_empties_draft_rows_and_raises_at_the_committed_position():
    pipe = _bound_stack("sampling.temperature=1.0")
    grammar = pipe.stack.processors[0]
    assert grammar.min_new_tokens == 3, "with_grammar binds the grammar to the stack's min_new_tokens"
    rows = grammar(torch.zeros(3, 16), history(pipe.tokenizer, [1], [], [A, T]))  # [3, vocab]
    assert allowed_rows(rows) == [sorted([A, T]), [T], []]
    with pytest.raises(DeadEndError, match="min_new_tokens=3 forbids EOS"):
        grammar(torch.zeros(1, 16), history(pipe.tokenizer, [1], [A, T]))
    with pytest.raises(ConfigError, match="min_new_tokens=3"):  # "at" alone can never reach 3 tokens
        pipe.stack.with_grammar(grammar_processor({"kind": "regex", "pattern": "at"}, pipe.tokenizer))


# --- end to end: (tokens, finish_reason) of speculative == plain ----------------------------------

def _ended_by_verdict(pipe, prompt, num) -> int:
    """Runs (seeds 0..num-1) that ended with a dead end found behind accepted draft tokens."""
    count = 0
    for seed in range(num):
        events = list(pipe.stream(prompt_ids=prompt, max_new_tokens=6, seed=seed))
        finish = events[-1]
        assert isinstance(finish, FinishEvent)
        count += finish.finish_reason == "dead_end" and len(events) > 1 and events[-2].kind == "accepted"
    return count


@pytest.mark.parametrize("drafter,prompt", [("tiny", [1, 2, 3]), ("ngram", [4, 3, 8, 3, 4, 2, 8, 4]),
                                            ("eagle", [1, 2, 3])])
def test_speculation_meets_dead_ends_like_plain_decoding(drafter, prompt, request):
    """Sampled chain (small model), deterministic chain (ngram + grammar lookahead) and tree (EAGLE)."""
    head = request.getfixturevalue("tiny_eagle_head") if drafter == "eagle" else None
    pipe = _bound_stack("sampling.temperature=1.0", "drafter.num_tokens=3", drafter=drafter, head=head)
    assert str(pipe.guarantee) == "exact"
    expected = exact_outcomes(pipe, prompt, 6)
    assert sum(expected.values()) == pytest.approx(1.0, abs=1e-6)
    # non-vacuous: plain decoding dead-ends after generated tokens with positive probability, and
    # never with fewer than 2 (where ending at the committed position used to put a speculative run)
    assert expected[((A, T), "dead_end")] > 0.05
    assert all(len(seq) == 2 for seq, reason in expected if reason == "dead_end")
    assert _ended_by_verdict(pipe, prompt, 40) > 0, "the dead end must be met behind draft tokens"
    counts = sample_outcomes(pipe, prompt, 6, NUM_SAMPLES)
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > MIN_P_VALUE, f"chi-square p={p_value:.2e}, TV={tv:.3f}, observed {counts.most_common(6)}"


@pytest.mark.parametrize("drafter", ["tiny", "ngram", "eagle"])
def test_greedy_speculation_meets_dead_ends_token_for_token(drafter, request):
    head = request.getfixturevalue("tiny_eagle_head") if drafter == "eagle" else None
    pipe = _bound_stack("sampling.temperature=0", "drafter.num_tokens=3", drafter=drafter, head=head)
    assert str(pipe.guarantee) == "greedy"
    reasons = []
    for prompt in ([1, 2, 3], [5], [4, 3, 1, 4], [1, 1, 1], [6, 2], [2]):  # ids < 8: the EAGLE target's vocab
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=6, speculative=False)
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=6)
        assert (spec.token_ids, spec.finish_reason) == (plain.token_ids, plain.finish_reason), prompt
        reasons.append(plain.finish_reason)
    assert "dead_end" in reasons
