"""The quantized torch path: Llama-family models on torch's own int CPU kernels (``dtype=int8`` / ``int4`` / ``w8a8``).

* :mod:`~specgen.models.quantized.kernels` -- :class:`QuantLinear` and the kernel probes;
* :mod:`~specgen.models.quantized.model` -- the lean forward and its KV buffers;
* :mod:`~specgen.models.quantized.target` -- :class:`QuantizedLM`, the target.

:func:`choose_kernels` is the one place a setting becomes the kernels that run.
"""

from __future__ import annotations

from specgen.models.quantized.kernels import KERNELS, kernel_problem
from specgen.models.quantized.model import architecture_problem
from specgen.models.quantized.smooth import CALIBRATION_TEXT, calibrate
from specgen.models.quantized.target import QuantizedLM

__all__ = ["CALIBRATION_TEXT", "QUANT_DTYPES", "QuantizedLM", "architecture_problem", "calibrate", "choose_kernels"]

#: The ``dtype`` settings served by this path.
QUANT_DTYPES = tuple(KERNELS)


def choose_kernels(dtype: str) -> tuple[str, str, str | None]:
    """``dtype`` (one of QUANT_DTYPES) -> (the decoder layers' kernel, the LM head's, why the
    kernel asked for does not run (None: it does)).

    The LM head is int8 under ``int4`` too: a GGUF stores the (often tied) token embedding in
    8 bits or more, and 4-bit logits lose more than the head's share of the step saves. A kernel
    this torch build lacks, or that fails its probe (:func:`kernel_problem`), leaves ``float``
    (``F.linear``) in its place, with the reason. ``w8a8`` runs every linear, the LM head too, on
    int8 activations; its loader folds calibrated smoothing into the weights
    (:mod:`~specgen.models.quantized.smooth`)."""
    problem = kernel_problem(dtype)
    if problem is not None:
        return "float", "float", problem
    if dtype == "w8a8":
        return "w8a8", "w8a8", None
    if dtype == "int4" and kernel_problem("int8") is None:
        return "int4", "int8", None
    return dtype, dtype, None
