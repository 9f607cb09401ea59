"""Exactness of tree verification (recursive rejection sampling) on synthetic targets.

The target is a deterministic function prefix -> distribution over a tiny vocabulary
(seeded Dirichlet rows with some zeros). Each round drafts a fresh random tree from
the current prefix with its own generator and verifies it; rounds continue from the
extended prefix until ``LENGTH`` tokens are emitted. The distribution of those
``LENGTH`` tokens must match the target's exactly enumerated one; a verifier that
skips the residual must fail the same test.

NUM_SAMPLES = 3000 (was 5000): the negative controls still give p = 5e-48 (wrong
sibling law) and p = 0 (no residual), far below their 1e-6; the exact cases' TV at
3000 is 0.039-0.054 against the 0.08 bound (0.028-0.036 at 5000).
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter

import pytest
import torch
from exact import goodness_of_fit

from specgen.errors import NumericalError
from specgen.sampling import (
    TreeVerdict,
    ancestor_matrix,
    ancestors,
    tree_children,
    tree_depths,
    tree_paths,
    verify_tree,
    verify_tree_greedy,
)
from specgen.sampling import tree as tree_module

VOCAB = 4
LENGTH = 4  # emitted tokens compared against the target (max tree depth 3 + bonus)
MAX_DEPTH = 3
NUM_SAMPLES = 3000


def probs(*values):
    return torch.tensor(values, dtype=torch.float64)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- synthetic models


def _dirichlet_row(salt: int, prefix: tuple[int, ...], zero_prob: float) -> torch.Tensor:
    """Seeded Dirichlet(1) row over VOCAB with each token zeroed w.p. zero_prob (>= 1 kept)."""
    gen = _generator(hash((salt, *prefix)) & 0x7FFFFFFF)
    weights = -torch.log1p(-torch.rand(VOCAB, generator=gen, dtype=torch.float64))  # Exp(1), [VOCAB]
    keep = torch.rand(VOCAB, generator=gen, dtype=torch.float64) >= zero_prob  # [VOCAB]
    keep[int(torch.randint(VOCAB, (), generator=gen))] = True
    weights = weights * keep
    return weights / weights.sum()


@functools.cache
def target_row(prefix: tuple[int, ...]) -> torch.Tensor:
    return _dirichlet_row(1, prefix, zero_prob=0.25)


@functools.cache
def draft_row(prefix: tuple[int, ...]) -> torch.Tensor:
    """A drafter's q: close-ish to p but with its own zeros."""
    mixed = 0.5 * target_row(prefix) + 0.5 * _dirichlet_row(2, prefix, zero_prob=0.0)
    mixed = mixed * (_dirichlet_row(3, prefix, zero_prob=0.3) > 0)
    return mixed / mixed.sum()


@functools.cache
def mismatched_row(prefix: tuple[int, ...]) -> torch.Tensor:
    """q with zeros where p > 0 (p's argmax is banned) and mass where p == 0."""
    p = target_row(prefix)
    q = _dirichlet_row(4, prefix, zero_prob=0.0) * (p == 0).to(torch.float64) * 3.0 + p
    q[int(torch.argmax(p))] = 0.0
    return q / q.sum()


def exact_sequences(length: int) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        mass = 1.0
        for i, token in enumerate(seq):
            mass *= float(target_row(seq[:i])[token])
            if mass == 0.0:
                break
        if mass > 0.0:
            out[seq] = mass
    return out


# --------------------------------------------------------------------------- draft trees


BRANCHING = (0.2, 0.35, 0.3, 0.15)  # P(number of children = 0, 1, 2, 3)


@functools.cache
def _weights(q_fn, prefix: tuple[int, ...]) -> list[float]:
    return q_fn(prefix).tolist()


