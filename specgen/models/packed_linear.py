"""Linear layers on oneDNN with pre-packed weights, for the few rows a decode or verify step feeds (CPU; float32, bfloat16).

:class:`PackedLinear` replaces an ``nn.Linear`` of a loaded model and keeps its
parameters (tied weights stay tied). It runs ``x @ weight.T + bias`` through
oneDNN's inner product on a copy of the weight reordered once into oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the layout
inductor's CPU freezing pass uses), which serves any small row count on every
thread; shapes are those of ``F.linear`` (``[..., in] -> [..., out]``).

Contract:

* Outputs equal ``F.linear``'s to float rounding (the same sums in another
  order), as those of any two batch shapes already do; they need not be bit-equal.
* The packed copy costs as much memory as the weights it packs, is made on a
  layer's first eligible call and made again when its weight changes in place
  or is replaced.
* bfloat16 is packed only where this CPU's oneDNN packs it
  (:func:`specgen.models.cpu.packs`: AVX-512 or AVX-NE-CONVERT). Elsewhere --
  other dtypes or devices, a dtype this CPU cannot pack, autograd, a torch
  build without oneDNN, ``packed_weights=false``, a weight of fewer than
  PACK_MIN_ELEMENTS elements -- ``F.linear`` runs.

What it changes in forward and verify costs: docs/benchmarks.md, "Verify costs and packed weights"
(``python scripts/packed_linear_bench.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from specgen.models import cpu

#: The dtypes served packed (on a CPU that packs them: :func:`packable`).
PACKED_DTYPES = (torch.float32, torch.bfloat16)
#: The row count the weights are packed for (a hint to oneDNN: every row count runs on the packed copy).
PACK_ROWS = 8
#: Smaller weights run ``F.linear``: oneDNN's packed call has a fixed cost of its own that a product this
#: small does not repay (test models' layers; a released model's smallest weight is larger).
PACK_MIN_ELEMENTS = 1 << 16


def available() -> bool:
    """Whether this torch build has oneDNN's packed linear."""
    return cpu.onednn_linear_available()


def packable(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is served packed on this CPU (decided once per process, :func:`specgen.models.cpu.packs`)."""
    return dtype in PACKED_DTYPES and cpu.packs(dtype)


_AVAILABLE = available()

class PackedWeight:
    """The oneDNN-packed copy of one weight, made on first use and again when the weight
    is replaced or changed in place."""

    __slots__ = ("packed", "key")

    def __init__(self):
        self.packed: torch.Tensor | None = None
        self.key: tuple | None = None

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if self.packed is None or self.key != key:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self.key = key
        return self.packed

    def drop(self) -> None:
        self.packed = self.key = None


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   cache: PackedWeight) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` on ``cache``'s packed copy of ``weight``, or None where that
    does not apply (not a CPU, a dtype this CPU does not pack, a weight under PACK_MIN_ELEMENTS,
    autograd needed, no oneDNN).
    x: [..., in]; weight: [out, in]."""
    if not (x.device.type == "cpu" and weight.dtype == x.dtype and x.numel() > 0
            and weight.numel() >= PACK_MIN_ELEMENTS
            and x.shape[-1] == weight.shape[-1] and _AVAILABLE and packable(x.dtype)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [rows, in]
    out = torch.ops.mkldnn._linear_pointwise(flat, cache.of(weight), bias, "none", [], "")  # [rows, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])


class PackedLinear(torch.nn.Linear):
    """An ``nn.Linear`` that runs :func:`packed_product` where it applies.

    Made by :meth:`of` from an existing layer, sharing its parameters (tied weights stay tied);
    ``enabled`` switches the packed path off for this layer."""

    enabled: bool = True
    #: Multiply one row at a time (:func:`set_rowwise`).
    rowwise: bool = False

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> PackedLinear:
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.register_parameter("bias", linear.bias)
        layer.train(linear.training)
        layer.enabled = True
        layer.packed = PackedWeight()
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rowwise and x.numel() > x.shape[-1]:  # each row as a single-token step multiplies it
            flat = x.reshape(-1, x.shape[-1])  # [rows, in]
            out = torch.cat([self._row_product(flat[i: i + 1]) for i in range(flat.shape[0])])  # [rows, out]
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return self._row_product(x)

    def _row_product(self, x: torch.Tensor) -> torch.Tensor:
        out = packed_product(x, self.weight, self.bias, self.packed) if self.enabled else None
        return F.linear(x, self.weight, self.bias) if out is None else out


def install(model: torch.nn.Module) -> int:
    """Replace every plain ``nn.Linear`` in ``model`` by a :class:`PackedLinear` sharing its
    parameters. Returns how many layers were replaced (0 without oneDNN, or on a second call)."""
    if not _AVAILABLE:
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear.of(child))
                replaced += 1
    return replaced


def set_enabled(model: torch.nn.Module, enabled: bool) -> None:
    """Switch the packed path of every :class:`PackedLinear` in ``model`` on or off; off drops the packed copies."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.enabled = bool(enabled)
            if not enabled:
                module.packed.drop()


def set_rowwise(model: torch.nn.Module, rowwise: bool) -> None:
    """Make every :class:`PackedLinear` in ``model`` multiply a feed of several rows one row at a time
    (``rowwise``), as a single-token step multiplies its row, so a row's output does not depend on the
    rows fed with it (batch invariance, at the cost of reading the weights once per row), or not."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.rowwise = bool(rowwise)


@contextmanager
def suspended(models: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Run every :class:`PackedLinear` of ``models`` on ``F.linear`` inside the block, keeping the
    packed copies (the next packed forward after it does not repack); restored on exit, also on error."""
    layers = [(m, m.enabled) for model in models for m in model.modules() if isinstance(m, PackedLinear)]
    try:
        for layer, _ in layers:
            layer.enabled = False
        yield
    finally:
        for layer, enabled in layers:
            layer.enabled = enabled


def enabled_in(model: torch.nn.Module) -> bool:
    """Whether ``model`` has a :class:`PackedLinear` with the packed path on."""
    return any(isinstance(m, PackedLinear) and m.enabled for m in model.modules())
