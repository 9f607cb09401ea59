"""Quantized linear layers on torch's own CPU int kernels, and the one place a kernel is chosen.

A :class:`QuantLinear` holds the weight of one ``nn.Linear`` quantized for one of
these paths (``KERNELS``) and computes ``x @ W.T (+ bias)`` for ``x`` [rows, in]
float32, returning [rows, out] float32:

* ``int8``: int8 weights with one scale per output channel,
  ``torch._weight_int8pack_mm`` on bfloat16 activations;
* ``int4``: 4-bit weights in groups of ``GROUP`` inputs with a scale and a zero
  per group and output channel (``w = (q - 8) * scale + zero``), in the int4pack
  layout, ``torch._weight_int4pack_mm_for_cpu`` on bfloat16 activations. The
  grid is each group's own minimum and maximum split in 15 steps, so a weight
  dequantised from a GGUF Q4_1 block (``d * q + m``, q from 0 to 15) maps back onto
  its own block's grid (up to the bfloat16 rounding of scale and zero);
* ``w8a8``: int8 weights with one float32 scale per output channel and 8-bit
  activations with one scale and offset per row (uint8 codes 0..255 spanning that
  row's own minimum to maximum), integer products accumulated in int32, then the
  channel's scale and the row's applied in float32 and the row's offset times the
  weight's column sums added. The products run on oneDNN's int8 linear over
  weights prepacked once at load (``torch.ops.onednn.qlinear_pointwise``) where
  :func:`onednn_problem` finds it serving, else on ``torch._int_mm`` where
  :func:`int_mm_problem` finds its products exact, else as float32 matrix products
  over chunks of :data:`EXACT_CHUNK` inputs (integer-valued, so exact in any
  summation order; slower, and its cost grows with the rows): every route computes
  the same values bit for bit. (``torch._int_mm`` saturates on CPUs without VNNI.)
  Its cost barely grows with the rows fed (the weight-only kernels' grows in
  proportion), but per-row activation scales lose outlier channels' neighbours:
  the model folds per-channel smoothing into the weights first
  (:mod:`~specgen.models.quantized.smooth`);
* ``float``: ``F.linear`` on the float32 weight: the fallback where a kernel is
  missing, fails its probe, or cannot take a layer's shape. It is not batch
  invariant (its products' summation order depends on the row count).

Batch invariance: the int kernels compute every row on its own (integer
products, per-row work, no reduction across rows), so a row's output does not
depend on how many rows are fed with it. :func:`kernel_problem` checks that
on a probe before a kernel is used; the target measures it again on the whole
model at load (``verify_gap``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: Quantized paths, by setting name (``dtype=int8`` / ``dtype=int4``), and the torch op each calls.
KERNELS = {"int8": "_weight_int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu", "w8a8": "_int_mm"}
#: Inputs per int4 group (one scale and zero each).
GROUP = 32
#: The activations' dtype the int kernels read (the CPU kernels' fast path).
ACTIVATION = torch.bfloat16
#: The oneDNN op that computes w8a8's integer products on prepacked weights, where it serves.
ONEDNN = "onednn.qlinear_pointwise"
#: w8a8's activation codes: ``round((x - rowmin) * LEVELS / (rowmax - rowmin))`` as uint8 (0..LEVELS).
LEVELS = 255
#: Inputs per float32 product of the exact route: 1024 * 128 * 127 < 2**24, so every partial sum of
#: those integer-valued products is an exact float32 integer, whatever order a matmul sums in.
EXACT_CHUNK = 1024
#: The exact route's name (where neither oneDNN's int8 linear nor ``torch._int_mm`` is exact here).
EXACT_FLOAT = "float32 matmul over exact integer chunks"


def kernel_problem(kind: str) -> str | None:
    """Why the ``kind`` kernel cannot serve here (None: it can): missing from this torch build,
    failing on a probe, disagreeing with a float reference, or rows fed together differing from
    rows fed alone. Every quantized layer of a model is built only after this returns None."""
    op = KERNELS[kind]
    if not hasattr(torch, op) or (kind == "int4" and not hasattr(torch, "_convert_weight_to_int4pack_for_cpu")):
        return f"this torch build ({torch.__version__}) has no torch.{op}"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 2 * GROUP, generator=generator)  # [out, in]
    rows = torch.randn(5, 2 * GROUP, generator=generator)  # [rows, in]
    try:
        layer = QuantLinear(weight, None, kind)
        together = layer(rows)  # [5, out]
        alone = torch.cat([layer(rows[i:i + 1]) for i in range(rows.shape[0])])
    except RuntimeError as error:
        return f"torch.{op} fails here: {str(error).splitlines()[0][:160]}"
    if layer.kind != kind:
        return f"torch.{op} cannot take a probe layer: {layer.reason}"
    reference = rows @ weight.T  # [5, out]
    if not torch.allclose(together, reference, rtol=0.1, atol=0.1 * float(reference.abs().max())):
        return f"torch.{op} disagrees with a float reference on a probe"
    if not torch.equal(together, alone):
        return f"torch.{op} computes rows fed together differently from rows fed alone"
    return None


def w8a8_op() -> str:
    """The op that computes w8a8's integer products here: :data:`ONEDNN`, ``_int_mm`` or :data:`EXACT_FLOAT`."""
    if not onednn_problem():
        return ONEDNN
    return EXACT_FLOAT if int_mm_problem() else "_int_mm"


