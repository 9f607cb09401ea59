"""The one verification entry point (specgen.sampling.verify): which branch a draft takes, and that a
chain's verdict is the same Verdict a tree's is (a chain is a tree with one child per node)."""

from __future__ import annotations

import pytest
import torch

from specgen.sampling import Verdict, chain_parents, verify, verify_chain, verify_tree
from specgen.sampling.verify import verify_greedy

VOCAB = 5


def _rows(seed: int, num: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(num, VOCAB, generator=gen, dtype=torch.float64) * 2, dim=-1)  # [num, VOCAB]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("sampled", [True, False])
def test_a_prefetched_chain_takes_the_chain_fast_path(sampled):
    for seed in range(30):
        target, tokens = _rows(seed, 4), [seed % VOCAB, (seed + 1) % VOCAB, 2]  # target: [4, VOCAB]
        draft = _rows(seed + 100, 3) if sampled else None  # [3, VOCAB]
        fast, reference = _gen(seed), _gen(seed)
        verdict = verify(tokens, None, target, fast, draft_probs=draft)
        assert verdict == verify_chain(target, draft, tokens, reference)
        assert torch.equal(fast.get_state(), reference.get_state())  # the same uniforms consumed
        assert verdict.path == list(range(verdict.num_accepted)) and verdict.tokens == tokens[: verdict.num_accepted]


def test_a_tree_and_a_lazy_chain_take_the_tree_walk():
    tokens, parents = [1, 2, 3, 1], [-1, 0, -1, 2]
    for seed in range(30):
        target, draft = _rows(seed, 5), _rows(seed + 100, 4)  # [5, VOCAB], [4, VOCAB]
        assert verify(tokens, parents, target, _gen(seed), draft_probs=draft) == verify_tree(
            tokens, parents, draft, target, _gen(seed))
        rows = _rows(seed, 4)  # [4, VOCAB] a chain of 3, read lazily: row node + 1
        lazy = verify([1, 2, 3], None, lambda node: rows[node + 1], _gen(seed))
        assert lazy == verify_tree([1, 2, 3], chain_parents(3), None, lambda node: rows[node + 1], _gen(seed))


def test_greedy_is_one_branch_for_chains_and_trees():
    chain = verify([3, 4], None, [3, 4, 5], greedy=True)
    assert chain == Verdict(2, 5, "bonus", (1.0, 1.0)) and chain.emitted == [3, 4, 5]
    assert verify([3, 9], None, [3, 4, 5], greedy=True) == Verdict(1, 4, "resampled", (1.0, 0.0))
    assert verify([3, 9], None, [3, 4, 5], greedy=True) != Verdict(1, 9, "resampled", (1.0, 0.0))  # control
    tree = verify([3, 4, 9], [-1, -1, 1], {-1: 4, 1: 9, 2: 7}.get, greedy=True)
    assert (tree.path, tree.tokens, tree.next_token, tree.kind) == ([1, 2], [4, 9], 7, "bonus")
    assert tree.checked == (0, 1, 2) and tree.accept_probs == (0.0, 1.0, 1.0)
    assert verify_greedy([3, 4], [-1, 0], [3, 4, 5]) == chain
    with pytest.raises(ValueError, match="one more target token"):
        verify([3, 4], None, [3, 4], greedy=True)


def test_emitted_probs_are_the_chains_accept_probs_and_the_trees_path():
    chain = Verdict.chain([1, 2, 3], 1, 4, "resampled", (0.9, 0.2))
    assert chain.emitted_probs == chain.accept_probs == (0.9, 0.2)
    tree = Verdict.tree([2], [5], 6, "resampled", checked=(0, 2, 3), accept_probs=(0.3, 0.8, 0.1))
    assert tree.emitted_probs == (0.8, 0.1)  # the accepted node's, then the last rejected sibling's
    assert Verdict.tree([2], [5], 6, "bonus", checked=(0, 2), accept_probs=(0.3, 0.8)).emitted_probs == (0.8,)
    with pytest.raises(ValueError):
        Verdict(2, 1, "bonus", (1.0,), path=[0])  # a path of one node cannot accept two
