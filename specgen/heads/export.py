"""EAGLE-3 heads in the layout vLLM and SGLang load, both ways.

:func:`export_eagle3` writes a specgen ``eagle3`` head as a drafter directory;
:func:`load_eagle3_dir` builds an :class:`~specgen.heads.eagle3.Eagle3Head` from
such a directory, ours or a foreign one (``drafter=eagle drafter.head_file=DIR``
reaches it through :func:`specgen.heads.store.load_head`).

The layout, read from the engines' sources (learned from, not copied):

* vllm-project/vllm ``vllm/model_executor/models/llama_eagle3.py`` (commit 00bd1493):
  ``Eagle3LlamaForCausalLM.load_weights`` renames ``midlayer.`` to ``layers.0.``,
  stacks ``q/k/v_proj`` and ``gate/up_proj``, prefixes ``model.`` to all but
  ``lm_head``, reads ``d2t`` as ``draft_id_to_target_id`` and skips ``t2d``; the
  first layer's q/k/v take ``2 * hidden_size`` inputs ([norm(embedding),
  hidden_norm(hidden)], in that order); ``fc`` is ``[hidden, 3 * hidden]``;
  ``lm_head`` has ``draft_vocab_size`` rows; logits map to target ids as
  ``arange(draft_vocab_size) + d2t``; the state passed to the next draft step is the
  pre-norm residual sum; ``norm_before_residual`` (default false) is our convention.
* vllm ``vllm/model_executor/models/llama.py`` (commit e06c9ba2): ``LlamaModel.forward``
  captures ``hidden_states + residual`` *before* decoder layer ``idx`` for every
  ``idx`` in the aux layer ids (so id ``i`` is HF ``output_hidden_states[i]``, and
  0 fails: no residual yet), in layer order; the default is
  ``(2, L // 2, L - 3)``.
* vllm ``vllm/v1/worker/gpu_model_runner.py`` ``_get_eagle3_aux_layers_from_config``:
  the draft ``config.json``'s top-level ``eagle_aux_hidden_state_layer_ids`` first
  (some builds then fall back to ``eagle_config``'s key, unshifted).
* vllm ``vllm/transformers_utils/configs/eagle.py`` (commit 23c5aa92): an architecture
  ending in ``Eagle3`` is kept (``LlamaForCausalLMEagle3``; the registry maps it to
  ``llama_eagle3``); the inner config is ``AutoConfig.for_model`` of ``model_type``.
* vllm ``vllm/v1/spec_decode/eagle.py`` ``load_model``: the draft shares the target's
  ``embed_tokens`` when the shapes agree (``vocab_size`` = the target's) and it ships none.
* sgl-project/sglang ``python/sglang/srt/models/llama_eagle3.py`` (commit 03d5a777):
  ``LlamaForCausalLMEagle3`` with ``midlayer`` + ``fc`` (applied when the hidden
  width differs from the embedding's) + ``norm``; ``lm_head`` of
  ``draft_vocab_size`` rows unless ``tie_word_embeddings``; ``d2t`` becomes
  ``hot_token_id = d2t + arange``; ``t2d`` is skipped.
* sglang ``python/sglang/srt/model_executor/model_runner.py``: the aux ids come only
  from ``config.json``'s ``eagle_config.eagle_aux_hidden_state_layer_ids``; and
  ``python/sglang/srt/models/llama.py`` (commit bf7a0e23)
  ``set_eagle3_layers_to_capture`` adds 1 to each (SGLang's id ``j`` = the output of
  decoder layer ``j``) and captures before layer ``j + 1``, like vLLM.

So one head fused from HF hidden-state indices ``[a, b, c]`` (specgen's
``feature_layers``, 0 = embeddings) is written as ``eagle_aux_hidden_state_layer_ids:
[a, b, c]`` for vLLM and ``eagle_config.eagle_aux_hidden_state_layer_ids: [a - 1, b - 1,
c - 1]`` for SGLang; both engines capture in ascending layer order, so ``fc``'s column
blocks are permuted to ascending indices; both need exactly three distinct indices in
``1 .. L - 1``. Specgen's own metadata (head config, target fingerprint) rides in the
safetensors header, which neither engine reads.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shlex
from collections.abc import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specgen.errors import ConfigError, ModelLoadError
from specgen.heads.fingerprint import refuse_other_target
from specgen.heads.kinds import build_head, check_shapes, fill_head
from specgen.heads.modules import HeadConfig
from specgen.outputs import replace_atomically, write_failure
from specgen.config.paths import check_output_dir

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
README = "README.md"
_OWN_FILES = {WEIGHTS, CONFIG, README}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
#: specgen's tensor names are the engines' (the layer is already ``midlayer``); vocab_ids become d2t / t2d
_SKIPPED = {"vocab_ids"}


def aux_layer_ids(feature_layers, num_layers: int) -> tuple[list[int], list[int]]:
    """specgen ``feature_layers`` (HF hidden-state indices) -> (vLLM ids, SGLang ids), ascending.

    ConfigError unless there are exactly three distinct indices in ``1 .. num_layers - 1``
    (the engines' ``fc`` takes three features, captured before a decoder layer)."""
    layers = [i % (num_layers + 1) for i in feature_layers]  # negative indices count from the end
    if len(layers) != 3 or len(set(layers)) != 3 or not all(1 <= i <= num_layers - 1 for i in layers):
        raise ConfigError(f"vLLM and SGLang load EAGLE-3 heads that fuse exactly three distinct target hidden "
                          f"states 1..{num_layers - 1} (inputs of decoder layers 1..{num_layers - 1}); this head "
                          f"fuses feature_layers={list(feature_layers)}: train one with train.head.feature_layers=null")
    ids = sorted(layers)
    return ids, [i - 1 for i in ids]


def export_eagle3(head, out_dir, *, target_config, fingerprint: Mapping | None = None,
                  dtype: torch.dtype = torch.bfloat16, num_speculative_tokens: int = 3,
                  target_name: str | None = None) -> pathlib.Path:
    """Write ``head`` (an attached eagle3 head) as a vLLM / SGLang EAGLE-3 drafter directory.

    ``target_config``: the target's transformers config; ``fingerprint``: the target's
    (:func:`specgen.heads.fingerprint.target_fingerprint`), stored so a round trip stays bound
    to it. Writes config.json, model.safetensors and README.md (the serving commands);
    returns the directory."""
    if getattr(head.cfg, "kind", None) != "eagle3":
        raise ConfigError(f"only eagle3 heads export to the vLLM/SGLang EAGLE-3 layout, not a {head.cfg.kind} head")
    if head.lm_rows is None:
        raise ConfigError("attach the head to its target before exporting (the LM-head rows come from the target)")
    if dtype not in _DTYPE_NAMES:
        raise ConfigError(f"export dtype must be one of {', '.join(_DTYPE_NAMES.values())}, got {dtype}")
    cfg, num_layers = head.cfg, int(target_config.num_hidden_layers)
    vocab_size, hidden = int(target_config.vocab_size), int(target_config.hidden_size)
    if cfg.hidden_size != hidden:
        raise ConfigError(f"the head's hidden_size {cfg.hidden_size} is not the target's {hidden}")
    vllm_ids, sglang_ids = aux_layer_ids(cfg.feature_layers, num_layers)
    out = check_export_dir(pathlib.Path(out_dir), "out")

    layers = [i % (num_layers + 1) for i in cfg.feature_layers]
    tensors = _engine_tensors(head, sorted(range(3), key=layers.__getitem__), vocab_size, dtype)
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": int(getattr(target_config, "max_position_embeddings", 0) or 4096),
        "vocab_size": vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "eagle_aux_hidden_state_layer_ids": vllm_ids,  # vLLM: HF hidden-state indices
        "eagle_config": {"use_aux_hidden_state": True,
                         "eagle_aux_hidden_state_layer_ids": sglang_ids},  # SGLang: adds 1 when capturing
    }
    stored_cfg = dataclasses.replace(cfg, feature_layers=vllm_ids)  # what config.json and fc now say
    metadata = {"format": "pt", "specgen.kind": "eagle3", "specgen.config": stored_cfg.to_json(),
                "specgen.fingerprint": json.dumps(dict(fingerprint or {}), sort_keys=True)}
    out.mkdir(parents=True, exist_ok=True)
    _write(out / WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    _write(out / CONFIG, lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))
    _write(out / README, lambda tmp: tmp.write_text(serving_readme(out, num_speculative_tokens, target_name)))
    return out


