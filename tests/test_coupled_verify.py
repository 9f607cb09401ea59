"""Deterministic drafts are verified by coupling (specgen.sampling.rejection): a seeded request's
tokens are plain decoding's tokens with the same seed, whatever the draft lengths were.

The law itself (accept d with p(d), else the residual) is checked by tests/test_rejection.py and the
enumeration tests; here: the token sequence and the generator's state, with negative controls that
verify the same drafts by the uncoupled rule (one-hot q rows passed explicitly), or draft stochastically.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_pipeline

from specgen.sampling import sample_token, verify_chain
from specgen.sampling.tree import tree_depths, verify_tree

VOCAB, LENGTH = 6, 40


def _rows(seed: int) -> torch.Tensor:
    """[LENGTH + 9, VOCAB] target rows by position (a stand-in for p given the prefix), some sparse."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(LENGTH + 9, VOCAB, generator=gen, dtype=torch.float64) * 2  # [T, V]
    logits[::5, ::2] = float("-inf")  # every fifth position forbids half the tokens
    return torch.softmax(logits, dim=-1)


def _plain(rows: torch.Tensor, seed: int) -> tuple[list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [sample_token(rows[t], gen) for t in range(LENGTH)], gen.get_state()


def _speculative(rows: torch.Tensor, seed: int, plain: list[int], one_hot_rows: bool, draw_ahead: bool):
    """Rounds of random draft lengths 0..8; each draft token is the plain token (so rounds accept) or,
    one time in three, another token. -> (tokens, generator state after LENGTH tokens)."""
    gen, choices = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 7)
    tokens: list[int] = []
    while len(tokens) < LENGTH:
        t = len(tokens)
        gamma = int(torch.randint(0, 9, (), generator=choices))
        draft = [plain[i] if i < LENGTH and int(torch.randint(0, 3, (), generator=choices)) else
                 int(torch.randint(0, VOCAB, (), generator=choices)) for i in range(t, t + gamma)]
        q = None
        if one_hot_rows:  # the same deterministic draft, verified by the uncoupled rule
            q = torch.zeros(gamma, VOCAB, dtype=torch.float64)
            q[range(gamma), draft] = 1.0
        verdict = verify_chain(rows[t: t + gamma + 1], q, draft, gen, draw_ahead=draw_ahead)
        tokens += [*draft[: verdict.num_accepted], verdict.next_token]
    return tokens[:LENGTH], len(tokens) == LENGTH, gen.get_state()


def test_negative_control_the_uncoupled_rule_gives_other_tokens():
    """The same drafts with q passed as explicit one-hot rows go through the acceptance test
    u < p(d): the same law, other tokens; so the equality above is not trivially true."""
    differ = 0
    for seed in range(12):
        rows = _rows(seed)
        plain, _ = _plain(rows, seed)
        tokens, _, _ = _speculative(rows, seed, plain, one_hot_rows=True, draw_ahead=False)
        differ += tokens != plain
    assert differ >= 6, differ


def _tree_rounds(rows: torch.Tensor, seed: int, plain: list[int], prefetched: bool, sampled: bool):
    """Rounds of random trees (up to 7 nodes, depth up to 4), each node's token the plain token at
    its position or, one time in three, another; sampled=True passes each node's q as an explicit
    one-hot row (the rejection rule, a negative control). -> (tokens, ended exactly, generator state)."""
    gen, choices = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 11)
    tokens: list[int] = []
    while len(tokens) < LENGTH:
        t, parents = len(tokens), []
        for i in range(int(torch.randint(0, 8, (), generator=choices))):
            parent = int(torch.randint(-1, i, (), generator=choices)) if i else -1
            if parent >= 0 and tree_depths(parents)[parent] >= 4:
                parent = -1
            parents.append(parent)
        depths = tree_depths(parents)
        nodes = [plain[t + d - 1] if t + d - 1 < LENGTH and int(torch.randint(0, 3, (), generator=choices))
                 else int(torch.randint(0, VOCAB, (), generator=choices)) for d in depths]
        q = None
        if sampled:
            q = torch.zeros(len(nodes), VOCAB, dtype=torch.float64)
            q[range(len(nodes)), nodes] = 1.0
        if prefetched:
            target = torch.stack([rows[t], *(rows[t + d] for d in depths)])  # [N + 1, V]
        else:
            target = lambda node: rows[t if node < 0 else t + depths[node]]  # noqa: E731
        verdict = verify_tree(nodes, parents, q, target, gen)
        tokens += [*verdict.tokens, verdict.next_token]
    return tokens[:LENGTH], len(tokens) == LENGTH, gen.get_state()


