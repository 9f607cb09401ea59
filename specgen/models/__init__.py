"""Model plumbing: loading, the causal-LM wrapper with its KV cache, tokenizers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specgen.errors import ConfigError
from specgen.guarantee import Guarantee
from specgen.models import cpu
from specgen.models.causal_lm import CausalLM, KVCache
from specgen.models.tiny import TinyTokenizer, build_tiny_model
from specgen.models.tokenizer import TokenizerInfo

__all__ = ["CausalLM", "KVCache", "LoadedModel", "TokenizerInfo", "cuda_condition", "load_llama_cpp", "load_model",
           "load_quantized",
           "native_bfloat16", "native_cpu_bfloat16", "resolve_device", "resolve_drafter_dtype", "resolve_dtype"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    lm: CausalLM  # or another Target: QuantizedLM, LlamaCppLM
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
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ConfigError(f"device={name} but only {count} CUDA device{'s' if count != 1 else ''} "
                          f"{'are' if count != 1 else 'is'} visible (cuda:0 to cuda:{count - 1})")
    return device


def native_bfloat16(device: torch.device) -> bool:
    """Whether the CUDA ``device`` computes bfloat16 natively (not by emulation)."""
    try:
        with torch.cuda.device(device):
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # a torch without including_emulation: bfloat16 tensor cores start at sm_80
        return torch.cuda.get_device_capability(device) >= (8, 0)


def native_cpu_bfloat16() -> bool:
    """Whether bfloat16 is the fast dtype on this CPU (:func:`specgen.models.cpu.fast_bfloat16`:
    native bfloat16 instructions and a packed bfloat16 linear path); without them bfloat16 is
    emulated and slower than float32 (docs/drafters.md)."""
    return cpu.fast_bfloat16()


def cuda_condition(guarantee: Guarantee, device: torch.device, dtype: torch.dtype) -> Guarantee:
    """The guarantee as declared on ``device``: on CUDA float32 it turns TF32 off
    (process-wide: TF32 rounds matmul inputs to 10 mantissa bits) and names the
    condition an ``exact``/``greedy`` claim holds under; elsewhere it is unchanged.
    The build then measures the verify pass against single-token steps as on every
    device (``Target.verify_gap``) and keeps the claim only where they are equal."""
    if device.type != "cuda" or dtype != torch.float32 or not guarantee.unconditional:
        return guarantee
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return Guarantee(guarantee.kind, "on CUDA float32 with TF32 off (specgen turns it off), verify logits measured "
                     "equal to single-token ones at load; scripts/gpu_check.sh checks token identity end to end")


def resolve_dtype(name: str, device: torch.device, also: tuple[str, ...] = ()) -> torch.dtype:
    """'auto': float32 on CPU (the dtype whose verify pass is measured for exactness); on CUDA bfloat16 where the
    device computes it natively, else float16; any other name as named. ``also``: further
    names the caller serves elsewhere, listed in the ConfigError for an unknown one."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if native_bfloat16(device) else torch.float16
    if name not in _DTYPES:
        raise ConfigError(f"dtype={name!r} is not one of auto, {', '.join(sorted(_DTYPES) + list(also))}")
    return _DTYPES[name]


