"""Linear layers that stay cheap for the few rows a decode or verify step feeds, on a CPU in float32.

A decode step multiplies every weight matrix by 1 row; verifying a draft, by 2-8.
PyTorch's CPU ``linear`` serves 1 row with a matrix-vector kernel that runs on one
thread and reads the weights at well under the memory's bandwidth, and 2-8 rows
with a general kernel that is 1.3-2x slower again. The same product taken
weight-major, ``(weight @ rows^T)^T``, with 1 row fed twice and 3 rows padded to 4
(the kernel has fast paths for 2 and 4 columns), streams each weight once for all
rows and uses every thread. Measured on SmolLM2-135M, a whole forward of n new
tokens after a 192-token context, relative to a 1-token forward through ``linear``
everywhere (this project's 2-core AMD EPYC, AVX-512;
``python scripts/small_rows_bench.py --threads 1``, then ``--threads 2``):

=========  ====  ====  ====  ====  ====  ====
threads     n=1   n=2   n=3   n=4   n=5   n=8
=========  ====  ====  ====  ====  ====  ====
1, linear  1.00  1.58  1.97  1.54  1.76  1.82
1, here    0.92  0.96  1.10  1.11  1.52  1.83
2, linear  1.00  1.59  1.97  1.55  1.38  1.47
2, here    0.62  0.65  0.71  0.71  0.93  1.35
=========  ====  ====  ====  ====  ====  ====

Past ``max_rows`` (5 in a decoder layer, 8 for an LM head, whose vocabulary-wide
weight favours this longer) ``linear`` is as fast or faster and is used. The
products are the same sums in another order: outputs differ from ``linear``'s by
float32 rounding, as those of any two batch shapes already do. Other dtypes and
devices keep ``linear`` (bfloat16 on a CPU and every CUDA dtype have efficient
small-row kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Most rows served weight-major in a decoder layer / in an LM head.
LAYER_MAX_ROWS = 5
HEAD_MAX_ROWS = 8
#: Row counts fed to the kernel padded to more rows (pad rows repeat row 0 and are dropped).
_PADDED = {1: 2, 3: 4}


def weight_major(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` taken weight-major, or None where ``linear`` should be used.

    x: [..., in]; weight: [out, in]; bias: [out] or None. Returns [..., out], contiguous.
    """
    if x.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != torch.float32:
        return None
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= max_rows:
        return None
    flat = x.reshape(rows, x.shape[-1])  # [rows, in]
    width = _PADDED.get(rows, rows)
    if width > rows:
        flat = torch.cat([flat, flat[:1].expand(width - rows, -1)])  # [width, in]
    else:
        flat = flat.contiguous()
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # [out, width] -> [rows, out]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class SmallRowsLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose forward goes through :func:`weight_major` when that applies.

    Made by :meth:`of` from an existing layer, sharing its parameters (tied weights stay tied)."""

    max_rows: int = LAYER_MAX_ROWS

    @classmethod
    def of(cls, linear: torch.nn.Linear, max_rows: int) -> SmallRowsLinear:
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.register_parameter("bias", linear.bias)
        layer.max_rows = int(max_rows)
        layer.train(linear.training)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = weight_major(x, self.weight, self.bias, self.max_rows)
        return F.linear(x, self.weight, self.bias) if out is None else out


def install(model: torch.nn.Module) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` by a :class:`SmallRowsLinear` sharing its
    parameters (the output embedding with ``HEAD_MAX_ROWS``, the rest with ``LAYER_MAX_ROWS``).
    Returns how many layers were replaced; a second call replaces none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                rows = HEAD_MAX_ROWS if child is head else LAYER_MAX_ROWS
                setattr(parent, name, SmallRowsLinear.of(child, rows))
                replaced += 1
    return replaced
