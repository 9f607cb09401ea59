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

_SAMPLES_PER_TENSOR = 4096


def target_fingerprint(model: torch.nn.Module) -> dict:
    """Architecture plus a hash of the target's weights.

    The hash covers every parameter's name and shape and a strided sample of
    ~4096 of its values rounded to bfloat16, so a float32 and a bfloat16 load of
    the same checkpoint agree while any retrained or fine-tuned version differs.
    """
    cfg = model.config
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        flat = param.detach().reshape(-1)
        stride = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        sample = flat[::stride].to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes()
        digest.update(f"{name}:{tuple(param.shape)}".encode())
        digest.update(sample)
    return {
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "hidden_size": int(cfg.hidden_size),
        "num_layers": int(cfg.num_hidden_layers),
        "vocab_size": int(cfg.vocab_size),
        "weights_sha256": digest.hexdigest(),
    }


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
                             "or point drafter.head= at an existing .safetensors file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"{path} is not a readable safetensors head file: {exc}") from exc


def load_head(path: str | pathlib.Path, target: torch.nn.Module, *, kind: str | None = None,
              device: torch.device | None = None, dtype: torch.dtype = torch.float32,
              check_fingerprint: bool = True) -> tuple[DraftHead, dict[str, str]]:
    """Load a head for ``target`` (a transformers causal LM); refuse one trained for another target."""
    meta = read_metadata(path)
    if "specgen.config" not in meta:
        raise ModelLoadError(f"{path} has no specgen head metadata; it was not written by specgen-train")
    cfg = HeadConfig.from_json(meta["specgen.config"])
    if kind is not None and cfg.kind != kind:
        raise ModelLoadError(f"{path} holds a {cfg.kind} head, but drafter={kind} needs a {kind} head")
    if check_fingerprint:
        expected = json.loads(meta.get("specgen.fingerprint", "{}"))
        actual = target_fingerprint(target)
        differing = [k for k in sorted(set(expected) | set(actual)) if expected.get(k) != actual.get(k)]
        if differing:
            raise ModelLoadError(
                f"the {cfg.kind} head {path} was trained for a different target "
                f"({expected.get('architecture')}, weights {str(expected.get('weights_sha256'))[:12]}) than the one "
                f"loaded ({actual['architecture']}, weights {actual['weights_sha256'][:12]}); differs in "
                f"{', '.join(differing)}. A head only drafts well for the exact weights it was trained on: "
                "train one for this target with specgen-train")
    with safe_open(str(path), framework="pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}
    head = build_head(cfg, state["vocab_ids"])
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"{path}: tensors do not fit a {cfg.kind} head (missing {missing}, unexpected {unexpected})")
    device = device or next(target.parameters()).device
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    head.attach(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return head, meta