def draft_tree(prefix, mode: str, q_fn, rng: random.Random, bfs: bool):
    """A random tree below ``prefix``: (tokens, parents, draft_probs or None).

    mode: "onehot" (distinct sibling tokens), "onehot_dup" (i.i.d. uniform tokens,
    duplicates allowed), "iid" (siblings i.i.d. from q), "wor" (siblings from q
    without replacement; the row stored is q renormalised without earlier siblings),
    "wor_claim_q" (drawn without replacement but q stored: a contract violation).
    Nodes are numbered breadth-first (bfs) or depth-first; the drafting RNG is
    Python's, independent of the verifier's torch generator.
    """
    tokens: list[int] = []
    parents: list[int] = []
    rows: list[list[float]] = []
    frontier = [(-1, tuple(prefix), 0)]
    while frontier:
        parent, path, depth = frontier.pop(0) if bfs else frontier.pop()
        if depth == MAX_DEPTH:
            continue
        num_children = rng.choices(range(len(BRANCHING)), weights=BRANCHING)[0]
        if mode == "onehot":
            chosen = rng.sample(range(VOCAB), num_children)
            chosen_rows = [None] * num_children
        elif mode == "onehot_dup":
            chosen = [rng.randrange(VOCAB) for _ in range(num_children)]
            chosen_rows = [None] * num_children
        elif mode == "iid":
            q = _weights(q_fn, path)
            chosen = rng.choices(range(VOCAB), weights=q, k=num_children)
            chosen_rows = [q] * num_children
        else:
            q = _weights(q_fn, path)
            chosen, chosen_rows = [], []
            remaining = list(q)
            for _ in range(min(num_children, sum(w > 0 for w in q))):
                total = sum(remaining)
                row = [w / total for w in remaining]
                token = rng.choices(range(VOCAB), weights=row)[0]
                chosen.append(token)
                chosen_rows.append(row if mode == "wor" else q)
                remaining[token] = 0.0
        new_nodes = []
        for token, row in zip(chosen, chosen_rows):
            new_nodes.append((len(tokens), (*path, token), depth + 1))
            tokens.append(token)
            parents.append(parent)
            rows.append(row)
        frontier.extend(new_nodes if bfs else reversed(new_nodes))
    if mode in ("onehot", "onehot_dup"):
        return tokens, parents, None
    draft = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), VOCAB)  # [N, VOCAB]
    return tokens, parents, draft


def target_fn(prefix, tokens, parents):
    paths = tree_paths(parents)

    def target_probs(node: int) -> torch.Tensor:
        if node == -1:
            return target_row(tuple(prefix))
        return target_row((*prefix, *(tokens[i] for i in paths[node])))

    return target_probs


def all_rows(prefix, tokens, parents) -> torch.Tensor:
    """[num_nodes + 1, VOCAB]: the target row at the root, then after each node's path
    (verify_tree's prefetched form of :func:`target_fn`)."""
    rows = [target_row(tuple(prefix))]
    rows += [target_row((*prefix, *(tokens[i] for i in path))) for path in tree_paths(parents)]
    return torch.stack(rows)


def sample_sequences(mode: str, q_fn, seed: int, num: int = NUM_SAMPLES, prefetched: bool = False) -> Counter:
    """prefetched: hand verify_tree every row at once (:func:`all_rows`) instead of the lazy callable."""
    draft_rng, verify_gen = random.Random(seed), _generator(seed + 1000)
    target = all_rows if prefetched else target_fn
    counts: Counter = Counter()
    for n in range(num):
        emitted: list[int] = []
        while len(emitted) < LENGTH:
            tokens, parents, draft = draft_tree(emitted, mode, q_fn, draft_rng, bfs=n % 2 == 0)
            verdict = verify_tree(tokens, parents, draft, target(emitted, tokens, parents), verify_gen)
            assert verdict.tokens == [tokens[i] for i in verdict.path]
            emitted.extend(verdict.emitted)
        counts[tuple(emitted[:LENGTH])] += 1
    return counts


EXACT = exact_sequences(LENGTH)


@pytest.mark.parametrize(
    "mode,q_fn,seed",
    [
        ("onehot", None, 11),
        ("onehot_dup", None, 12),
        ("iid", draft_row, 13),
        ("wor", draft_row, 14),
        ("iid", mismatched_row, 15),
        ("wor", mismatched_row, 16),
    ],
    ids=["onehot-distinct", "onehot-duplicates", "iid", "without-replacement", "iid-zeros", "wor-zeros"],
)
def test_tree_verification_is_exact(mode, q_fn, seed):
    counts = sample_sequences(mode, q_fn, seed)
    p_value, tv = goodness_of_fit(counts, EXACT)
    assert p_value > 1e-3, (p_value, tv)
    assert tv < 0.08, tv


