"""A lean forward of the Llama family (Llama, Qwen2: Llama with q/k/v biases) on quantized linears.

One readable forward in the style of gpt-fast's ``model.py``: token embeddings,
RMSNorm, rotary embeddings, grouped-query attention over an explicit
preallocated KV cache (:class:`KVBuffers`, passed in), a SwiGLU MLP and the LM
head. Linear layers are :class:`~specgen.models.quantized.kernels.QuantLinear`
(q/k/v fused into one, gate/up into one); where their output feeds a float32 op
(RoPE, the KV write, the residual adds) it stays in the kernel's bfloat16 and the
op promotes it, which computes the same values without a separate cast.

Batch invariance by construction: the logits of a position must not depend on
how many positions are fed with it. Every op here either works on each row on
its own (the int kernels, norms, RoPE, SiLU, residual adds: elementwise or
reductions within a row) or is computed per query in the shapes of a one-token
step: a query at position ``p`` attends over the first ``span(p)`` cache slots, ``p + 1``
rounded up to a multiple of :data:`KEY_BUCKET` (at most the context length), with an
additive mask of ``-inf`` past ``p`` (masked slots add exact zeros; they hold finite stale or
zero entries, never garbage), each key/value head's query heads folded into the query axis
(query ``[kv_heads, groups, head_dim]``). A query's shapes depend on its position only, so
the queries of one forward that share a span go in one ``scaled_dot_product_attention`` call
as its batch (the kernel computes batch items apart, in the same shapes as alone): a verify
of ``n`` tokens makes one or two calls per layer where per-query attention made ``n``. A draft
tree's nodes attend the same way, each over the prefix and its own path in depth order
(:mod:`~specgen.models.quantized.spans`). The target measures the result at load (``verify_gap``).
:meth:`LeanLlama.hidden` also returns the hidden states a learned drafter reads (features).

The weights come from a loaded transformers model (float32, e.g. a GGUF's
dequantised tensors); :func:`architecture_problem` says which models this
forward does not serve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specgen.models.quantized.kernels import QuantLinear
from specgen.models.quantized.smooth import Smoothing
from specgen.models.quantized.spans import Span, TreePart, key_span, positions_of, spans_of

#: transformers model types this forward serves.
MODEL_TYPES = ("llama", "qwen2")
#: Kernels that quantize weights only: smoothing is not folded into their layers.
WEIGHT_ONLY = ("int8", "int4")
#: Tokens a new KV buffer holds; it doubles when full (up to the context length).
FIRST_CAPACITY = 256
#: A query attends over its position + 1 keys rounded up to a multiple of this (the rest masked).
KEY_BUCKET = 16


def architecture_problem(model: torch.nn.Module) -> str | None:
    """Why :class:`LeanLlama` cannot run ``model`` (None: it can)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in MODEL_TYPES:
        return f"it serves model types {', '.join(MODEL_TYPES)}, not {kind!r}"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        return "it serves SwiGLU MLPs without biases"
    if getattr(config, "use_sliding_window", False):
        return "it serves full attention, and this model uses a sliding window"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope == "dynamic":
        return "it serves fixed rotary tables, and this model's rope scaling is dynamic"
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in ("logit_scale", "final_logit_softcapping")):
        return "its logits are the LM head's output, and this model scales or caps them"
    return None


@dataclass
class KVBuffers:
    """Keys and values of one sequence: [layers, capacity, kv_heads, head_dim] float32 each.

    Slots past the owner's length hold stale entries (or zeros, never uninitialised memory) that
    queries mask out, so dropping entries costs nothing; :meth:`reserve` grows both buffers (copying
    what is kept)."""

    keys: torch.Tensor
    values: torch.Tensor

    def reserve(self, length: int, kept: int, limit: int) -> None:
        """Make room for ``length`` slots, keeping the first ``kept``; at most ``limit`` slots."""
        capacity = self.keys.shape[1]
        if length <= capacity:
            return
        if length > limit:
            raise ValueError(f"{length} tokens exceed the model's context of {limit}")
        while capacity < length:
            capacity *= 2
        capacity = min(capacity, limit)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], capacity, *old.shape[2:])
            new[:, :kept] = old[:, :kept]
            setattr(self, name, new)


