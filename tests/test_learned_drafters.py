"""Learned drafters (EAGLE, Medusa, MTP, DSpark) on the tiny target with random heads.

Heads are built in code for the tiny target and written with the real head
format, so loading, fingerprint checks, tree drafting, tree verification and
feature hand-over all run as in production. Exactness is statistical against
the enumerated target distribution; greedy equivalence is token for token.

NUM_SAMPLES = 1200 (was 2000): on the "eagle" case, a tree verifier that keeps the
rejected siblings' tokens in the final draw gives p = 1e-16 at 1200 (2000: 2e-35).
"""

from __future__ import annotations

import pytest
import torch

import specgen
from conftest import TINY, TREE_PREFIX, check_tree_forward_matches_each_path
from exact import exact_distribution, goodness_of_fit, sample_counts
from specgen.errors import ConfigError, ModelLoadError
from specgen.heads import HeadConfig, build_head, save_head, target_fingerprint
from specgen.engine.round import speculative_round

VOCAB8 = ("target.source.vocab_size=8",)
PROMPT = [1, 2, 3]
DRAFT_VOCAB = [0, 1, 2, 4, 5, 7]  # a reduced draft vocabulary: q is zero on 3, 6 (and 8+ for vocab 16)
NUM_SAMPLES = 1200


def _target(*overrides):
    return specgen.pipeline(*TINY, *overrides, "drafter=none", progress=False)


def _write_head(path, kind: str, target_pipe, seed: int = 0):
    model = target_pipe.target.model
    d = model.config.hidden_size
    attention = {}
    if kind == "eagle3":  # an attention head on fused features of hidden states 0, 1 and 2
        attention = {"feature_layers": [0, 1, 2], "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": d // 4}
    cfg = HeadConfig(kind=kind, hidden_size=d, draft_vocab_size=len(DRAFT_VOCAB), intermediate_size=2 * d,
                     num_heads=4, **attention)
    torch.manual_seed(seed)
    head = build_head(cfg, torch.tensor(DRAFT_VOCAB))
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0.0, 0.3)
    return save_head(path, head, target_fingerprint(model), command="test", seed=seed, dtype=torch.float32)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    base = tmp_path_factory.mktemp("heads")
    pipe8 = _target(*VOCAB8)
    return {kind: str(_write_head(base / f"{kind}.safetensors", kind, pipe8))
            for kind in ("eagle", "eagle3", "medusa", "mtp", "dspark")}


def _drafter(kind: str) -> str:
    return "eagle" if kind == "eagle3" else kind  # drafter=eagle runs either head kind


def _pipe(kind, heads, *overrides):
    return specgen.pipeline(*TINY, *VOCAB8, f"drafter={_drafter(kind)}", f"drafter.head_file={heads[kind]}",
                            *overrides, progress=False)


EXACT_CASES = {
    "eagle": ("eagle", ("sampling.temperature=1.0",)),
    "eagle+top_k+penalty": ("eagle", ("sampling.temperature=0.9", "sampling.top_k=5",
                                      "sampling.repetition_penalty=1.5", "drafter.tree.top_k=3",
                                      "drafter.tree.nodes=7")),
    "eagle3": ("eagle3", ("sampling.temperature=1.0",)),
    "eagle3-chain+top_k+penalty": ("eagle3", ("sampling.temperature=0.9", "sampling.top_k=5",
                                              "sampling.repetition_penalty=1.5", "drafter.tree.top_k=1",
                                              "drafter.tree.expand=1", "drafter.num_tokens=3")),
    "medusa": ("medusa", ("sampling.temperature=1.0", "drafter.num_tokens=3")),
    "mtp": ("mtp", ("sampling.temperature=1.0", "drafter.num_tokens=3")),
    "mtp+top_p+presence": ("mtp", ("sampling.temperature=0.8", "sampling.top_p=0.9",
                                   "sampling.presence_penalty=0.8")),
}


@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_learned_drafters_are_exact(name, heads):
    kind, overrides = EXACT_CASES[name]
    pipe = _pipe(kind, heads, *overrides)
    assert str(pipe.guarantee) == "exact"
    length = 4
    expected = exact_distribution(pipe, PROMPT, length)
    counts = sample_counts(pipe, PROMPT, length, NUM_SAMPLES)
    stats = pipe.generate(prompt_ids=PROMPT, max_new_tokens=length, seed=0).stats
    assert stats.drafted > 0, "the drafter must propose for this test to mean anything"
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"{name}: chi-square p={p_value:.2e}, TV={tv:.3f}"


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "mtp", "dspark"])
def test_greedy_learned_drafters_equal_plain(kind, heads):
    pipe = _pipe(kind, heads, "sampling.temperature=0", "sampling.repetition_penalty=1.3")
    assert str(pipe.guarantee) == "greedy"
    for prompt in ([1, 2, 3], [5, 4, 7, 1], [2]):
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=40, seed=0)
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=40, seed=0, speculative=False)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.drafted > 0