@functools.cache
def int_mm_problem() -> str | None:
    """Why w8a8's products do not run on ``torch._int_mm`` here (None: they do): missing, failing, or
    not the exact integer products on a probe of full-range codes (it saturates intermediate sums on
    CPUs without VNNI). Probed once per process."""
    if not hasattr(torch, "_int_mm"):
        return f"this torch build ({torch.__version__}) has no torch._int_mm"
    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(-128, 128, (5, 64), generator=generator, dtype=torch.int8)  # [rows, in]
    weight = torch.randint(-127, 128, (64, 24), generator=generator, dtype=torch.int8)  # [in, out]
    codes[0], weight[:, 0] = -128, -127  # the extremes, where pairs of products overflow int16
    try:
        out = torch._int_mm(codes, weight)  # [5, 24] int32
    except RuntimeError as error:
        return f"torch._int_mm fails here: {str(error).splitlines()[0][:160]}"
    if not torch.equal(out.long(), codes.long() @ weight.long()):
        return "torch._int_mm does not compute exact integer products here"
    return None


def exact_products(codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """codes [rows, in] int8, weight [in, out] float32 holding int8 values -> [rows, out] int32, the exact
    integer products: float32 matmuls over chunks of :data:`EXACT_CHUNK` inputs, each exact (see there)."""
    out = None
    for start in range(0, codes.shape[1], EXACT_CHUNK):
        part = (codes[:, start:start + EXACT_CHUNK].float() @ weight[start:start + EXACT_CHUNK]).to(torch.int32)
        out = part if out is None else out.add_(part)
    return out


@functools.cache
def onednn_problem() -> str | None:
    """Why w8a8 layers do not run :data:`ONEDNN` (None: they do): the ops missing from this torch
    build, failing on a probe, or computing other values than the integer route (``torch._int_mm``,
    or the exact float32 route where that is not exact) bit for bit, rows fed together or alone.
    Probed once per process."""
    ops = getattr(torch.ops, "onednn", None)
    if ops is None or not all(hasattr(ops, name) for name in ("qlinear_prepack", "qlinear_pointwise")):
        return f"this torch build ({torch.__version__}) has no torch.ops.{ONEDNN}"
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 96, generator=generator)  # [out, in]
    bias = torch.randn(40, generator=generator)  # [out]
    rows = torch.randn(19, 96, generator=generator) * torch.logspace(-3, 3, 19)[:, None]  # [rows, in]
    try:
        fast, plain = QuantLinear(weight, bias, "w8a8", onednn=True), QuantLinear(weight, bias, "w8a8", onednn=False)
        together = fast(rows)  # [19, out]
        alone = torch.cat([fast(rows[i:i + 1]) for i in range(rows.shape[0])])
        reference = plain(rows)  # [19, out]
    except RuntimeError as error:
        return f"torch.ops.{ONEDNN} fails here: {str(error).splitlines()[0][:160]}"
    if not torch.equal(together, reference) or not torch.equal(alone, reference):
        return f"torch.ops.{ONEDNN} computes other values than torch._int_mm on a probe"
    return None