def test_negative_control_without_residual_is_caught(monkeypatch):
    # On rejection keep sampling from the row itself instead of the residual.
    monkeypatch.setattr(tree_module, "positive_residual", lambda row, q: row)
    counts = sample_sequences("iid", draft_row, 21)
    p_value, _ = goodness_of_fit(counts, EXACT)
    assert p_value < 1e-6


def test_negative_control_wrong_sibling_law_is_caught():
    # Siblings drawn without replacement but verified as if drawn i.i.d. from q.
    counts = sample_sequences("wor_claim_q", mismatched_row, 22)
    p_value, _ = goodness_of_fit(counts, EXACT)
    assert p_value < 1e-6


# --------------------------------------------------------------------------- hand-built cases


def test_one_hot_siblings_follow_the_closed_form():
    # Root children tokens 0 then 1 (one-hot): P(0) = p0, P(1) = p1, else p without {0, 1}.
    p = probs(0.1, 0.2, 0.3, 0.4)
    leaf = probs(1.0, 0.0, 0.0, 0.0)
    firsts = Counter()
    num = 6000
    gen = _generator(5)
    for _ in range(num):
        verdict = verify_tree([0, 1], [-1, -1], None, lambda node: p if node == -1 else leaf, gen)
        firsts[verdict.emitted[0]] += 1
        if verdict.path:
            assert verdict.kind == "bonus" and verdict.next_token == 0
        else:
            assert verdict.kind == "resampled" and verdict.next_token in (2, 3)
            assert verdict.checked == (0, 1)
            assert verdict.accept_probs == pytest.approx((0.1, 0.2 / 0.9))
    assert [firsts[k] / num for k in range(4)] == pytest.approx(p.tolist(), abs=0.02)


def test_uniform_decides_and_residual_chains(monkeypatch):
    # reject both root children (the level's uniforms are drawn in one call: one per child + one)
    monkeypatch.setattr(tree_module, "uniforms",
                        lambda generator, count: torch.tensor([0.9, 0.9, 0.5][:count], dtype=torch.float64))
    p = probs(0.5, 0.3, 0.2, 0.0)
    q1 = probs(0.7, 0.1, 0.1, 0.1)  # node 0 proposes token 0: ratio 5/7
    q2 = probs(0.0, 1.0, 0.0, 0.0)  # node 2 proposes token 1
    draft = torch.stack([q1, q1, q2])
    calls = []

    def target(node):
        calls.append(node)
        return p

    # Node 1 is node 0's child: never looked at because node 0 is rejected.
    verdict = verify_tree([0, 2, 1], [-1, 0, -1], draft, target, _generator(0))
    # Residual after node 0: (p - q1)+ = [0, .2, .1, 0] / .3; ratio for token 1 = 2/3 < 0.9 -> reject;
    # residual after node 2: ([0, 2/3, 1/3, 0] - [0, 1, 0, 0])+ -> token 2 only.
    assert verdict.path == [] and verdict.kind == "resampled" and verdict.next_token == 2
    assert verdict.checked == (0, 2)
    assert verdict.accept_probs == pytest.approx((5 / 7, 2 / 3))
    assert calls == [-1]


def test_target_is_called_only_along_the_accepted_path():
    # Tree: 0 -> {1, 2}, 3 (root); p is one-hot so acceptance is decided.
    rows = {-1: probs(1, 0, 0, 0), 0: probs(0, 0, 1, 0), 2: probs(0, 0, 0, 1)}
    calls = []

    def target(node):
        calls.append(node)
        return rows[node]

    verdict = verify_tree([0, 1, 2, 3], [-1, 0, 0, -1], None, target, _generator(0))
    assert (verdict.path, verdict.tokens, verdict.next_token, verdict.kind) == ([0, 2], [0, 2], 3, "bonus")
    assert verdict.num_accepted == 2
    assert verdict.checked == (0, 1, 2) and verdict.accept_probs == (1.0, 0.0, 1.0)
    assert calls == [-1, 0, 2]


