"""w8a8's two routes for its integer products (oneDNN's prepacked int8 linear where it serves, torch._int_mm
elsewhere): each batch invariant on the tiny model, both computing the same logits bit for bit, and the
probe that chooses between them refusing a oneDNN op that disagrees (negative controls)."""

from __future__ import annotations

import pytest
import torch

from specgen.models import load_quantized
from specgen.models.quantized import kernels

TINY_SOURCE = dict(kind="tiny", seed=0, vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   context_length=512, init_scale=1.0)
IDS = [(7 * i + 3) % 16 for i in range(40)]


@pytest.fixture(autouse=True)
def _fresh_probe():
    """The probe's answer is cached per process; each test sees (and leaves) a fresh one."""
    kernels.onednn_problem.cache_clear()
    yield
    kernels.onednn_problem.cache_clear()


def _lm(onednn: bool, monkeypatch):
    """The tiny model on w8a8, its products on oneDNN's linear (True, whatever the probe says: the tests
    check what the probe checks) or torch._int_mm (False)."""
    monkeypatch.setattr(kernels, "onednn_problem", lambda: None if onednn else "turned off by the test")
    lm = load_quantized(TINY_SOURCE, name="target", quant="w8a8", progress=False).lm
    assert all((linear.packed is not None) == onednn for linear in lm.net.linears())
    monkeypatch.undo()
    return lm


def _needs_onednn(serving: bool = True):
    """Skip where this torch build has no oneDNN int8 linear, or (``serving``) where its probe finds it
    not exact here (on CPUs without VNNI its int8 products saturate; w8a8 then runs another route,
    tested everywhere by ``test_the_exact_route_computes_the_same_logits_as_the_probes_choice``)."""
    ops = getattr(torch.ops, "onednn", None)
    if ops is None or not hasattr(ops, "qlinear_prepack") or not hasattr(ops, "qlinear_pointwise"):
        pytest.skip(f"torch {torch.__version__} has no torch.ops.onednn.qlinear_pointwise")
    if serving and kernels.onednn_problem() is not None:
        pytest.skip(f"oneDNN's int8 linear does not serve here: {kernels.onednn_problem()}")


@pytest.mark.parametrize("onednn", [True, False])
def test_each_route_is_batch_invariant_at_widths_2_to_16(onednn, monkeypatch):
    if onednn:
        _needs_onednn()
    lm = _lm(onednn, monkeypatch)
    for width in range(2, 17):
        assert lm.verify_gap([width]) == (0.0, width)


def test_both_routes_compute_the_same_logits(monkeypatch):
    _needs_onednn()
    fast, plain = _lm(True, monkeypatch), _lm(False, monkeypatch)
    assert torch.equal(fast.forward(fast.new_cache(), IDS, keep=40), plain.forward(plain.new_cache(), IDS, keep=40))


def test_a_layer_computes_its_float_product_within_quantization_error():
    """Per-row codes with a row's largest magnitude at 127: rows of very different scales, a bias."""
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(24, 64, generator=generator), torch.randn(24, generator=generator)  # [out, in], [out]
    rows = torch.randn(6, 64, generator=generator) * torch.logspace(-4, 4, 6)[:, None]  # [6, in]
    for onednn in ([True, False] if kernels.onednn_problem() is None else [False]):  # the probe's choice, and _int_mm
        layer = kernels.QuantLinear(weight, bias, "w8a8", onednn=onednn)
        got, expected = layer(rows), torch.nn.functional.linear(rows, weight, bias)  # [6, out] each
        error = (got - expected).abs().amax(1) / expected.abs().amax(1)  # [6]
        assert float(error.max()) < 0.05 and not torch.equal(got, expected)


def test_the_probe_chooses_onednn_where_the_build_has_it_and_it_is_exact_here():
    _needs_onednn(serving=False)
    problem, layer = kernels.onednn_problem(), kernels.QuantLinear(torch.randn(8, 32), None, "w8a8")
    if problem is None:
        assert kernels.w8a8_op() == kernels.ONEDNN and layer.packed is not None
    else:  # e.g. a CPU without VNNI, where its int8 products saturate
        assert "other values than torch._int_mm" in problem and layer.packed is None
        assert kernels.w8a8_op() in ("_int_mm", kernels.EXACT_FLOAT)