def _engine_tensors(head, order: list[int], vocab_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's own weights under the engines' names (the same as specgen's), fc's column blocks
    in ``order`` (ascending layers), plus lm_head [Vd, d], d2t [Vd] int64 and t2d [V] bool."""
    tensors = {}
    for name, value in head.state_dict().items():
        if name in _SKIPPED:
            continue
        value = value.detach().to("cpu", torch.float32)
        if name == "fc.weight":  # [d, 3d]: column block k reads feature_layers[k]
            value = torch.cat([value.chunk(len(order), dim=1)[k] for k in order], dim=1)
        tensors[name] = value.to(dtype).contiguous()
    ids = head.vocab_ids.detach().to("cpu", torch.int64)  # [Vd] target ids
    tensors["lm_head.weight"] = head.lm_rows.detach().to("cpu", torch.float32).to(dtype).contiguous()
    tensors["d2t"] = ids - torch.arange(ids.numel(), dtype=torch.int64)  # target id = draft id + d2t[draft id]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors


def _write(path: pathlib.Path, write) -> None:
    """``write(tmp)`` then rename onto ``path``; OutputError (one line, nothing partial left) when it fails."""
    try:
        replace_atomically(path, write)
    except OSError as exc:
        raise write_failure(path, exc, "no partial file is left; free space and export again") from None


def train_export_dir(value, kind: str, out_path: pathlib.Path, feature_layers=None) -> pathlib.Path | None:
    """``train.export``: None (no export) or ``eagle3`` -> ``<train.out without suffix>-eagle3/``,
    checked before anything loads (ConfigError for another value, head kind or an unexportable
    explicit ``feature_layers``)."""
    if value in (None, False, "", "none", "null"):
        return None
    if value != "eagle3":
        raise ConfigError(f"train.export={value} is not a layout specgen writes; use train.export=eagle3 or null")
    if kind != "eagle3":
        raise ConfigError(f"train.export=eagle3 exports eagle3 heads (train.kind=eagle3), not a {kind} head")
    if feature_layers is not None and (len(feature_layers) != 3 or len(set(feature_layers)) != 3):
        raise ConfigError(f"train.export=eagle3 needs three distinct feature layers (vLLM/SGLang fuse three), got "
                          f"train.head.feature_layers={list(feature_layers)}")
    return check_export_dir(out_path.with_name(out_path.with_suffix("").name + "-eagle3"), "train.export")


def check_export_dir(path: pathlib.Path, name: str) -> pathlib.Path:
    """ConfigError unless ``path`` is new, empty, or an earlier export (only our files in it)."""
    check_output_dir(path, name)
    if path.is_dir():
        others = sorted(p.name for p in path.iterdir() if p.name not in _OWN_FILES)
        if others:
            raise ConfigError(f"{name}={path} already holds other files ({', '.join(others[:3])}); "
                              "give a new or empty directory for the EAGLE-3 export")
    return path


def serving_readme(out: pathlib.Path, num_speculative_tokens: int = 3, target_name: str | None = None) -> str:
    """The vLLM and SGLang command lines that serve the target with this drafter."""
    path = str(out.absolute())
    target = target_name or "<the target checkpoint the head was trained for>"
    spec = json.dumps({"method": "eagle3", "model": path, "num_speculative_tokens": num_speculative_tokens})
    return (
        "# EAGLE-3 drafter exported by specgen\n\n"
        "Serve the target it was trained for (the same weights; specgen's fingerprint is in the\n"
        "safetensors metadata) with this directory as the draft model.\n\n"
        f"vLLM:\n\n    vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}\n\n"
        f"SGLang:\n\n    python -m sglang.launch_server --model-path {shlex.quote(target)} "
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {shlex.quote(path)} "
        f"--speculative-num-steps {num_speculative_tokens} --speculative-eagle-topk 4 "
        "--speculative-num-draft-tokens 16\n\n"
        "Back into specgen: `specgen drafter=eagle drafter.head_file=" + path + "`\n")


def load_eagle3_dir(path, target, *, device: torch.device | None = None, dtype: torch.dtype = torch.float32,
                    check_fingerprint: bool = True):
    """An :class:`~specgen.heads.eagle3.Eagle3Head` from a vLLM/SGLang EAGLE-3 directory, for ``target``
    (a transformers causal LM). Returns (head, safetensors metadata).

    The file's own ``lm_head`` rows replace the borrowed target rows. A specgen
    export is refused for another target by its fingerprint; a foreign head is
    checked by shapes only (hidden size, vocabulary, layer ids)."""
    path = pathlib.Path(path)
    config = _read_config(path)
    meta, state = _read_weights(path / WEIGHTS)
    target_cfg = target.config
    hidden, vocab_size = int(target_cfg.hidden_size), int(target.get_input_embeddings().weight.shape[0])
    num_layers = int(target_cfg.num_hidden_layers)
    if check_fingerprint and meta.get("specgen.fingerprint", "{}") != "{}":
        refuse_other_target(path, "eagle3", json.loads(meta["specgen.fingerprint"]), target)
    if int(config.get("hidden_size", -1)) != hidden or int(config.get("vocab_size", -1)) != vocab_size \
            or int(config.get("target_hidden_size") or hidden) != hidden:
        raise ModelLoadError(f"{path} is an EAGLE-3 head for a target with hidden_size {config.get('hidden_size')} "
                             f"and vocab_size {config.get('vocab_size')}, but the loaded target has {hidden} and "
                             f"{vocab_size}; give drafter.head_file= a head for this target")
    cfg = HeadConfig(kind="eagle3", hidden_size=hidden, draft_vocab_size=int(config.get("draft_vocab_size") or
                                                                             vocab_size),
                     feature_layers=_feature_layers(path, config, num_layers),
                     intermediate_size=int(config["intermediate_size"]),
                     num_attention_heads=int(config["num_attention_heads"]),
                     num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                     head_dim=int(config.get("head_dim") or hidden // int(config["num_attention_heads"])),
                     norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                     rope_theta=float(config.get("rope_theta") or
                                      (config.get("rope_parameters") or {}).get("rope_theta") or 10000.0))
    vocab_ids = _vocab_ids(path, state, cfg.draft_vocab_size, vocab_size)
    lm_rows = state.pop("lm_head.weight", None)
    embed = state.pop("embed_tokens.weight", None)
    if lm_rows is None or tuple(lm_rows.shape) != (cfg.draft_vocab_size, hidden):
        raise ModelLoadError(f"{path}: lm_head.weight must be [{cfg.draft_vocab_size}, {hidden}], got "
                             f"{'none' if lm_rows is None else list(lm_rows.shape)}")
    if embed is not None and tuple(embed.shape) != (vocab_size, hidden):
        raise ModelLoadError(f"{path}: embed_tokens.weight must be [{vocab_size}, {hidden}], got {list(embed.shape)}")
    bad = [n for n, v in [*state.items(), ("lm_head.weight", lm_rows)] if not bool(torch.isfinite(v.float()).all())]
    if bad:
        raise ModelLoadError(f"{path}: weights {', '.join(sorted(bad)[:3])} hold NaN or Inf values")
    check_shapes(path, cfg, {name: value.shape for name, value in {**state, "vocab_ids": vocab_ids}.items()},
                 "its config.json")
    head = fill_head(path, build_head(cfg, vocab_ids), {**state, "vocab_ids": vocab_ids}, "its config.json",
                     "an EAGLE-3 head")
    device = device or next(target.parameters()).device
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    head.attach(target.get_input_embeddings().weight if embed is None else embed.to(device),
                target.get_output_embeddings().weight)
    head.lm_rows = lm_rows.to(device=device, dtype=dtype)  # the file's own rows, not the target's
    return head, meta


def _read_config(path: pathlib.Path) -> dict:
    try:
        config = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is a directory without {CONFIG}; drafter.head_file= takes a specgen "
                             ".safetensors head or a vLLM/SGLang EAGLE-3 directory") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path / CONFIG} is not readable JSON ({exc})") from exc
    archs = config.get("architectures") or []
    if not any("Eagle3" in str(a) for a in archs):
        raise ModelLoadError(f"{path / CONFIG} describes {archs or 'no architecture'}, not an EAGLE-3 drafter "
                             f"({ARCHITECTURE})")
    if int(config.get("num_hidden_layers", 1)) != 1 or config.get("hidden_act", "silu") != "silu" \
            or config.get("rope_scaling") not in (None, {}) or config.get("norm_before_residual", False) \
            or config.get("attention_bias", False):
        raise ModelLoadError(f"{path / CONFIG}: specgen runs EAGLE-3 heads of one layer, silu, plain rotary "
                             "positions, no attention bias and norm_before_residual=false; this one differs")
    return config


def _read_weights(path: pathlib.Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist; an EAGLE-3 directory holds {CONFIG} and {WEIGHTS}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {}), {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"{path}: cannot read the head's tensors ({exc}); the file is damaged") from exc


def _feature_layers(path: pathlib.Path, config: Mapping, num_layers: int) -> list[int]:
    """HF hidden-state indices from the vLLM key, else the SGLang key (+1), else the engines' default."""
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
    sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_sglang = None if sglang_ids is None else [int(i) + 1 for i in sglang_ids]
    if vllm_ids is not None and from_sglang is not None and [int(i) for i in vllm_ids] != from_sglang:
        raise ModelLoadError(f"{path / CONFIG}: eagle_aux_hidden_state_layer_ids {list(vllm_ids)} (vLLM) and "
                             f"eagle_config's {list(sglang_ids)} (SGLang, one lower) name different layers")
    layers = [int(i) for i in vllm_ids] if vllm_ids is not None else from_sglang
    if layers is None:
        layers = [2, num_layers // 2, num_layers - 3]
    if len(layers) != 3 or not all(0 <= i <= num_layers for i in layers):
        raise ModelLoadError(f"{path}: aux hidden-state layers {layers} do not fit a target with {num_layers} "
                             "layers (three indices 0..L expected)")
    return layers


def _vocab_ids(path: pathlib.Path, state: dict[str, torch.Tensor], draft_vocab: int, vocab_size: int) -> torch.Tensor:
    """Draft index -> target id from ``d2t`` (offsets), checked against ``t2d`` when present."""
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None:
        if draft_vocab != vocab_size:
            raise ModelLoadError(f"{path}: no d2t map for a draft vocabulary of {draft_vocab} < {vocab_size}")
        return torch.arange(vocab_size)
    if d2t.dim() != 1 or d2t.numel() != draft_vocab or d2t.dtype.is_floating_point:
        raise ModelLoadError(f"{path}: d2t must be {draft_vocab} integers, got {list(d2t.shape)} {d2t.dtype}")
    ids = d2t.to(torch.int64) + torch.arange(draft_vocab)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != draft_vocab:
        raise ModelLoadError(f"{path}: d2t maps outside the target's vocabulary of {vocab_size} (or twice to one id)")
    if t2d is not None:
        expected = torch.zeros(vocab_size, dtype=torch.bool)
        expected[ids] = True
        if t2d.shape != expected.shape or not torch.equal(t2d.to(torch.bool), expected):
            raise ModelLoadError(f"{path}: t2d does not mark exactly the {draft_vocab} target ids d2t maps to")
    return ids