def test_empty_tree_gives_bonus_from_root():
    p = probs(0.0, 0.0, 1.0, 0.0)
    for draft in (None, torch.zeros((0, VOCAB), dtype=torch.float64)):
        verdict = verify_tree([], [], draft, lambda node: p, _generator(0))
        assert verdict == TreeVerdict([], [], 2, "bonus")
    assert verify_tree_greedy([], [], lambda node: 3) == TreeVerdict([], [], 3, "bonus")


def test_identical_p_and_q_always_accepts():
    p = probs(0.25, 0.25, 0.5, 0.0)
    draft = torch.stack([p, p])
    for seed in range(50):
        verdict = verify_tree([2, 0], [-1, 0], draft, lambda node: p, _generator(seed))
        assert verdict.path == [0, 1] and verdict.accept_probs == (1.0, 1.0) and verdict.kind == "bonus"


def test_round_off_rejection_falls_back_to_target(monkeypatch):
    # q differs from p by round-off, and the uniform is forced above the ratio:
    # the residual has no mass, so the row itself is used (never a zero-p token, no NaN).
    monkeypatch.setattr(tree_module, "uniforms",
                        lambda generator, count: torch.full((count,), 1.0 - 1e-16, dtype=torch.float64))
    p = probs(0.25, 0.25, 0.5, 0.0)
    q = p + probs(-1e-14, 0.0, 1e-14, 0.0)
    draft = torch.stack([q, q])
    for seed in range(30):
        verdict = verify_tree([2, 2], [-1, -1], draft, lambda node: p, _generator(seed))
        assert verdict.path == [] and verdict.kind == "resampled"
        assert verdict.next_token in (0, 1, 2)


def test_invalid_inputs_raise():
    p = probs(0.5, 0.5, 0.0, 0.0)
    target = lambda node: p
    gen = _generator(0)
    with pytest.raises(ValueError, match="parent"):
        verify_tree([0, 1], [-1, 1], None, target, gen)
    with pytest.raises(ValueError, match="parent"):
        verify_tree([0, 1], [-1, -2], None, target, gen)
    with pytest.raises(ValueError, match="2 tokens but 1 parents"):
        verify_tree([0, 1], [-1], None, target, gen)
    with pytest.raises(ValueError, match="draft_probs shape"):
        verify_tree([0, 1], [-1, 0], p.unsqueeze(0), target, gen)
    with pytest.raises(ValueError, match="vocab"):
        verify_tree([0], [-1], probs(1.0, 0.0, 0.0).unsqueeze(0), target, gen)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_tree([7], [-1], None, target, gen)
    with pytest.raises(ValueError, match=r"\[vocab\]"):
        verify_tree([0], [-1], None, lambda node: p.unsqueeze(0), gen)
    with pytest.raises(ValueError, match="vocab"):
        verify_tree([0], [-1], None, lambda node: p if node == -1 else probs(1.0, 0.0), gen)
    with pytest.raises(NumericalError, match="NaN"):
        verify_tree([0], [-1], None, lambda node: probs(float("nan"), 0.5, 0.5, 0.0), gen)
    with pytest.raises(NumericalError, match="NaN"):
        verify_tree([0], [-1], probs(float("nan"), 1.0, 0.0, 0.0).unsqueeze(0), target, gen)
    with pytest.raises(NumericalError, match="sums to"):
        verify_tree([0], [-1], None, lambda node: probs(0.5, 0.1, 0.0, 0.0), gen)
    with pytest.raises(NumericalError, match="zero draft probability"):
        verify_tree([2], [-1], p.unsqueeze(0), target, gen)
    with pytest.raises(ValueError, match="parent"):
        verify_tree_greedy([0], [0], lambda node: 0)
    with pytest.raises(ValueError, match="parent"):
        ancestor_matrix([-1, 5])


# --------------------------------------------------------------------------- greedy


