"""specgen.models.cpu: fast paths are decided from what this CPU runs, and every one falls back where it does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

import specgen
from specgen import models
from specgen.models import cpu, packed_linear
from specgen.models.packed_linear import PackedLinear


@pytest.fixture
def no_packed_bfloat16(monkeypatch):
    """This CPU as an AVX2-only one: oneDNN refuses to pack bfloat16 weights."""
    monkeypatch.setattr(cpu, "packs", lambda dtype: dtype == torch.float32 and cpu.onednn_linear_available())
    monkeypatch.setattr(cpu, "fast_bfloat16", lambda: False)


def test_describe_reports_the_capability_and_the_decisions():
    info = cpu.describe()
    assert set(info) == {"machine", "torch_capability", "flags", "packed_float32", "packed_bfloat16", "fast_bfloat16"}
    assert all(flag in cpu.FLAGS_THAT_MATTER for flag in info["flags"])
    assert info["fast_bfloat16"] <= info["packed_bfloat16"]  # fast bfloat16 needs the packed path
    line = cpu.summary_line()
    assert line.startswith("cpu: ") and f"torch={info['torch_capability']}" in line


def test_a_refused_packing_call_means_no(monkeypatch):
    """The probe catches oneDNN's refusal (what AVX2-only CPUs raise for bfloat16) instead of passing it on."""
    if not cpu.onednn_linear_available():
        pytest.skip("this torch build has no oneDNN")

    def refuse(weight, rows):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw")

    probe = cpu.packs.__wrapped__  # the uncached probe
    assert probe(torch.float32) is True
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    assert probe(torch.float32) is False and probe(torch.bfloat16) is False


def test_a_wrong_packed_result_means_no(monkeypatch):
    if not cpu.onednn_linear_available():
        pytest.skip("this torch build has no oneDNN")
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: real(*args) + 1.0)
    assert cpu.packs.__wrapped__(torch.float32) is False


def test_without_packed_bfloat16_a_layer_runs_linear(no_packed_bfloat16, monkeypatch):
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)  # not the size gate: the CPU's
    layer = PackedLinear.of(torch.nn.Linear(64, 50).to(torch.bfloat16))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert layer.packed.packed is None
    assert not packed_linear.packable(torch.bfloat16)


@pytest.mark.skipif(not packed_linear.packable(torch.bfloat16), reason="this CPU cannot pack bfloat16 weights")
def test_where_the_cpu_packs_bfloat16_a_layer_is_packed(monkeypatch):
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    layer = PackedLinear.of(torch.nn.Linear(64, 50).to(torch.bfloat16))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        out = layer(x)
    assert layer.packed.packed is not None
    assert torch.allclose(out.float(), F.linear(x, layer.weight, layer.bias).float(), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("drafter", ["drafter=ngram", "drafter=tiny"])
def test_bfloat16_runs_and_declares_approximate_without_packed_bfloat16(no_packed_bfloat16, drafter, monkeypatch):
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)  # the tiny model's layers, as a released model's
    pipe = specgen.pipeline(*TINY, drafter, "dtype=bfloat16", progress=False)
    out = pipe.generate("12 13 14 12 13 14", max_new_tokens=8)
    assert str(out.guarantee).startswith("approximate: bfloat16") and out.token_ids
    layers = [m for m in pipe.target.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.packed.packed is None for m in layers)  # every product ran on linear


def test_drafter_dtype_auto_keeps_float32_where_bfloat16_is_slow(no_packed_bfloat16):
    assert models.resolve_drafter_dtype("auto", torch.float32, torch.device("cpu")) == torch.float32