def test_negative_control_a_onednn_op_whose_rows_depend_on_their_batch_is_refused(monkeypatch):
    """A oneDNN linear that adds a trace of the row count: the probe finds it, and w8a8 runs torch._int_mm."""
    _needs_onednn()
    real = torch.ops.onednn.qlinear_pointwise

    def skewed(codes, *args):
        out = real(codes, *args)  # [rows, out]
        return out + 1e-3 * (codes.shape[0] - 1)

    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise", skewed)
    kernels.onednn_problem.cache_clear()
    assert "other values than torch._int_mm" in kernels.onednn_problem()
    assert kernels.w8a8_op() in ("_int_mm", kernels.EXACT_FLOAT)
    assert kernels.QuantLinear(torch.randn(8, 32), None, "w8a8").packed is None


def test_the_exact_route_computes_the_same_logits_as_the_probes_choice(monkeypatch):
    """Where neither oneDNN's linear nor torch._int_mm is exact (CPUs without VNNI), w8a8 multiplies in
    float32 over chunks of integer-valued inputs: the same logits bit for bit as the route chosen here,
    batch invariant; forced here on every CPU."""
    chosen = load_quantized(TINY_SOURCE, name="target", quant="w8a8", progress=False).lm
    monkeypatch.setattr(kernels, "onednn_problem", lambda: "turned off by the test")
    monkeypatch.setattr(kernels, "int_mm_problem", lambda: "turned off by the test")
    try:
        exact = load_quantized(TINY_SOURCE, name="target", quant="w8a8", progress=False).lm
        assert kernels.w8a8_op() == kernels.EXACT_FLOAT and kernels.EXACT_FLOAT in exact.describe()["dtype"]
    finally:
        monkeypatch.undo()  # before the autouse fixture clears the probes' caches
    assert all(linear._float_weight is not None and linear.packed is None for linear in exact.net.linears())
    assert torch.equal(exact.forward(exact.new_cache(), IDS, keep=40), chosen.forward(chosen.new_cache(), IDS, keep=40))
    for width in (2, 7, 16):
        assert exact.verify_gap([width]) == (0.0, width)


def test_exact_products_are_the_integer_products_past_a_chunk_and_at_the_extremes():
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(-128, 128, (3, 2 * kernels.EXACT_CHUNK + 40), generator=generator, dtype=torch.int8)
    weight = torch.randint(-127, 128, (codes.shape[1], 6), generator=generator, dtype=torch.int8)  # [in, out]
    codes[0], weight[:, 0] = -128, -127  # the largest magnitudes, summed over more than one chunk
    got = kernels.exact_products(codes, weight.float())  # [3, 6] int32
    assert got.dtype == torch.int32 and torch.equal(got.long(), codes.long() @ weight.long())
    assert int(got[0, 0]) == 128 * 127 * codes.shape[1]  # past 2**24: a single float32 sum would round it


def test_int_mm_is_probed_for_exact_products_and_a_saturating_one_is_refused(monkeypatch):
    kernels.int_mm_problem.cache_clear()
    real = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: real(a, b).clamp(-2**15, 2**15 - 1))  # int16 saturation
    try:
        assert kernels.int_mm_problem() == "torch._int_mm does not compute exact integer products here"
    finally:
        monkeypatch.undo()
        kernels.int_mm_problem.cache_clear()


def test_a_torch_build_without_the_onednn_ops_runs_int_mm(monkeypatch):
    monkeypatch.setattr(torch.ops, "onednn", None)
    assert "has no torch.ops.onednn.qlinear_pointwise" in kernels.onednn_problem()
    layer = kernels.QuantLinear(torch.randn(8, 32), None, "w8a8")
    assert layer.packed is None and layer(torch.ones(3, 32)).shape == (3, 8)


def test_constant_and_one_signed_rows_are_served():
    """A row without range (span clamped, every code 0: its output is its value times the column sums)
    and a row of one sign (its own minimum to maximum, not a grid around zero) stay within rounding."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(16, 64, generator=generator)  # [out, in]
    rows = torch.stack([torch.zeros(64), torch.full((64,), 3.0), 5.0 + torch.rand(64, generator=generator)])  # [3, in]
    expected = rows @ weight.T  # [3, out]
    for onednn in ([True, False] if kernels.onednn_problem() is None else [False]):
        got = kernels.QuantLinear(weight, None, "w8a8", onednn=onednn)(rows)  # [3, out]
        assert torch.equal(got[0], torch.zeros(16)) and torch.isfinite(got).all()
        assert float((got - expected).abs().max()) < 0.01 * float(expected.abs().max())