def test_negative_control_trees_verified_by_rejection_give_other_tokens():
    differ = 0
    for seed in range(12):
        rows = _rows(seed)
        plain, _ = _plain(rows, seed)
        differ += _tree_rounds(rows, seed, plain, prefetched=True, sampled=True)[0] != plain
    assert differ >= 6, differ


def _chain_rounds(rows, seed, plain, read_once: bool):
    return _speculative(rows, seed, plain, one_hot_rows=False, draw_ahead=read_once)


def _coupled_tree_rounds(rows, seed, plain, read_once: bool):
    return _tree_rounds(rows, seed, plain, prefetched=read_once, sampled=False)


@pytest.mark.parametrize("rounds", [_chain_rounds, _coupled_tree_rounds], ids=["chains", "trees"])
@pytest.mark.parametrize("read_once", [False, True], ids=["lazy", "read_once"])
def test_coupled_rounds_give_plain_decodings_tokens_and_generator_state(rounds, read_once):
    """Chains (draws made ahead or not) and trees (prefetched rows or lazy) of deterministic drafts."""
    for seed in range(12):
        rows = _rows(seed)
        plain, plain_state = _plain(rows, seed)
        tokens, exact_length, state = rounds(rows, seed, plain, read_once)
        assert tokens == plain, seed
        if exact_length:  # the generator is where LENGTH plain draws leave it
            assert torch.equal(state, plain_state), seed


REPEATS = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]  # a prompt that prompt lookup drafts from


def _tokens(pipe, seed: int) -> list[int]:
    return pipe.generate(prompt_ids=REPEATS, seed=seed, max_new_tokens=24).token_ids


def test_seeded_runs_with_prompt_lookup_equal_plain_decoding_at_any_draft_length():
    plain = tiny_pipeline("sampling.temperature=0.9", "speculative=false", drafter="ngram")
    arms = {gamma: tiny_pipeline("sampling.temperature=0.9", f"drafter.num_tokens={gamma}", drafter="ngram")
            for gamma in ("auto", 1, 4)}
    for seed in (1, 5, 9):
        reference = _tokens(plain, seed)
        for gamma, pipe in arms.items():
            generation = pipe.generate(prompt_ids=REPEATS, seed=seed, max_new_tokens=24)
            assert generation.token_ids == reference, (seed, gamma)
    drafted = {gamma: pipe.generate(prompt_ids=REPEATS, seed=1, max_new_tokens=24).stats for gamma, pipe in arms.items()}
    assert drafted[4].drafted > 0 and drafted[1].drafted > 0, "the fixed arms must speculate"
    assert sum(_tokens(plain, s) != _tokens(plain, 1) for s in (2, 3, 4)) > 0, "seeds must matter"


def test_batched_rows_with_prompt_lookup_equal_their_plain_runs():
    """num_tokens=auto in a batch: each row's draft lengths depend on the batch, its tokens do not."""
    plain = tiny_pipeline("sampling.temperature=0.9", "speculative=false", drafter="ngram")
    pipe = tiny_pipeline("sampling.temperature=0.9", drafter="ngram")
    requests = [dict(prompt_ids=REPEATS[s % 4:], seed=s, max_new_tokens=16) for s in range(6)]
    alone = [plain.generate(**r).token_ids for r in requests]
    batched = pipe.generate_batch(requests, batch_size=4)
    assert [g.token_ids for g in batched] == alone
    assert sum(g.stats.drafted for g in batched) > 0, "the rows must speculate"


def test_negative_control_a_sampled_draft_changes_the_seeded_tokens():
    """A model drafter at temperature > 0 draws its tokens (q not one-hot): verified by the
    rejection rule, its seeded tokens follow p's law but are not plain decoding's tokens."""
    plain = tiny_pipeline("sampling.temperature=0.9", "speculative=false")
    drafted = tiny_pipeline("sampling.temperature=0.9", "drafter.num_tokens=3")
    assert any(_tokens(plain, seed) != _tokens(drafted, seed) for seed in (1, 5, 9))
