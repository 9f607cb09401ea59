"""The LM head's weight-major path (specgen.models.causal_lm.lm_head): where it applies, and that it is the same product."""

from __future__ import annotations

import pytest
import torch

from specgen.models.causal_lm import WEIGHT_MAJOR_ROWS, lm_head


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 17])
def test_same_logits_and_the_path_by_row_count(rows):
    generator = torch.Generator().manual_seed(rows)
    head = torch.nn.Linear(64, 1000, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1000, 64, generator=generator))
    hidden = torch.randn(rows, 64, generator=generator)  # [rows, d]
    with torch.inference_mode():
        out = lm_head(head, hidden)  # [rows, vocab]
        assert out.shape == (rows, 1000)
        assert torch.allclose(out, head(hidden), rtol=1e-5, atol=1e-4)
        assert torch.equal(out.argmax(-1), head(hidden).argmax(-1))
        expected = torch.mm(head.weight, hidden.t()).t() if rows in WEIGHT_MAJOR_ROWS else head(hidden)
        assert torch.equal(out, expected)


def test_other_dtypes_and_heads_keep_linear():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 16, generator=generator)
    with torch.inference_mode():
        half = torch.nn.Linear(16, 50, bias=False).to(torch.bfloat16)
        assert torch.equal(lm_head(half, hidden.to(torch.bfloat16)), half(hidden.to(torch.bfloat16)))
        biased = torch.nn.Linear(16, 50, bias=True)
        assert torch.equal(lm_head(biased, hidden), biased(hidden))
