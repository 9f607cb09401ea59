"""Rounds that read back once per verification, as off the CPU (``Pipeline.read_once``).

A tree is verified from every node's row, computed, processed and read back at once;
a chain draws every possible final token ahead. Both must be the same procedures as
the CPU's, so they get the same checks: exactness against the enumerated target law
(synthetic trees and real tiny pipelines, with penalties and a grammar), a negative
control, verdict identity, greedy token identity with plain decoding, dead ends, and
the host-read count.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

import specgen
from conftest import TINY
from exact import exact_distribution, goodness_of_fit, sample_counts
from specgen.bench.host_reads import counting_reads
from specgen.heads import HeadConfig, build_head, save_head, target_fingerprint
from specgen.processors import CommittedCounts, History, PathHistory
from specgen.sampling import tree as tree_module
from specgen.sampling import verify_chain, verify_tree
from test_tree_sampling import EXACT, _generator, draft_row, mismatched_row, sample_sequences

PROMPT = [1, 2, 3]


# Sample sizes follow tests/test_exactness.py (1200 per pipeline case) and tests/test_tree_sampling.py
# (3000 per synthetic case), where the negative controls were measured to still fail at these sizes;
# here test_prefetched_negative_control_without_residual_is_caught checks its own.
def sample_prefetched(mode: str, q_fn, seed: int) -> Counter:
    return sample_sequences(mode, q_fn, seed, num=3000, prefetched=True)


@pytest.mark.parametrize("mode,q_fn,seed", [("onehot_dup", None, 31), ("wor", mismatched_row, 32)])
def test_prefetched_tree_verification_is_exact(mode, q_fn, seed):
    p_value, tv = goodness_of_fit(sample_prefetched(mode, q_fn, seed), EXACT)
    assert p_value > 1e-3, (p_value, tv)
    assert tv < 0.08, tv



#: These tests count a device's reads on the CPU, so argmax takes the device's path (conftest.device_path).
pytestmark = pytest.mark.usefixtures("device_path")

def test_prefetched_negative_control_without_residual_is_caught(monkeypatch):
    monkeypatch.setattr(tree_module, "positive_residual", lambda row, q: row)
    p_value, _ = goodness_of_fit(sample_prefetched("iid", draft_row, 34), EXACT)
    assert p_value < 1e-6


@pytest.mark.parametrize("num_nodes", [3, 40])
def test_prefetched_one_hot_tree_reads_twice_whatever_its_size(num_nodes):
    """One read for the whole walk, one for the final draw; the lazy walk reads once per level."""
    parents = [-1] + [i // 2 for i in range(num_nodes - 1)]  # a binary tree
    tokens = [i % 4 for i in range(num_nodes)]
    rows = torch.full((num_nodes + 1, 4), 0.25, dtype=torch.float64)  # [N + 1, 4]
    with counting_reads() as count:
        verdict = verify_tree(tokens, parents, None, rows, _generator(0))
    assert count[0] == 2, count[0]
    assert verdict.num_accepted >= 0


def test_prefetched_dead_end_and_unvisited_rows():
    """An all-zero row of an accepted node is a dead end; a broken row the walk never
    visits is not looked at (as in the lazy walk); a broken visited row raises."""
    one, zero = [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]
    nan = [float("nan")] * 3
    rows = torch.tensor([one, zero, nan], dtype=torch.float64)  # root -> node 0 (token 1, empty row), node 1
    verdict = verify_tree([1, 2], [-1, -1], None, rows, _generator(0))
    assert (verdict.path, verdict.kind, verdict.next_token) == ([0], "dead_end", None)
    with pytest.raises(specgen.SpecgenError, match="NaN"):
        verify_tree([2, 1], [-1, 0], None, torch.tensor([[0.0, 0.0, 1.0], nan, one], dtype=torch.float64),
                    _generator(0))
    with pytest.raises(ValueError, match="the root, then every node"):
        verify_tree([1], [-1], None, torch.tensor([one], dtype=torch.float64), _generator(0))


def test_draw_ahead_gives_the_same_verdicts():
    """verify_chain(draw_ahead=True) uses the same uniforms for the same draws: every verdict
    equals the two-read path's, sampled and one-hot drafts, dead ends and residual fallbacks
    included -- so the chain's exactness tests cover it."""
    gen = torch.Generator().manual_seed(0)
    compared = {"resampled": 0, "bonus": 0, "dead_end": 0}
    for trial in range(1500):
        n = trial % 4
        p = torch.softmax(3 * torch.randn(n + 1, 6, generator=gen, dtype=torch.float64), dim=-1)  # [n + 1, 6]
        if n and trial % 5 == 0:
            p[n] = 0.0  # a dead end after the whole draft
        q = None if trial % 3 == 0 else torch.softmax(3 * torch.randn(n, 6, generator=gen, dtype=torch.float64), -1)
        if q is not None and n and trial % 7 == 0:
            q[0] = p[0]  # no residual mass: the fallback row
        tokens = torch.randint(6, (n,), generator=gen).tolist()
        plain = verify_chain(p, q, tokens, _generator(trial))
        ahead = verify_chain(p, q, tokens, _generator(trial), draw_ahead=True)
        assert ahead == plain, (trial, plain, ahead)
        compared[plain.kind] += 1
    assert min(compared.values()) > 20, compared


