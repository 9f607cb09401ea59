"""Head files: safetensors with metadata, and the target fingerprint that binds
a head to the exact target it was trained on.

Metadata keys (all strings): ``specgen.kind``, ``specgen.config`` (HeadConfig
JSON), ``specgen.fingerprint`` (JSON), ``specgen.command``, ``specgen.seed``,
``specgen.data``, and free-form ``specgen.train`` (JSON: loss, steps, metrics).
Loading a head whose fingerprint differs from the loaded target's is refused.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from collections.abc import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specgen.errors import ModelLoadError
from specgen.heads.modules import DraftHead, HeadConfig, build_head
from specgen.models import packed_linear

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


def save_head(path: str | pathlib.Path, head: DraftHead, fingerprint: Mapping, *, command: str = "", seed: int = 0,
              data: str = "", train: Mapping | None = None, dtype: torch.dtype = torch.bfloat16) -> pathlib.Path:
    """Write ``head`` (its own parameters and vocab_ids, not the borrowed target tensors)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, value in head.state_dict().items():
        value = value.detach().cpu()
        tensors[name] = value.to(dtype) if value.is_floating_point() else value.contiguous()
    metadata = {
        "specgen.kind": head.cfg.kind,
        "specgen.config": head.cfg.to_json(),
        "specgen.fingerprint": json.dumps(dict(fingerprint), sort_keys=True),
        "specgen.command": command,
        "specgen.seed": str(seed),
        "specgen.data": data,
        "specgen.train": json.dumps(dict(train or {}), sort_keys=True),
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    tmp.replace(path)
    return path


def read_metadata(path: str | pathlib.Path) -> dict[str, str]:
    path = pathlib.Path(path)
    if not path.is_file():
        raise ModelLoadError(f"draft head file {path} does not exist; train one with specgen-train "
                             "or point drafter.head_file= at an existing .safetensors file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"{path} is not a readable safetensors head file: {exc}") from exc


def load_head(path: str | pathlib.Path, target: torch.nn.Module, *, kind: str | tuple[str, ...] | None = None,
              device: torch.device | None = None, dtype: torch.dtype = torch.float32,
              check_fingerprint: bool = True) -> tuple[DraftHead, dict[str, str]]:
    """Load a head for ``target`` (a transformers causal LM); refuse one trained for another target.

    A directory is a vLLM/SGLang EAGLE-3 drafter (:func:`specgen.heads.export.load_eagle3_dir`)."""
    kinds = (kind,) if isinstance(kind, str) else kind
    if pathlib.Path(path).is_dir():
        from specgen.heads.export import load_eagle3_dir

        if kinds is not None and "eagle3" not in kinds:
            raise ModelLoadError(f"{path} holds an EAGLE-3 (eagle3) head directory, but drafter={kinds[0]} needs "
                                 f"{' or '.join(f'a {k}' for k in kinds)} head")
        return load_eagle3_dir(path, target, device=device, dtype=dtype, check_fingerprint=check_fingerprint)
    meta = read_metadata(path)
    if "specgen.config" not in meta:
        raise ModelLoadError(f"{path} has no specgen head metadata; it was not written by specgen-train")
    try:
        cfg = HeadConfig.from_json(meta["specgen.config"])
        expected = json.loads(meta.get("specgen.fingerprint", "{}"))
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path} has unreadable specgen head metadata ({exc}); write it again with "
                             "specgen-train") from exc
    if kinds is not None and cfg.kind not in kinds:
        raise ModelLoadError(f"{path} holds a {cfg.kind} head, but drafter={kinds[0]} needs "
                             f"{' or '.join(f'a {k}' for k in kinds)} head")
    if check_fingerprint:
        refuse_other_target(path, cfg.kind, expected, target)
    state = _read_tensors(path)
    _check_tensors(path, cfg, state, vocab_size=int(target.get_input_embeddings().weight.shape[0]))
    head = fill_head(path, build_head(cfg, state["vocab_ids"]), state, f"its {cfg.kind} head config",
                     f"a {cfg.kind} head")
    device = device or next(target.parameters()).device
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    head.attach(target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                packed=packed_linear.enabled_in(target))
    return head, meta


def fill_head(path, head: DraftHead, state: Mapping[str, torch.Tensor], config: str, kind: str) -> DraftHead:
    """``head`` with ``state`` loaded; ModelLoadError (one line) when a tensor's shape does not fit
    ``config`` or a name is missing or unexpected for ``kind``."""
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape that does not fit the config
        raise ModelLoadError(f"{path}: tensors do not fit {config}: "
                             f"{str(exc).strip().splitlines()[-1].strip()}") from exc
    if missing or unexpected:
        raise ModelLoadError(f"{path}: tensors do not fit {kind} (missing {missing}, unexpected {unexpected})")
    return head


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


def _read_tensors(path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for truncated or corrupt data
        raise ModelLoadError(f"{path}: cannot read the head's tensors ({exc}); the file is damaged") from exc


def _check_tensors(path, cfg: HeadConfig, state: Mapping[str, torch.Tensor], vocab_size: int) -> None:
    """Refuse at load what would otherwise fail (or draft garbage) mid-generation:
    a draft vocabulary that is not ``draft_vocab_size`` distinct ids of the target's
    vocabulary, and any weight that is NaN or infinite."""
    ids = state.get("vocab_ids")
    if ids is None or ids.dim() != 1 or ids.dtype.is_floating_point or ids.numel() != cfg.draft_vocab_size:
        raise ModelLoadError(f"{path}: vocab_ids must be {cfg.draft_vocab_size} integer token ids, got "
                             f"{'none' if ids is None else f'{tuple(ids.shape)} {ids.dtype}'}; the file is damaged")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel()):
        raise ModelLoadError(f"{path}: vocab_ids hold ids outside the target's vocabulary of {vocab_size} "
                             "(or repeated ids); the file is damaged or belongs to another target")
    bad = [name for name, value in state.items()
           if value.is_floating_point() and not bool(torch.isfinite(value).all())]
    if bad:
        raise ModelLoadError(f"{path}: weights {', '.join(sorted(bad)[:3])}{' ...' if len(bad) > 3 else ''} hold "
                             "NaN or Inf values; retrain the head (lower train.lr) or use another file")
