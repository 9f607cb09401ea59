"""Head files: safetensors with metadata, bound to the exact target a head was trained on.

Metadata keys (all strings): ``specgen.kind``, ``specgen.config`` (HeadConfig
JSON), ``specgen.fingerprint`` (JSON), ``specgen.command``, ``specgen.seed``,
``specgen.data``, and free-form ``specgen.train`` (JSON: loss, steps, metrics).
Loading a head whose fingerprint differs from the loaded target's is refused
(:mod:`specgen.heads.fingerprint`).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specgen.errors import ModelLoadError
from specgen.heads.fingerprint import refuse_other_target
from specgen.heads.kinds import build_head, check_shapes, fill_head
from specgen.heads.modules import DraftHead, HeadConfig
from specgen.models import packed_linear
from specgen.outputs import replace_atomically


def save_head(path: str | pathlib.Path, head: DraftHead, fingerprint: Mapping, *, command: str = "", seed: int = 0,
              data: str = "", train: Mapping | None = None, dtype: torch.dtype = torch.bfloat16) -> pathlib.Path:
    """Write ``head`` (its own parameters and vocab_ids, not the borrowed target tensors) in one rename;
    OSError (a full disk) leaves no partial file."""
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
    replace_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))  # OSError: nothing left
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
    check_shapes(path, cfg, _tensor_shapes(path), "its specgen.config metadata")
    state = _read_tensors(path)
    _check_tensors(path, cfg, state, vocab_size=int(target.get_input_embeddings().weight.shape[0]))
    head = fill_head(path, build_head(cfg, state["vocab_ids"]), state, f"its {cfg.kind} head config",
                     f"a {cfg.kind} head")
    device = device or next(target.parameters()).device
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    head.attach(target.get_input_embeddings().weight, target.get_output_embeddings().weight,
                packed=packed_linear.enabled_in(target))
    return head, meta


def _tensor_shapes(path) -> dict[str, list[int]]:
    """Each stored tensor's shape, read from the file's header (no tensor data)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_slice(name).get_shape() for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"{path}: cannot read the head's tensors ({exc}); the file is damaged") from exc


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
