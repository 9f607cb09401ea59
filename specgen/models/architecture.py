"""Which model architectures the KV cache can serve: a check run before weights are read."""

from __future__ import annotations

import pathlib

from specgen.errors import ModelLoadError


def unsupported_architecture(config) -> str | None:
    """Why the KV cache cannot serve a model with this HF ``config``, or None when it can.

    Speculation appends draft positions to every layer's state and crops the
    rejected ones; that needs every layer to keep plain per-position keys and
    values. A sliding window (Mistral-style ``sliding_window``, Gemma-style
    ``sliding_attention`` layers) drops old positions once the window fills;
    recurrent and state-space layers (Mamba, RWKV, hybrids) fold positions into
    one state that cannot be cropped.
    """
    model_type = getattr(config, "model_type", "model")
    layer_types = [str(t) for t in getattr(config, "layer_types", None) or []]
    stateful = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if stateful or model_type in _RECURRENT_MODEL_TYPES:
        kinds = ", ".join(stateful) or model_type
        return (f"{model_type} has recurrent or state-space layers ({kinds}) whose state cannot be rolled back "
                "to the accepted draft prefix; use a transformer model with full attention")
    window = getattr(config, "sliding_window", None)
    sliding = any(t == "sliding_attention" for t in layer_types) or (
        bool(window) and getattr(config, "use_sliding_window", True) is not False)
    context = getattr(config, "max_position_embeddings", None)
    if sliding and window and not (context and int(window) >= int(context)):
        return (f"{model_type} uses sliding-window attention (window {window} tokens, context {context}); "
                "the KV cache cannot crop a rolling window; use a model with full attention")
    return None


_RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "xlstm", "jamba",
                                    "zamba", "zamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2"})


def check_architecture(model_dir: pathlib.Path, trust: bool) -> None:
    """ModelLoadError naming the reason when :func:`unsupported_architecture` refuses the model in ``model_dir``."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read the model config in {model_dir}: {error}") from error
    reason = unsupported_architecture(config)
    if reason:
        raise ModelLoadError(f"the model in {model_dir} is not supported: {reason}")
