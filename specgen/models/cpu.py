"""What this CPU can run fast, decided once per process from the CPU itself.

Every fast path that depends on the instruction set asks here and falls back
where the answer is no; nothing else reads CPU flags:

* :func:`packs` -- whether oneDNN's packed linear (:mod:`specgen.models.packed_linear`)
  runs a dtype on this CPU. oneDNN refuses bfloat16 weight packing without
  AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; the answer comes from trying a tiny
  packed product, not from a flag list, so a torch build with other rules is
  read correctly too.
* :func:`fast_bfloat16` -- whether bfloat16 arithmetic is native here
  (AVX512-BF16 or AMX-BF16) *and* packable, the condition under which a
  bfloat16 forward beats float32's; without it bfloat16 is emulated.
* :func:`describe` -- the capability in one line, for CI logs and benchmark records.
* :func:`model_name` -- the CPU's model name, for benchmark records and the keys of
  measurements kept per machine.
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F

#: The CPU flags that decide a fast path here (reported by :func:`describe`).
FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                     "avx_ne_convert", "amx_bf16", "amx_tile", "asimd", "bf16", "sve")


@functools.cache
def flags() -> frozenset[str]:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``: x86 ``flags`` or ARM ``Features``); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def model_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what ``platform.processor()`` says (may be '')."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def torch_capability() -> str:
    """The vectorised kernel set torch picked for this CPU (``AVX2``, ``AVX512``, ``DEFAULT``, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's packed linear operators at all."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether a oneDNN-packed linear product in ``dtype`` runs on this CPU and matches ``F.linear``.

    Tried once per dtype per process on a [2, 32] x [24, 32] product; any refusal
    (``RuntimeError`` from the packing call) or a wrong result means no."""
    if not onednn_linear_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 32, generator=generator).to(dtype)  # [out, in]
    x = torch.randn(2, 32, generator=generator).to(dtype)  # [rows, in]
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # [rows, out]
            want = F.linear(x, weight)
    except RuntimeError:
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return tuple(out.shape) == (2, 24) and torch.allclose(out.float(), want.float(), rtol=tolerance, atol=tolerance)


def native_bfloat16_instructions() -> bool:
    """Whether the CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & flags())


@functools.cache
def fast_bfloat16() -> bool:
    """Whether a bfloat16 forward is the fast one on this CPU: native bfloat16 dot products
    and a packed bfloat16 linear path. False means float32 is the faster dtype here."""
    return native_bfloat16_instructions() and packs(torch.bfloat16)


def describe() -> dict:
    """This CPU's capability as plain data: machine, torch kernel set, the flags that matter,
    and what specgen's fast paths decided (packed float32 / bfloat16, fast bfloat16)."""
    present = flags()
    return {
        "machine": platform.machine(),
        "torch_capability": torch_capability(),
        "flags": [flag for flag in FLAGS_THAT_MATTER if flag in present],
        "packed_float32": packs(torch.float32),
        "packed_bfloat16": packs(torch.bfloat16),
        "fast_bfloat16": fast_bfloat16(),
    }


def summary_line() -> str:
    """:func:`describe` as one line, e.g. ``cpu: x86_64 AVX2 flags=avx2,fma packed_bfloat16=no ...``."""
    info = describe()
    yes = {True: "yes", False: "no"}
    return (f"cpu: {info['machine']} torch={info['torch_capability']} flags={','.join(info['flags']) or '-'} "
            f"packed_float32={yes[info['packed_float32']]} packed_bfloat16={yes[info['packed_bfloat16']]} "
            f"fast_bfloat16={yes[info['fast_bfloat16']]}")
