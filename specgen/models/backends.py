"""Which target backend a run uses (``backend=torch | llama_cpp | auto``), decided before loading.

``llama_cpp`` serves GGUF files (and the tiny models, written as GGUF) on a CPU
with chain drafters (prompt lookup, a draft model); what it cannot serve is
refused here, with the way that works. ``auto`` picks ``llama_cpp`` for a GGUF
target on a CPU whenever llama-cpp-python is installed and the run is one it
serves, else ``torch``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specgen.errors import ConfigError
from specgen.models.target import BackendName

BACKENDS = ("torch", "llama_cpp", "auto")
#: Source kinds llama.cpp reads (tiny models are written as GGUF for it).
GGUF_KINDS = ("gguf", "package_gguf", "package_parts")
#: Source kinds the llama.cpp backend loads.
LLAMA_KINDS = (*GGUF_KINDS, "tiny")
#: Drafters that need a tree forward or the target's hidden states.
FEATURE_DRAFTERS = ("eagle", "medusa", "mtp", "dspark")


def _target_kind(cfg: Mapping) -> str:
    return str(((cfg.get("target") or {}).get("source") or {}).get("kind"))


def _unserved(cfg: Mapping, device: torch.device) -> str | None:
    """Why llama.cpp cannot serve this run (None: it can)."""
    kind = _target_kind(cfg)
    if kind not in LLAMA_KINDS:
        return f"it reads GGUF files and target.source.kind is {kind!r}"
    if device.type != "cpu":
        return f"it runs on the CPU and device is {device}"
    drafter = str((cfg.get("drafter") or {}).get("kind"))
    if drafter in FEATURE_DRAFTERS and cfg.get("speculative", True):
        return f"drafter={drafter} needs the target's hidden states and tree forwards"
    if cfg.get("compile"):
        return "compile=true compiles a torch model"
    if str(cfg.get("dtype", "auto")) not in ("auto", "float32", "fp32"):
        return f"dtype={cfg.get('dtype')} is a torch dtype (a GGUF keeps its own weight types)"
    return None


def choose_backend(cfg: Mapping, device: torch.device) -> BackendName:
    """The backend of a checked run config on ``device``; ConfigError for a backend that
    cannot serve it, naming why and what works."""
    name = str(cfg.get("backend", "torch"))
    if name not in BACKENDS:
        raise ConfigError(f"backend={name!r} is not one of {', '.join(BACKENDS)}")
    if name == "torch":
        return "torch"
    from specgen.models import llama_cpp

    why = _unserved(cfg, device)
    if name == "auto":
        gguf = _target_kind(cfg) in GGUF_KINDS
        return "llama_cpp" if gguf and why is None and llama_cpp.available() else "torch"
    if why is not None:
        raise ConfigError(f"backend=llama_cpp cannot serve this run: {why}; use backend=torch")
    if not llama_cpp.available():
        raise ConfigError("backend=llama_cpp needs llama-cpp-python (scripts/install.sh installs it); "
                          "or use backend=torch")
    return "llama_cpp"


def auto_note(cfg: Mapping, device: torch.device, backend: BackendName) -> str:
    """Why ``backend=auto`` moved a GGUF target that llama.cpp would run off llama.cpp (another numerical
    path than a plain run's): ``"; backend=auto chose torch: <why>"``, or "" where it did not."""
    if str(cfg.get("backend", "torch")) != "auto" or backend != "torch" or _target_kind(cfg) not in GGUF_KINDS:
        return ""
    why = _unserved(cfg, device)
    if why is None or device.type != "cpu":
        return ""
    if reads_features(cfg) and str(cfg.get("dtype", "auto")) in ("auto", "float32", "fp32"):
        why += ", which llama.cpp does not serve; dtype=int4 (or int8, w8a8) serves it on a quantized path"
    return f"; backend=auto chose torch: {why}"


def quantized_dtype(cfg: Mapping, device: torch.device) -> str | None:
    """The quantized path a checked run config asks for with ``dtype`` (``int8``/``int4``/``w8a8``, served by
    :mod:`specgen.models.quantized` on backend=torch), or None for a float dtype; ConfigError,
    before loading, for a run that path cannot serve, naming why and what works."""
    from specgen.models.quantized import QUANT_DTYPES

    name = str(cfg.get("dtype", "auto"))
    if name not in QUANT_DTYPES:
        return None
    if device.type != "cpu":
        raise ConfigError(f"dtype={name} runs torch's CPU int kernels and device is {device}; use device=cpu")
    if cfg.get("compile"):
        raise ConfigError(f"compile=true compiles the transformers model; dtype={name} runs its own eager "
                          "forward, so set compile=false")
    return name


def reads_features(cfg: Mapping) -> bool:
    """Whether a checked run config's drafter reads the target's hidden states (a learned head)."""
    return str((cfg.get("drafter") or {}).get("kind")) in FEATURE_DRAFTERS and bool(cfg.get("speculative", True))


def loads_on_llama_cpp(backend: BackendName, source: Mapping) -> bool:
    """Whether the model ``source`` describes loads on llama.cpp in a run on ``backend``
    (:func:`choose_backend`'s): the target and every draft model it reads (:func:`draft_backend`)."""
    return backend == "llama_cpp" and draft_backend(source) == "llama_cpp"


def draft_backend(source: Mapping) -> BackendName:
    """Where a draft model runs beside a llama.cpp target: on llama.cpp too when its source is
    one llama.cpp reads, else on torch (q is whatever the draft model computes either way)."""
    return "llama_cpp" if str(source.get("kind")) in LLAMA_KINDS else "torch"
