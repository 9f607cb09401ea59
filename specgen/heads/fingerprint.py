"""The target fingerprint that binds a head to the exact target it was trained on.

:func:`target_fingerprint` describes a loaded target; :func:`fingerprint_mismatch`
compares a head's stored fingerprint with it, and :func:`refuse_other_target`
refuses a head trained for another target with one line naming what differs.
"""

from __future__ import annotations

import hashlib
import pathlib
from collections.abc import Mapping

import torch
from safetensors import safe_open

from specgen.errors import ModelLoadError

_SAMPLES_PER_TENSOR = 4096  # legacy hash: values per tensor
_PROBES_PER_TENSOR = 8  # probe: float32 values per tensor, compared with a tolerance
#: Probe tolerance: two roundings of the same source value to bfloat16 (2^-9 relative each) or
#: float16 (2^-12) differ by < 2^-8 relative; float16 flushes values below ~3e-8 to 0.
_PROBE_RTOL = 2.0**-7
_PROBE_ATOL = 1e-6
_SHAPE_KEYS = ("architecture", "hidden_size", "num_layers", "vocab_size")


def _legacy_hash(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 of names, shapes and a strided sample rounded to bfloat16 (the v1 fingerprint)."""
    digest = hashlib.sha256()
    for name, param in sorted(state.items()):
        flat = param.detach().reshape(-1)
        stride = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::stride].to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes()
        digest.update(f"{name}:{tuple(param.shape)}".encode())
        digest.update(sample)
    return digest.hexdigest()


def _probe(state: Mapping[str, torch.Tensor]) -> tuple[str, list[float]]:
    """(sha256 of names and shapes, float32 values at fixed strided positions of every tensor)."""
    digest = hashlib.sha256()
    values: list[torch.Tensor] = []
    for name, param in sorted(state.items()):
        flat = param.detach().reshape(-1)
        stride = max(1, flat.numel() // _PROBES_PER_TENSOR)
        values.append(flat[::stride][:_PROBES_PER_TENSOR].to("cpu", torch.float32))
        digest.update(f"{name}:{tuple(param.shape)};".encode())
    return digest.hexdigest(), torch.cat(values).tolist() if values else []


def target_fingerprint(model: torch.nn.Module) -> dict:
    """Architecture plus two fingerprints of the target's weights.

    * ``weights_probe`` (with ``shapes_sha256``): float32 values at fixed
      positions of every parameter, compared within the rounding of bfloat16 and
      float16, so loads of one checkpoint in any dtype agree (a head trained at
      ``train.dtype=float16`` loads at float32 and back) while a retrained or
      fine-tuned target differs in many probes by far more.
    * ``weights_sha256``: the v1 fingerprint (a hash of ~4096 values per
      parameter rounded to bfloat16), kept so heads written before the probe
      existed -- the shipped ones -- still load; it matches float32 and bfloat16
      loads, and float16 loads through :func:`_source_legacy_hash`.
    """
    cfg = model.config
    state = model.state_dict()
    shapes, probe = _probe(state)
    return {
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "hidden_size": int(cfg.hidden_size),
        "num_layers": int(cfg.num_hidden_layers),
        "vocab_size": int(cfg.vocab_size),
        "weights_sha256": _legacy_hash(state),
        "shapes_sha256": shapes,
        "weights_probe": probe,
    }


def _source_legacy_hash(model: torch.nn.Module) -> str | None:
    """The v1 hash of the weights as stored in the model's safetensors directory
    (``config._name_or_path``), not as loaded; None when there is no such source.

    A float16 load rounds a float32 source twice on the way to the v1 hash's
    bfloat16, which can differ from rounding once; the source cannot."""
    folder = pathlib.Path(str(getattr(model.config, "_name_or_path", "") or ""))
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            stored.update({name: f.get_tensor(name) for name in f.keys()})
    state = model.state_dict()
    by_storage = {}
    for name, value in state.items():
        if name in stored:
            by_storage.setdefault(value.data_ptr(), stored[name])
    source = {}
    for name, value in state.items():
        tensor = stored.get(name, by_storage.get(value.data_ptr()))  # tied weights are stored once
        if tensor is None or tuple(tensor.shape) != tuple(value.shape):
            return None
        source[name] = tensor
    return _legacy_hash(source)


def fingerprint_mismatch(expected: Mapping, actual: Mapping, target: torch.nn.Module | None = None) -> list[str]:
    """Keys in which a head's stored fingerprint and the loaded target's differ ([] = the same target).

    A stored ``weights_probe`` is compared within the dtype tolerance; a v1
    fingerprint (no probe) by its ``weights_sha256``, falling back to the hash
    of the target's source files when ``target`` is given."""
    differing = [k for k in _SHAPE_KEYS if expected.get(k) != actual.get(k)]
    if "weights_probe" in expected:
        if expected.get("shapes_sha256") != actual.get("shapes_sha256"):
            return [*differing, "shapes_sha256"]
        stored = torch.tensor(expected["weights_probe"], dtype=torch.float64)  # [P]
        loaded = torch.tensor(actual["weights_probe"], dtype=torch.float64)  # [P]
        if stored.shape != loaded.shape:
            return [*differing, "weights_probe"]
        finite = torch.isfinite(stored) & torch.isfinite(loaded)
        close = (stored - loaded).abs() <= _PROBE_RTOL * torch.maximum(stored.abs(), loaded.abs()) + _PROBE_ATOL
        same = torch.where(finite, close, stored == loaded)
        return differing if bool(same.all()) else [*differing, "weights_probe"]
    if expected.get("weights_sha256") == actual.get("weights_sha256"):
        return differing
    if target is not None and not differing and _source_legacy_hash(target) == expected.get("weights_sha256"):
        return differing
    return [*differing, "weights_sha256"]


def refuse_other_target(path, kind: str, expected: Mapping, target: torch.nn.Module) -> None:
    """ModelLoadError (one line) when the stored fingerprint ``expected`` is not the loaded target's."""
    actual = target_fingerprint(target)
    differing = fingerprint_mismatch(expected, actual, target)
    if differing:
        raise ModelLoadError(
            f"the {kind} head {path} was trained for a different target "
            f"({expected.get('architecture')}, weights {str(expected.get('weights_sha256'))[:12]}) than the one "
            f"loaded ({actual['architecture']}, weights {actual['weights_sha256'][:12]}); differs in "
            f"{', '.join(differing)}. A head only drafts well for the exact weights it was trained on: "
            "train one for this target with specgen-train")