def resolve_drafter_dtype(name, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``drafter.dtype``: None (or "target") = the target's dtype; "auto" = the fastest dtype to
    draft in here: bfloat16 on a CPU with bfloat16 instructions (:func:`native_cpu_bfloat16`), the
    top-level ``auto`` on CUDA, else the target's; any other name as for the top-level ``dtype``.

    A drafter's numerics never change the guarantee: q is whatever the drafter computed."""
    if name is None or str(name) in ("", "target"):
        return target_dtype
    if str(name) == "auto":
        if device.type == "cuda":
            return resolve_dtype("auto", device)
        return torch.bfloat16 if device.type == "cpu" and native_cpu_bfloat16() else target_dtype
    if str(name) not in _DTYPES:
        raise ConfigError(f"drafter.dtype={name!r} is not one of auto, target, {', '.join(sorted(_DTYPES))}")
    return resolve_dtype(str(name), device)


def load_model(source: Mapping, *, name: str, dtype: torch.dtype, device: torch.device,
               extra_eos: tuple[int, ...] = (), progress: bool = True, packed: bool = True,
               vocab_size: int | None = None, invariant: bool = False) -> LoadedModel:
    """Build or load the model described by a config ``source`` mapping (``packed``, ``invariant``: as for
    :class:`CausalLM`; ``vocab_size``: the logits kept, None = its tokenizer's, a draft model's is the target's)."""
    kind = source.get("kind")
    if kind == "tiny":
        args = {k: v for k, v in source.items() if k != "kind"}
        model = build_tiny_model(**args).to(device=device, dtype=dtype)
        tokenizer = TinyTokenizer(model.config.vocab_size)
        return LoadedModel(CausalLM(model, vocab_size or len(tokenizer), name, packed, invariant),
                           TokenizerInfo(tokenizer, extra_eos))
    from specgen.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(source, dtype=dtype, device=device, progress=progress)
    eos = list(extra_eos)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        eos.extend(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    info = TokenizerInfo(tokenizer, eos)
    return LoadedModel(CausalLM(model, vocab_size or info.vocab_size, name, packed, invariant), info)


def load_llama_cpp(source: Mapping, *, name: str, threads: int, extra_eos: tuple[int, ...] = (),
                   progress: bool = True, vocab_size: int | None = None, tiny_type: str | None = None,
                   **options) -> LoadedModel:
    """The model of a GGUF-kind (or ``tiny``) ``source`` on the llama.cpp backend
    (:mod:`specgen.models.llama_cpp`), with specgen's tokenizer for it; a tiny model is
    written as a GGUF in ``tiny_type`` first (None: :func:`~specgen.models.gguf_write.tiny_gguf`'s type).
    ``vocab_size``: as for :func:`load_model`; ``options``: :class:`~specgen.models.llama_cpp.LlamaCppLM`'s
    (``sequences``, ``batch_row_context``, ``flash_attention``, ``repack``, ``prefill_split``, and ``context``,
    the KV cells of each of the model's contexts, its ``context_length``), its defaults where not given; a
    tiny model's ``prefill_split`` ``"auto"`` is :data:`~specgen.models.llama_context.PREFILL_TOKENS` (its
    speed is nothing to measure)."""
    from specgen.models.llama_cpp import LlamaCppLM
    from specgen.models.loading import gguf_file, load_tokenizer, writable_cache_dir

    if source.get("kind") == "tiny":
        from specgen.models.gguf_write import tiny_gguf

        args = {k: v for k, v in source.items() if k != "kind"}
        model = build_tiny_model(**args)
        typed = {} if tiny_type is None else {"quant": tiny_type}
        if options.get("prefill_split", "auto") == "auto":
            from specgen.models import llama_context

            options["prefill_split"] = llama_context.PREFILL_TOKENS
        path, tokenizer, eos = tiny_gguf(model, writable_cache_dir("gguf"), **typed), TinyTokenizer(model.config.vocab_size), []
    else:
        path = gguf_file(source, progress=progress)
        tokenizer, eos = load_tokenizer(source, progress=progress, gguf=path)
    info = TokenizerInfo(tokenizer, (*extra_eos, *eos))
    if "context" in options:
        options["context_length"] = options.pop("context")
    lm = LlamaCppLM(path, vocab_size=vocab_size or info.vocab_size, name=name, threads=threads, progress=progress,
                    **options)
    return LoadedModel(lm, info)


def load_quantized(source: Mapping, *, name: str, quant: str, extra_eos: tuple[int, ...] = (),
                   progress: bool = True, vocab_size: int | None = None, keep_model: bool = False) -> LoadedModel:
    """The model of ``source`` (a Llama-family model; tiny ones too) on the quantized torch path
    (:mod:`specgen.models.quantized`) with ``quant`` (``int8``/``int4``/``w8a8``) weights, on the CPU; its
    float32 weights are read as :func:`load_model` reads them and quantized. ``keep_model``: keep the
    float32 model too (``hf_model``: a learned head reads its embeddings and fingerprint). ConfigError for an
    architecture the lean forward does not serve, naming the way that works."""
    from specgen.models.quantized import CALIBRATION_TEXT, QuantizedLM, architecture_problem, calibrate, choose_kernels

    loaded = load_model(source, name=name, dtype=torch.float32, device=torch.device("cpu"), extra_eos=extra_eos,
                        progress=progress, packed=False, vocab_size=vocab_size)
    model = loaded.lm.model
    problem = architecture_problem(model)
    if problem is not None:
        raise ConfigError(f"dtype={quant} runs a lean Llama-family forward: {problem}; use dtype=float32")
    kind, head_kind, fallback = choose_kernels(quant)
    smoothing = None
    if kind == "w8a8":  # per-channel smoothing, calibrated on fixed text (ids beyond a tiny vocabulary wrap)
        ids = [i % model.config.vocab_size for i in loaded.tokenizer.encode_prompt(CALIBRATION_TEXT, chat=False)]
        smoothing = calibrate(model, ids)
    lm = QuantizedLM(model, loaded.lm.vocab_size, kind=kind, head_kind=head_kind, name=name, fallback=fallback,
                     smoothing=smoothing, keep_model=keep_model)
    return LoadedModel(lm, loaded.tokenizer)