@dataclass
class Feed:
    """One sequence's part of a forward: ``n`` new tokens after ``start`` cached entries of ``kv``,
    and how many of its last rows' logits to return (``keep``).

    tree: None for a chain (token i at position and slot ``start + i``); else the tree part of the
    feed: the first ``n - len(tree)`` tokens are a chain and token ``n - len(tree) + j`` is tree
    node j, kept at slot ``start + n - len(tree) + j`` (see :mod:`~specgen.models.quantized.spans`)."""

    kv: KVBuffers
    start: int
    n: int
    keep: int
    tree: TreePart | None = None


@dataclass
class Layer:
    """One decoder layer's weights."""

    attention_norm: torch.Tensor  # [d]
    qkv: QuantLinear  # d -> (heads + 2 * kv_heads) * head_dim, with Qwen2's biases
    output: QuantLinear  # heads * head_dim -> d
    mlp_norm: torch.Tensor  # [d]
    gate_up: QuantLinear  # d -> 2 * intermediate
    down: QuantLinear  # intermediate -> d


def _fused(weights: list[torch.Tensor], biases: list[torch.Tensor | None], kind: str) -> QuantLinear:
    """One QuantLinear computing the [out_i, in] ``weights`` (with their [out_i] ``biases`` or None)
    side by side (per-output-channel and per-group scales stay each row's own, so fusing changes no output)."""
    bias = None if all(b is None for b in biases) else torch.cat([
        b if b is not None else torch.zeros(w.shape[0]) for b, w in zip(biases, weights)])
    return QuantLinear(torch.cat(weights), bias, kind)


