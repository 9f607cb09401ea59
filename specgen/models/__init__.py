"""Model plumbing: loading, the causal-LM wrapper with its KV cache, tokenizers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specgen.errors import ConfigError
from specgen.models.causal_lm import CausalLM, KVCache
from specgen.models.tiny import TinyTokenizer, build_tiny_model
from specgen.models.tokenizer import TokenizerInfo

__all__ = ["CausalLM", "KVCache", "LoadedModel", "TokenizerInfo", "load_model", "resolve_device", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    lm: CausalLM
    tokenizer: TokenizerInfo


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device={name!r} is not a valid torch device") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available; use device=auto or device=cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': float32 on CPU (token-exact verification), bfloat16 on CUDA; else as named."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"dtype={name!r} is not one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def load_model(source: Mapping, *, name: str, dtype: torch.dtype, device: torch.device,
               extra_eos: tuple[int, ...] = (), progress: bool = True) -> LoadedModel:
    """Build or load the model described by a config ``source`` mapping."""
    kind = source.get("kind")
    if kind == "tiny":
        args = {k: v for k, v in source.items() if k != "kind"}
        model = build_tiny_model(**args).to(device=device, dtype=dtype)
        tokenizer = TinyTokenizer(model.config.vocab_size)
        return LoadedModel(CausalLM(model, len(tokenizer), name), TokenizerInfo(tokenizer, extra_eos))
    from specgen.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(source, dtype=dtype, device=device, progress=progress)
    eos = list(extra_eos)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        eos.extend(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    info = TokenizerInfo(tokenizer, eos)
    return LoadedModel(CausalLM(model, info.vocab_size, name), info)
