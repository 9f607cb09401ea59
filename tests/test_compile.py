"""compile=true: static KV cache + bucketed, compiled target forwards on tiny models.

The eager pipeline on the same (seeded) tiny weights is the oracle: greedy
output must match it token for token, the static cache must give the eager
logits after crop / sync / keep_rows / growth, and sampled output of the
compiled path must follow the eager target's enumerated distribution
(NUM_SAMPLES = 1200, the count test_exactness and test_learned_drafters use and
justify). Pipelines are built once per module, so each bucket compiles once; every
compiled target here is the same 8-token tiny model, so later pipelines' buckets
are hits in inductor's FX graph cache (a cold cache compiles each graph once).
"""

from __future__ import annotations

import pytest
import torch

import specgen
from conftest import TINY
from exact import exact_distribution, goodness_of_fit, sample_counts
from specgen.errors import ConfigError
from specgen.heads import HeadConfig, build_head, save_head, target_fingerprint
from specgen.models import compiled as compiled_module
from specgen.sampling.tree import ancestor_matrix, tree_depths

VOCAB8 = ("target.source.vocab_size=8",)
GREEDY = ("sampling.temperature=0",)
PROMPTS = ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 7, 5, 6, 7, 5], [2])
NUM_SAMPLES = 1200


def _pipe(*overrides, drafter="ngram", compile_=False):
    return specgen.pipeline(*TINY, f"drafter={drafter}", *overrides, f"compile={str(compile_).lower()}",
                            progress=False)


@pytest.fixture(scope="module")
def greedy_pair():
    return _pipe(*VOCAB8, *GREEDY), _pipe(*VOCAB8, *GREEDY, compile_=True)


def test_greedy_compiled_equals_eager(greedy_pair):
    eager, compiled = greedy_pair
    for prompt in PROMPTS:
        for speculative in (True, False):
            want = eager.generate(prompt_ids=prompt, max_new_tokens=40, seed=0, speculative=speculative)
            got = compiled.generate(prompt_ids=prompt, max_new_tokens=40, seed=0, speculative=speculative)
            assert got.token_ids == want.token_ids, (prompt, speculative)
    assert compiled.generate(prompt_ids=PROMPTS[0], max_new_tokens=40, seed=0).stats.drafted > 0
    assert (1, False) in compiled.target.compiled.compiled, "the 1-token bucket must have run compiled"
    assert len(compiled.target.compiled.compiled) >= 2, "some verify forward must have run in a larger bucket"


def _eager_logits(lm, tokens: list[int]) -> torch.Tensor:
    """Last-row logits [vocab] of ``tokens`` from a fresh eager cache."""
    return lm.forward(lm.new_cache(), tokens, keep=1)[0]


def test_static_cache_crop_sync_keep_rows(greedy_pair):
    eager, compiled = greedy_pair
    lm, ref = compiled.target, eager.target
    cache = lm.new_cache()
    prompt = [1, 2, 3, 4, 5, 6, 7, 0, 1]
    lm.forward(cache, prompt, keep=1)
    lm.forward(cache, [2, 3, 4], keep=3)  # bucket 4: one padding row written past the end
    cache.crop(len(prompt))
    got = lm.forward(cache, [7, 6], keep=1)[0]
    torch.testing.assert_close(got, _eager_logits(ref, prompt + [7, 6]), rtol=1e-5, atol=1e-5)
    cache.sync(prompt + [7, 5, 5])  # keeps prompt + [7]
    assert cache.tokens == prompt + [7]
    got = lm.forward(cache, cache.uncached(prompt + [7, 6]), keep=1)[0]
    torch.testing.assert_close(got, _eager_logits(ref, prompt + [7, 6]), rtol=1e-5, atol=1e-5)

    parents = [-1, -1, 0, 2, 1]  # nodes 0 and 1 under the root; path 0 -> 2 -> 3
    nodes = [3, 4, 5, 6, 7]
    committed = prompt + [7, 6]
    chain = cache.uncached(committed)
    prefix = len(cache) + len(chain)
    out = lm.forward_tree(cache, chain, nodes, ancestor_matrix(parents), tree_depths(parents))
    torch.testing.assert_close(out.logits(4)[0], _eager_logits(ref, committed + [3, 5, 6]), rtol=1e-5, atol=1e-5)
    cache.keep_rows(prefix, [0, 2, 3])
    assert cache.tokens == committed + [3, 5, 6]
    got = lm.forward(cache, [2], keep=1)[0]
    torch.testing.assert_close(got, _eager_logits(ref, committed + [3, 5, 6, 2]), rtol=1e-5, atol=1e-5)


def test_static_cache_grows_and_keeps_entries(greedy_pair, monkeypatch):
    eager, compiled = greedy_pair
    monkeypatch.setattr("specgen.models.causal_lm.FIRST_CAPACITY", 16)
    cache = compiled.target.new_cache()
    tokens = [1 + i % 7 for i in range(20)]
    compiled.target.forward(cache, tokens, keep=1)  # 20 > 16 slots, outside the buckets: eager, after growing
    assert compiled_module.capacity(cache.cache) == 32
    got = compiled.target.forward(cache, [3], keep=1)[0]
    torch.testing.assert_close(got, _eager_logits(eager.target, tokens + [3]), rtol=1e-5, atol=1e-5)


def test_compile_flag_is_checked():
    with pytest.raises(ConfigError, match="compile"):
        specgen.pipeline(*TINY, "drafter=none", "compile=maybe", progress=False)


def _exactness(eager, compiled, prompt, length):
    expected = exact_distribution(eager, prompt, length)  # the eager target is the oracle
    counts = sample_counts(compiled, prompt, length, NUM_SAMPLES)
    assert compiled.generate(prompt_ids=prompt, max_new_tokens=length, seed=0).stats.drafted > 0
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"


@pytest.mark.slow
def test_compiled_chain_drafter_is_exact():
    overrides = (*VOCAB8, "drafter.source.vocab_size=8", "sampling.temperature=1.0")
    eager = _pipe(*overrides, drafter="tiny")
    compiled = _pipe(*overrides, drafter="tiny", compile_=True)
    assert str(compiled.guarantee) == "exact"
    _exactness(eager, compiled, [1, 2, 3], 3)


@pytest.mark.slow
def test_compiled_tree_drafter_is_exact(tmp_path):
    eager = _pipe(*VOCAB8, "sampling.temperature=1.0", drafter="none")
    d = eager.target.model.config.hidden_size
    draft_vocab = [0, 1, 2, 4, 5, 7]
    torch.manual_seed(0)
    head = build_head(HeadConfig(kind="eagle", hidden_size=d, draft_vocab_size=len(draft_vocab),
                                 intermediate_size=2 * d, num_heads=4), torch.tensor(draft_vocab))
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.3)
    path = save_head(tmp_path / "eagle.safetensors", head, target_fingerprint(eager.target.model), command="test",
                     seed=0, dtype=torch.float32)
    # 8 nodes: every tree verify (the root and its nodes) fits a compiled bucket; a 17-token one would run
    # eagerly, which the load-time measurement finds differs from compiled single-token steps (approximate)
    compiled = _pipe(*VOCAB8, "sampling.temperature=1.0", f"drafter.head_file={path}", "drafter.tree.nodes=8",
                     drafter="eagle", compile_=True)
    assert str(compiled.guarantee) == "exact"
    _exactness(eager, compiled, [1, 2, 3], 4)
    assert any(hidden for _, hidden in compiled.target.compiled.compiled), "features must come from a compiled forward"