def _same_state(a, b) -> bool:
    """Two session marks hold equal values (tensors compared by value, None by identity)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_tree_round_rolls_back_and_continues(heads, monkeypatch, kind):
    """An injected failure in verification rolls back everything the round touched, the
    attention head's draft KV cache included, and the request then continues as if the
    failed round never ran (sampled at T=1: any draft that differs changes the output)."""
    pipe = _pipe(kind, heads, "sampling.temperature=1.0")
    reference = pipe.generate(prompt_ids=PROMPT, max_new_tokens=25, seed=3)
    request, ctx = pipe.open_request(PROMPT, max_new_tokens=25, seed=3)
    for _ in range(3):
        speculative_round(request, ctx, pipe.drafter.num_tokens)
    tokens, cache_len = list(request.committed.tokens), len(request.target_cache)
    mark = request.draft.mark()

    import specgen.engine.round as round_module

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    with monkeypatch.context() as patch:
        patch.setattr(round_module, "verify", boom)
        with pytest.raises(RuntimeError, match="injected"):
            speculative_round(request, ctx, pipe.drafter.num_tokens)
    assert request.committed.tokens == tokens and len(request.target_cache) == cache_len
    assert request.target_cache.tokens == tokens[: cache_len]
    assert _same_state(request.draft.mark(), mark)
    if kind == "eagle3":  # the failed round had grown the draft KV cache before verification
        assert request.draft.keys is not None and request.draft.pending is not None
    while request.finish_reason is None:
        speculative_round(request, ctx, pipe.drafter.num_tokens)
    assert request.generated == reference.token_ids


@pytest.mark.parametrize("lazy_logits", [True, False])
def test_tree_forward_matches_each_path(lazy_logits):
    pipe = _target()
    lm = pipe.target
    lm._plain_lm_head = lazy_logits  # False: the path for models that scale or cap their logits
    prefix = TREE_PREFIX
    cache = check_tree_forward_matches_each_path(lm)
    cache.keep_rows(len(prefix), [0, 2, 4])
    assert cache.tokens == prefix + [6, 8, 10]
    after = lm.forward(cache, [3], keep=1)
    torch.testing.assert_close(after, lm.forward(lm.new_cache(), prefix + [6, 8, 10, 3], keep=1), atol=1e-4, rtol=1e-4)


def test_head_for_another_target_is_refused(heads):
    with pytest.raises(ModelLoadError, match="trained for a different target"):
        specgen.pipeline(*TINY, "drafter=eagle", f"drafter.head_file={heads['eagle']}", progress=False)
    with pytest.raises(ModelLoadError, match="holds a medusa head"):
        _pipe("eagle", {"eagle": heads["medusa"]})
    with pytest.raises(ModelLoadError, match="does not exist"):
        _pipe("mtp", {"mtp": "/nonexistent/head.safetensors"})


def test_medusa_tree_config_is_validated(heads):
    with pytest.raises(ConfigError, match="not its parent"):
        _pipe("medusa", heads, "drafter.tree=[[0],[1,0]]")
    with pytest.raises(ConfigError, match="deeper than"):
        _pipe("medusa", heads, "drafter.tree=[[0],[0,0],[0,0,0],[0,0,0,0],[0,0,0,0,0]]")


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp", "dspark"])
def test_learned_drafters_are_exact_under_a_grammar(kind, tmp_path):
    """The grammar mask is part of p (and of the MTP's q); tree and chain stay exact."""
    import re

    from specgen.grammar import grammar_processor

    regex = "(at|ta)[en]{0,3}"  # tiny alphabet: a=4, t=3, e=2, n=7; EOS=0
    target = _target()
    head = _write_head(tmp_path / f"{kind}16.safetensors", kind, target, seed=5)
    pipe = specgen.pipeline(*TINY, f"drafter={_drafter(kind)}", f"drafter.head_file={head}",
                            "sampling.temperature=1.0", progress=False)
    stack = pipe.stack.with_grammar(grammar_processor({"kind": "regex", "pattern": regex}, pipe.tokenizer))
    expected = exact_distribution(pipe, PROMPT, 6, stack=stack)
    counts = sample_counts(pipe, PROMPT, 6, NUM_SAMPLES, regex=regex)
    for seq in counts:
        assert seq[-1] == 0 and re.fullmatch(regex, pipe.tokenizer.decode(seq))
    assert pipe.generate(prompt_ids=PROMPT, max_new_tokens=6, seed=3, regex=regex).stats.drafted > 0
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"{kind}: chi-square p={p_value:.2e}, TV={tv:.3f}"