def test_read_once_chain_round_is_exact_with_penalties():
    """The small-model drafter's device-resident draws (counts on the device) and the
    draw-ahead verification, against the enumerated law."""
    from conftest import tiny_pipeline

    pipe = tiny_pipeline("target.source.vocab_size=8", "drafter.source.vocab_size=8", "sampling.temperature=1.0", "sampling.repetition_penalty=1.8",
                         "sampling.frequency_penalty=0.5", drafter="tiny")
    pipe.read_once = True
    expected = exact_distribution(pipe, PROMPT, 3)
    counts = sample_counts(pipe, PROMPT, 3, 1200)
    assert pipe.generate(prompt_ids=PROMPT, max_new_tokens=3, seed=0).stats.drafted > 0
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"


def test_path_history_rows_equal_chain_histories():
    """Each PathHistory row is the History of its own path: counts, generated count, tail."""
    committed = CommittedCounts.start([1, 2, 3], 8, torch.device("cpu"))
    committed.commit([4, 4])
    paths = [[], [5], [5, 6], [7]]
    tree = PathHistory(committed, paths)
    for row, path in enumerate(paths):
        chain = History(committed, path, num_positions=1, start=len(path))
        torch.testing.assert_close(tree.seen_counts[row], chain.seen_counts[0])
        torch.testing.assert_close(tree.generated_counts[row], chain.generated_counts[0])
        assert int(tree.num_generated[row]) == int(chain.num_generated[0])
        assert tree.full(row) == chain.full(0) and tree.tail(row, 3) == chain.tail(0, 3)
        assert tree.draft_dependent(row) == chain.draft_dependent(0) == bool(path)


# --------------------------------------------------------------------------- real tiny pipelines

DRAFT_VOCAB = [0, 1, 2, 4, 5, 7]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    base = tmp_path_factory.mktemp("prefetch-heads")
    out = {}
    for vocab in (8, 16):
        model = specgen.pipeline(*TINY, f"target.source.vocab_size={vocab}", "drafter=none", progress=False).target.model
        d = model.config.hidden_size
        for kind in ("eagle", "medusa"):
            torch.manual_seed(1)
            head = build_head(HeadConfig(kind=kind, hidden_size=d, draft_vocab_size=len(DRAFT_VOCAB),
                                         intermediate_size=2 * d, num_heads=4), torch.tensor(DRAFT_VOCAB))
            with torch.no_grad():
                for param in head.parameters():
                    param.normal_(0.0, 0.3)
            out[kind, vocab] = str(save_head(base / f"{kind}{vocab}.safetensors", head, target_fingerprint(model),
                                             dtype=torch.float32))
    return out


def _pipe(heads, kind, vocab, *overrides):
    pipe = specgen.pipeline(*TINY, f"target.source.vocab_size={vocab}", f"drafter={kind}",
                            f"drafter.head_file={heads[kind, vocab]}", *overrides, progress=False)
    pipe.read_once = True
    return pipe


def test_prefetched_tree_drafter_is_exact_with_penalties(heads):
    """The tree's rows get top-k, a repetition and a presence penalty through PathHistory."""
    pipe = _pipe(heads, "eagle", 8, "sampling.temperature=0.9", "sampling.top_k=5", "sampling.repetition_penalty=1.5",
                 "sampling.presence_penalty=0.8", "drafter.tree.top_k=3", "drafter.tree.nodes=7")
    expected = exact_distribution(pipe, PROMPT, 4)
    counts = sample_counts(pipe, PROMPT, 4, 1200)
    assert pipe.generate(prompt_ids=PROMPT, max_new_tokens=4, seed=0).stats.drafted > 0
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"


def test_prefetched_tree_is_exact_under_a_grammar(heads):
    from specgen.grammar import grammar_processor

    regex = "(at|ta)[en]{0,3}"  # a=4, t=3, e=2, n=7; EOS=0
    pipe = _pipe(heads, "eagle", 16, "sampling.temperature=1.0")
    stack = pipe.stack.with_grammar(grammar_processor({"kind": "regex", "pattern": regex}, pipe.tokenizer))
    expected = exact_distribution(pipe, PROMPT, 6, stack=stack)
    counts = sample_counts(pipe, PROMPT, 6, 1200, regex=regex)
    for seq in counts:
        assert seq[-1] == 0 and re.fullmatch(regex, pipe.tokenizer.decode(seq))
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_prefetched_greedy_equals_plain(heads, kind):
    pipe = _pipe(heads, kind, 16, "sampling.temperature=0", "sampling.repetition_penalty=1.3")
    for prompt in ([1, 2, 3], [5, 4, 7, 1]):
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=40, seed=0)
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=40, seed=0, speculative=False)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.drafted > 0