def _shape_problem(kind: str, out_features: int, in_features: int) -> str | None:
    """Why the ``kind`` kernel cannot take an [out, in] weight (None: it can)."""
    if kind == "int4" and (in_features % GROUP or out_features % 8):
        return f"int4 needs in % {GROUP} == 0 and out % 8 == 0, this layer is [{out_features}, {in_features}]"
    return None


class QuantLinear:
    """``x @ weight.T + bias`` on a quantized copy of ``weight`` (see the module docstring).

    weight: [out, in] float; bias: [out] or None (added in float32); kind: one of KERNELS or
    ``float``. A layer whose shape the kernel cannot take runs ``float``; ``kind`` says what runs
    and ``reason`` why it is not the kind asked for (None when it is). onednn (w8a8 only): whether
    the products run on :data:`ONEDNN` (prepacked weights, ``packed``) or the integer route
    (``torch._int_mm``, or :func:`exact_products` where :func:`int_mm_problem` finds it inexact);
    None: oneDNN's where :func:`onednn_problem` finds it serving.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, onednn: bool | None = None):
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float()  # [out]
        self.reason = _shape_problem(kind, *weight.shape) if kind != "float" else None
        self.kind = "float" if self.reason else kind
        if self.kind == "int8":
            self.weight, self.scales = quantize_int8(weight)
        elif self.kind == "int4":
            self.weight, self.scales = quantize_int4(weight)
        elif self.kind == "w8a8":
            self.weight, self.scales = quantize_w8a8(weight)
            sums = self.weight.sum(0, dtype=torch.int32)  # [out]: each channel's codes summed over its inputs
            self._column_sums = sums.float() * self.scales * LEVELS  # [out]: of the dequantized weight
            self._code_offsets = 128 * sums  # [out] int32: _int_mm reads codes shifted to int8 (code - 128)
        else:
            self.weight, self.scales = weight, None
        self.packed = None  # [in, out] int8, oneDNN's layout (w8a8 on oneDNN only)
        self._float_weight = None  # [in, out] float32 holding the int8 codes (w8a8's exact route only)
        if self.kind == "w8a8" and (onednn if onednn is not None else onednn_problem() is None):
            self.packed = torch.ops.onednn.qlinear_prepack(self.weight.T.contiguous(), None)
            self.weight = None
            self._zero_points = torch.zeros(self.out_features, dtype=torch.long)  # [out]
        elif self.kind == "w8a8" and int_mm_problem() is not None:
            self._float_weight, self.weight = self.weight.float(), None

    @property
    def memory_bytes(self) -> int:
        tensors = [t for t in (self.weight, self.packed, self._float_weight, self.scales, self.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] float32 -> [rows, out] float32."""
        return self.native(x).float()

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] float32 -> [rows, out] as the kernel returns it: bfloat16 from a weight-only
        int kernel without a bias (exactly representable in float32, so a consumer that promotes, e.g.
        ``float32 + bfloat16``, computes what it would on ``__call__``'s output), float32 otherwise."""
        if self.kind == "w8a8":
            return self._w8a8(x)
        if self.kind == "int8":
            out = torch._weight_int8pack_mm(x.to(ACTIVATION), self.weight, self.scales)
        elif self.kind == "int4":
            out = torch._weight_int4pack_mm_for_cpu(x.to(ACTIVATION), self.weight, GROUP, self.scales)
        else:
            return F.linear(x, self.weight, self.bias)
        return out if self.bias is None else out + self.bias

    def _w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] float32 -> [rows, out] float32, each row on its own scale and offset, in few
        ops (each costs a fixed overhead at one row): with ``low``/``span`` a row's minimum and range,
        codes ``trunc((x - low) * LEVELS / span + 0.5)`` (round half up, 0..LEVELS), then
        ``int32 products * channel scale * span + low * column sums (+ bias)`` in float32."""
        low, high = torch.aminmax(x, dim=1, keepdim=True)  # [rows, 1] each
        span = high.sub_(low).clamp_min_(1e-30)  # [rows, 1]
        codes = torch.addcmul(_HALF, x - low, span.reciprocal(), value=LEVELS).to(torch.uint8)  # [rows, in]
        if self.packed is not None:
            out = torch.ops.onednn.qlinear_pointwise(codes, 1.0, 0, self.packed, self.scales,
                                                     self._zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        else:
            signed = codes.bitwise_xor_(0x80).view(torch.int8)  # code - 128
            products = (exact_products(signed, self._float_weight) if self._float_weight is not None
                        else torch._int_mm(signed, self.weight))  # [rows, out] int32
            out = products.add_(self._code_offsets).float().mul_(self.scales)  # [rows, out]
        base = low * self._column_sums if self.bias is None else torch.addcmul(self.bias, low, self._column_sums)
        return torch.addcmul(base, out, span)  # [rows, out]


#: Truncating ``(x - low) * LEVELS / span + _HALF`` (at least 0) to uint8 rounds half up.
_HALF = torch.tensor(0.5)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [out, in], bfloat16 scales [out]): symmetric, per output channel,
    rounded against the bfloat16 scale the kernel multiplies by."""
    scales = (weight.abs().amax(1).clamp_min(1e-30) / 127).to(ACTIVATION)  # [out]
    quantized = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.contiguous(), scales


