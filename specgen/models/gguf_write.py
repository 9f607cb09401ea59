"""Write a transformers Llama model to a GGUF file llama.cpp loads.

Used for the tiny models built in code (``target=tiny backend=llama_cpp``), so the
llama.cpp backend is tested on a model whose whole output distribution can be
enumerated. The vocabulary is written as SentencePiece-style entries
``<0>``, ``<1>``, ... so token ids stay what specgen's tokenizer says; llama.cpp
never tokenises text here (specgen feeds ids).

Matrices are stored in ``quant`` (``F32`` keeps their values, ``Q8_0`` rounds them to
8-bit blocks as llama.cpp's quantiser does); norms stay float32. Q and K rows are reordered from transformers'
half-split rotary layout to llama.cpp's interleaved one (the permutation
llama.cpp's own converter applies), so both runtimes compute the same model.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile

import torch

_BLOCK_TENSORS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _rotary_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads * head_dim, d] rows from half-split rotary order to interleaved pairs."""
    rows, d = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, d).swapaxes(1, 2).reshape(rows, d)


def _tensors(model) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> float32 weight of a LlamaForCausalLM."""
    config = model.config
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"],
           "output_norm.weight": state["model.norm.weight"],
           "output.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"])}
    for i in range(config.num_hidden_layers):
        for hf_name, gguf_name in _BLOCK_TENSORS.items():
            weight = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _rotary_interleaved(weight, config.num_attention_heads)
            elif gguf_name == "attn_k":
                weight = _rotary_interleaved(weight, config.num_key_value_heads)
            out[f"blk.{i}.{gguf_name}.weight"] = weight
    return out


QUANT_TYPES = ("Q8_0", "F32")


def write_llama_gguf(model, path: pathlib.Path, *, eos_id: int = 0, name: str = "tiny",
                     quant: str = "F32") -> pathlib.Path:
    """Write ``model`` (a LlamaForCausalLM without biases) as a GGUF at ``path`` with its
    matrices in ``quant`` (one of :data:`QUANT_TYPES`), atomically. Returns ``path``."""
    import gguf

    if quant not in QUANT_TYPES:
        raise ValueError(f"quant={quant!r} is not one of {', '.join(QUANT_TYPES)}")
    qtype = gguf.GGMLQuantizationType[quant]

    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=path.parent)
    os.close(handle)
    try:
        writer = gguf.GGUFWriter(tmp, "llama")
        writer.add_name(name)
        writer.add_context_length(int(config.max_position_embeddings))
        writer.add_embedding_length(int(config.hidden_size))
        writer.add_block_count(int(config.num_hidden_layers))
        writer.add_feed_forward_length(int(config.intermediate_size))
        writer.add_head_count(int(config.num_attention_heads))
        writer.add_head_count_kv(int(config.num_key_value_heads))
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or
                                        (config.rope_parameters or {}).get("rope_theta", 10000.0)))
        writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if quant == "F32" else gguf.LlamaFileType[f"MOSTLY_{quant}"])
        vocab = int(config.vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_token_list([f"<{i}>".encode() for i in range(vocab)])
        writer.add_token_scores([0.0] * vocab)
        writer.add_token_types([gguf.TokenType.CONTROL if i == eos_id else gguf.TokenType.NORMAL
                                for i in range(vocab)])
        writer.add_eos_token_id(eos_id)
        writer.add_bos_token_id(eos_id)
        writer.add_add_bos_token(False)
        for tensor_name, weight in _tensors(model).items():
            if weight.dim() == 2 and quant != "F32":
                writer.add_tensor(tensor_name, gguf.quants.quantize(weight.numpy(), qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(tensor_name, weight.numpy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def tiny_gguf(model, cache_dir: pathlib.Path, quant: str = "Q8_0") -> pathlib.Path:
    """The GGUF of a tiny model under ``cache_dir`` in ``quant``, written once per distinct set of weights."""
    digest = hashlib.sha256(quant.encode())
    for key, value in sorted(model.state_dict().items()):
        digest.update(key.encode())
        digest.update(value.detach().float().cpu().numpy().tobytes())
    path = pathlib.Path(cache_dir) / f"tiny-{digest.hexdigest()[:16]}.gguf"
    return path if path.is_file() else write_llama_gguf(model, path, quant=quant)
