"""specgen.models.small_rows: the weight-major product for few rows is linear's product, and where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specgen.models import small_rows
from specgen.models.small_rows import SmallRowsLinear, weight_major
from specgen.models.tiny import build_tiny_model


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The weight-major product written out: rows padded by repeating row 0 to 2 (from 1) or 4 (from 3)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    width = {1: 2, 3: 4}.get(rows, rows)
    padded = torch.cat([flat] + [flat[:1]] * (width - rows))
    out = torch.mm(weight, padded.t()).t()[:rows]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 8, 9, 17])
def test_same_product_and_the_path_by_row_count(rows, bias):
    generator = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(64, 300, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(300, 64, generator=generator))
        if bias:
            layer.bias.copy_(torch.randn(300, generator=generator))
    fast = SmallRowsLinear.of(layer, small_rows.LAYER_MAX_ROWS)
    x = torch.randn(1, rows, 64, generator=generator)  # [batch, rows, in], as a decoder layer sees it
    with torch.inference_mode():
        out = fast(x)
        expected = layer(x)
        assert out.shape == expected.shape == (1, rows, 300)
        assert out.is_contiguous()
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-4)
        if rows <= small_rows.LAYER_MAX_ROWS:
            assert torch.equal(out, _reference(x, layer.weight, layer.bias))
        else:
            assert torch.equal(out, expected)


def test_head_limit_and_other_dtypes_keep_linear():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=generator)
    with torch.inference_mode():
        eight = torch.randn(8, 16, generator=generator)
        assert torch.equal(weight_major(eight, weight, None, small_rows.HEAD_MAX_ROWS), _reference(eight, weight, None))
        assert weight_major(eight, weight, None, small_rows.LAYER_MAX_ROWS) is None
        assert weight_major(eight[:0], weight, None, small_rows.HEAD_MAX_ROWS) is None
        half = SmallRowsLinear.of(torch.nn.Linear(16, 50, bias=False).to(torch.bfloat16), small_rows.LAYER_MAX_ROWS)
        x = torch.randn(3, 16, generator=generator).to(torch.bfloat16)
        assert torch.equal(half(x), F.linear(x, half.weight))


def test_install_replaces_every_linear_and_keeps_ties():
    model = build_tiny_model(seed=0, vocab_size=40)
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as SmolLM2's are
    ids = torch.tensor([[1, 5, 7]])
    with torch.inference_mode():
        before = model(ids).logits  # [1, 3, vocab]
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert small_rows.install(model) == linears > 0
    assert small_rows.install(model) == 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.get_output_embeddings().max_rows == small_rows.HEAD_MAX_ROWS
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.inference_mode():
        after = model(ids).logits
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-5)