def quantize_w8a8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int8 [in, out], the layout ``torch._int_mm`` reads; float32 scales [out]):
    symmetric, per output channel; the scales include the activations' 1 / LEVELS (a row's scale is
    then its range)."""
    scales = weight.abs().amax(1).clamp_min(1e-30) / 127  # [out]
    quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return quantized.T.contiguous(), scales / LEVELS


def int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float -> (codes [out, in] int32 in 0..15, scales [out, in / GROUP], minima [out, in / GROUP]):
    each group of GROUP inputs on its own minimum-to-maximum range in 15 steps, ``w ~ code * scale + minimum``.
    A group of a GGUF Q4_1 block's values (``d * q + m`` with q from 0 to 15, both ends present, as the
    block's own min and max put them) gives back its q, d and m."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // GROUP, GROUP)  # [out, G, GROUP]
    low, high = groups.amin(-1), groups.amax(-1)  # [out, G]
    scales = ((high - low) / 15).clamp_min(1e-30)  # [out, G]
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)  # [out, G, GROUP]
    return codes.reshape(out_features, in_features).to(torch.int32), scales, low


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (int4pack [out, in / 2] uint8, bfloat16 scales and zeros [in / GROUP, out, 2]):
    :func:`int4_grid`, stored as the kernel computes it, ``(code - 8) * scale + zero``."""
    codes, scales, low = int4_grid(weight)
    zeros = low + 8 * scales  # (code - 8) * scale + zero == code * scale + low
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)  # [out, in / 2] uint8
    scales_zeros = torch.stack([scales.T, zeros.T], dim=-1).to(ACTIVATION).contiguous()  # [G, out, 2]
    return packed, scales_zeros