class LeanLlama:
    """The forward of a Llama-family ``model`` (transformers, float32 weights on the CPU) on
    :class:`QuantLinear` layers of ``kind`` and an LM head of ``head_kind``; ``smoothing``
    (:mod:`~specgen.models.quantized.smooth`) is folded into the weights except those of
    :data:`WEIGHT_ONLY` kernels (whose grids it would move: a GGUF's blocks map onto int4's own)."""

    def __init__(self, model: torch.nn.Module, kind: str, head_kind: str, smoothing: Smoothing | None = None):
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.context_length = int(config.max_position_embeddings)
        decoder = model.model
        with torch.no_grad():
            self.embedding = decoder.embed_tokens.weight.detach().float().clone()  # [vocab', d]
            layer_smoothing = None if kind in WEIGHT_ONLY else smoothing  # weight-only kernels keep their grids
            self.layers = [self._layer(block, kind, index, layer_smoothing) for index, block in enumerate(decoder.layers)]
            self.norm = decoder.norm.weight.detach().float().clone()  # [d]
            self.feature_norm = self.norm  # [d]: the final norm as the model has it, for features
            head = model.get_output_embeddings().weight.detach().float()  # [vocab', d]
            if smoothing is not None and head_kind not in WEIGHT_ONLY:
                self.norm, head = smoothing.apply_head(self.norm, head)
            self.head = QuantLinear(head, None, head_kind)
            positions = torch.arange(self.context_length)[None]  # [1, P]
            cos, sin = decoder.rotary_emb(self.embedding[:1], positions)  # [1, P, head_dim] each
        half = self.head_dim // 2
        self.cos = cos[0].float().contiguous()  # [P, head_dim]
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).float().contiguous()  # [P, head_dim], signed

    def _layer(self, block: torch.nn.Module, kind: str, index: int, smoothing: Smoothing | None) -> Layer:
        attention, mlp = block.self_attn, block.mlp
        modules = dict(attention_norm=block.input_layernorm, mlp_norm=block.post_attention_layernorm,
                       q=attention.q_proj, k=attention.k_proj, v=attention.v_proj, output=attention.o_proj,
                       gate=mlp.gate_proj, up=mlp.up_proj, down=mlp.down_proj)
        w = {name: module.weight.detach().float().clone() for name, module in modules.items()}
        bias = {name: None if modules[name].bias is None else modules[name].bias.detach().float()
                for name in ("q", "k", "v")}
        if smoothing is not None:
            w["v_bias"] = bias["v"]
            smoothing.apply(index, w, self.heads, self.kv_heads)
            bias["v"] = w.pop("v_bias")
        return Layer(attention_norm=w["attention_norm"], mlp_norm=w["mlp_norm"],
                     qkv=_fused([w["q"], w["k"], w["v"]], [bias["q"], bias["k"], bias["v"]], kind),
                     output=_fused([w["output"]], [attention.o_proj.bias], kind),
                     gate_up=_fused([w["gate"], w["up"]], [None, None], kind), down=_fused([w["down"]], [None], kind))

    def linears(self) -> list[QuantLinear]:
        """Every QuantLinear, the LM head last."""
        return [linear for layer in self.layers
                for linear in (layer.qkv, layer.output, layer.gate_up, layer.down)] + [self.head]

    @property
    def memory_bytes(self) -> int:
        tables = [self.embedding, self.norm, self.cos, self.sin]
        tables += [self.feature_norm] if self.feature_norm is not self.norm else []
        tables += [t for layer in self.layers for t in (layer.attention_norm, layer.mlp_norm)]
        return sum(t.numel() * t.element_size() for t in tables) + sum(l.memory_bytes for l in self.linears())

    def new_buffers(self) -> KVBuffers:
        shape = (len(self.layers), min(FIRST_CAPACITY, self.context_length), self.kv_heads, self.head_dim)
        return KVBuffers(torch.zeros(shape), torch.zeros(shape))

    def forward(self, feeds: list[Feed], ids: torch.Tensor) -> torch.Tensor:
        """Feed each of ``feeds`` its ``n`` ids (``ids``: [sum n] long, the feeds' ids in order) after
        ``start`` cached entries of its own ``kv``, writing their keys and values at slots
        ``start..start + n - 1``; -> the last ``keep`` rows of each feed, in order: logits [sum keep, vocab']
        float32 (vocab' = the LM head's rows). A row's logits do not depend on the other feeds."""
        return self.logits(self.hidden(feeds, ids)[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normalised final hidden rows [rows, d] (:meth:`hidden`) -> logits [rows, vocab'] float32, row by row."""
        if not hidden.shape[0]:
            return hidden.new_zeros(0, self.head.out_features)
        return self.head(hidden)

    def hidden(self, feeds: list[Feed], ids: torch.Tensor, feature_layers: list[int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of :meth:`forward` up to the LM head: -> (the kept rows' normalised final hidden
        states [sum keep, d] float32, features [sum n, F] float32 of every fed row or None).

        feature_layers: None for no features; else the entries of a transformers ``hidden_states``
        tuple (0 = the embeddings, i = the output of layer i, the last entry normalised by the final
        norm; negative indices count from the end) as ``select_features`` picks them: the last entry
        for ``[]``, else the named entries concatenated (F = d * max(1, len(feature_layers)))."""
        for feed in feeds:
            feed.kv.reserve(feed.start + feed.n, feed.start, self.context_length)
            if feed.tree is None:
                last = feed.start + feed.n - 1  # the last query's position
            else:
                last = feed.start + feed.n - len(feed.tree) - 1 + max(feed.tree.depths())
            feed.kv.reserve(self._span(last), feed.start, self.context_length)  # the widest span's slots
        groups = [self._spans(feed) for feed in feeds]  # per feed, its queries by span; shared by every layer
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        if len(feeds) == 1 and feeds[0].tree is None:
            positions = slice(feeds[0].start, feeds[0].start + feeds[0].n)
        else:
            positions = torch.cat([positions_of(feed.start, feed.n, feed.tree) for feed in feeds])  # [T]
        cos, sin = self.cos[positions, None], self.sin[positions, None]  # [T, 1, head_dim]
        entries = self._entries(feature_layers)
        x = self.embedding[ids]  # [T, d]
        states = {0: x.clone()} if 0 in entries else {}  # hidden_states entry -> [T, d]
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv.native(_rms_norm(x, layer.attention_norm, self.eps))  # [T, (heads + 2 kv) * hd], bf16
            qkv = qkv.view(-1, heads + 2 * kv_heads, head_dim)
            rotated = _rope(qkv[:, :heads + kv_heads], cos, sin)  # [T, heads + kv, head_dim]
            queries = rotated[:, :heads].unflatten(1, (kv_heads, -1))  # [T, kv, groups, hd]: groups as queries
            mixed, order, offset = [], [], 0
            for feed, spans in zip(feeds, groups):
                end = offset + feed.n
                feed.kv.keys[index, feed.start:feed.start + feed.n] = rotated[offset:end, heads:]
                feed.kv.values[index, feed.start:feed.start + feed.n] = qkv[offset:end, heads + kv_heads:]
                for span in spans:  # [rows, kv, groups, hd] -> [rows, heads * hd] per span
                    mixed.append(self._attend(feed, span, index, offset, queries, rotated, qkv))
                    order.append(span.select + offset if span.select is not None else
                                 torch.arange(offset + span.row, offset + span.row + span.rows))
                if feed.tree is not None:  # the nodes back in node order (:mod:`spans`)
                    feed.kv.keys[index, feed.start:feed.start + feed.n] = rotated[offset:end, heads:]
                    feed.kv.values[index, feed.start:feed.start + feed.n] = qkv[offset:end, heads + kv_heads:]
                offset = end
            attended = mixed[0] if len(mixed) == 1 else torch.cat(mixed)  # [T, heads * hd], rows in ``order``
            if any(feed.tree is not None for feed in feeds):
                attended = attended[torch.cat(order).argsort()]
            x += layer.output.native(attended)
            gate, up = layer.gate_up(_rms_norm(x, layer.mlp_norm, self.eps)).chunk(2, dim=-1)  # [T, inter] each
            x += layer.down.native(F.silu(gate).mul_(up))
            if index + 1 in entries and index + 1 < len(self.layers):
                states[index + 1] = x.clone()
        last = len(self.layers)
        if last in entries:
            states[last] = _rms_norm(x, self.feature_norm, self.eps)
        features = None if feature_layers is None else torch.cat([states[e] for e in entries], dim=-1)  # [T, F]
        if len(feeds) == 1:
            kept = x[x.shape[0] - feeds[0].keep:]  # [keep, d]
        else:
            ends = torch.tensor([feed.n for feed in feeds]).cumsum(0).tolist()
            kept = x[torch.cat([torch.arange(end - feed.keep, end) for feed, end in zip(feeds, ends)])]
        return _rms_norm(kept, self.norm, self.eps), features  # [sum keep, d]

    def _entries(self, feature_layers: list[int] | None) -> list[int]:
        """The ``hidden_states`` entries (0..layers) that ``feature_layers`` names, in order (see :meth:`hidden`)."""
        if feature_layers is None:
            return []
        count = len(self.layers) + 1
        chosen = list(feature_layers) or [-1]
        if any(not -count <= e < count for e in chosen):
            raise ValueError(f"feature_layers {list(feature_layers)} name entries outside 0..{count - 1}")
        return [e % count for e in chosen]

    def _span(self, position: int) -> int:
        """How many cache slots a query at ``position`` attends over (the rest of them masked)."""
        return key_span(position, KEY_BUCKET, self.context_length)

    def _spans(self, feed: Feed) -> list[Span]:
        """A feed's queries grouped by span (:func:`~specgen.models.quantized.spans.spans_of`); call after
        the buffers are reserved."""
        return spans_of(feed.start, feed.n, feed.tree, feed.kv.keys, feed.kv.values, KEY_BUCKET, self.context_length)

    def _attend(self, feed: Feed, span: Span, layer: int, offset: int, queries: torch.Tensor, rotated: torch.Tensor,
                qkv: torch.Tensor) -> torch.Tensor:
        """One span's attention in ``layer`` (``offset``: the feed's first row of the forward's [T, ...]
        rows); a tree span first writes its path's keys and values after the chain. -> [rows, heads * hd]."""
        heads, kv_heads = self.heads, self.kv_heads
        if span.path is not None:
            base = feed.start + feed.n - len(feed.tree)
            rows = span.path + (base - feed.start + offset)  # [depth]: the path's rows of the forward
            feed.kv.keys[layer, base:base + len(rows)] = rotated[rows, heads:]
            feed.kv.values[layer, base:base + len(rows)] = qkv[rows, heads + kv_heads:]
        if span.select is None:
            mine = queries[offset + span.row:offset + span.row + span.rows]  # [rows, kv, groups, hd]
        else:
            mine = queries[span.select + offset]
        return F.scaled_dot_product_attention(mine, span.keys[layer], span.values[layer], attn_mask=span.mask,
                                              scale=self.scale).reshape(span.rows, -1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, d] -> [n, d], each row on its own (transformers' LlamaRMSNorm in float32, one op)."""
    return torch.rms_norm(x, weight.shape, weight, eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated by its positions' cos and signed sin [n, 1, head_dim] (rotate-half
    layout, the sin table's first half negated): ``x * cos + swap_halves(x) * sin``."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # [n, heads, head_dim]: second half first
    return torch.addcmul(x * cos, swapped, sin)