def greedy_continuation(prefix: tuple[int, ...], length: int) -> list[int]:
    out = list(prefix)
    while len(out) < len(prefix) + length:
        out.append(int(torch.argmax(target_row(tuple(out)))))
    return out[len(prefix) :]


def greedy_fn(prefix, tokens, parents):
    rows = target_fn(prefix, tokens, parents)
    return lambda node: int(torch.argmax(rows(node)))


def test_greedy_tree_matches_greedy_decoding():
    rng = random.Random(31)
    for n in range(300):
        prefix = tuple(rng.randrange(VOCAB) for _ in range(n % 3))
        tokens, parents, _ = draft_tree(prefix, "onehot_dup" if n % 2 else "onehot", None, rng, bfs=n % 3 == 0)
        verdict = verify_tree_greedy(tokens, parents, greedy_fn(prefix, tokens, parents))
        emitted = verdict.emitted
        assert emitted == greedy_continuation(prefix, len(emitted))
        assert verdict.tokens == [tokens[i] for i in verdict.path]
        assert [parents[i] for i in verdict.path] == [-1, *verdict.path][: len(verdict.path)]
        if verdict.path and not tree_children(parents)[verdict.path[-1]]:
            assert verdict.kind == "bonus"


def test_greedy_path_in_tree_is_accepted_fully():
    rng = random.Random(32)
    for n in range(200):
        prefix = tuple(rng.randrange(VOCAB) for _ in range(n % 3))
        tokens, parents, _ = draft_tree(prefix, "onehot_dup", None, rng, bfs=n % 2 == 0)
        # Graft the greedy path (depth MAX_DEPTH) into the tree: follow the first
        # child carrying the greedy token where there is one, else add a new child.
        greedy = greedy_continuation(prefix, MAX_DEPTH + 1)
        node, expected_path = -1, []
        for token in greedy[:MAX_DEPTH]:
            match = [c for c in tree_children(parents)[node] if tokens[c] == token]
            if match:
                node = match[0]
            else:
                tokens.append(token)
                parents.append(node)
                node = len(tokens) - 1
            expected_path.append(node)
        verdict = verify_tree_greedy(tokens, parents, greedy_fn(prefix, tokens, parents))
        assert verdict.path == expected_path
        assert verdict.emitted == greedy
        assert verdict.kind == "bonus"


def test_greedy_duplicate_siblings_first_wins():
    # Node 2 duplicates node 1's token: node 1 wins, so node 2's child (the greedy
    # continuation 5 below it) is never reached -- tree builders should merge duplicates.
    verdict = verify_tree_greedy([1, 2, 2, 5], [-1, -1, -1, 2], lambda node: {-1: 2, 1: 0, 2: 5}[node])
    assert (verdict.path, verdict.next_token, verdict.kind) == ([1], 0, "bonus")
    assert verdict.checked == (0, 1) and verdict.accept_probs == (0.0, 1.0)
    verdict = verify_tree_greedy([1, 4], [-1, 0], lambda node: {-1: 1, 0: 3}[node])
    assert (verdict.path, verdict.next_token, verdict.kind) == ([0], 3, "resampled")


# --------------------------------------------------------------------------- structure helpers


def test_structure_helpers():
    parents = [-1, 0, 0, -1, 2, 3]
    assert tree_depths(parents) == [1, 2, 2, 1, 3, 2]
    assert tree_paths(parents) == [[0], [0, 1], [0, 2], [3], [0, 2, 4], [3, 5]]
    assert ancestors(parents, 4) == [2, 0]
    assert ancestors(parents, 3) == []
    assert tree_children(parents) == {-1: [0, 3], 0: [1, 2], 1: [], 2: [4], 3: [5], 4: [], 5: []}
    mask = ancestor_matrix(parents)
    assert mask.dtype == torch.bool and mask.shape == (6, 6)
    expected = torch.zeros((6, 6), dtype=torch.bool)
    for i, path in enumerate(tree_paths(parents)):
        expected[i, path] = True
    assert torch.equal(mask, expected)
    assert torch.equal(mask, torch.tril(mask))
    assert ancestor_matrix([]).shape == (0, 0)
    assert tree_depths([]) == []
