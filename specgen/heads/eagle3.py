"""The EAGLE-3 head: one decoder layer *with* self-attention over the draft path.

Layout (parameter names follow the published EAGLE-3 checkpoints, so export is a
renaming, see :mod:`specgen.heads.export`):

* ``fc`` [d, F]: fuses the target's low, middle and high features (F = 3d) into d;
* ``midlayer``: ``input_layernorm`` on the token embedding, ``hidden_norm`` on the
  hidden input, their concatenation [2d] into ``self_attn`` (q/k/v from 2d,
  rotary positions), a residual onto the hidden input, then
  ``post_attention_layernorm`` and a SwiGLU ``mlp`` with a residual;
* ``norm``: the final norm before the (borrowed, frozen) draft-vocabulary LM head.

A *node* is (hidden input, token): a context node j reads the target feature at
position j and the committed token j + 1; a draft node reads its parent's
output state (the pre-norm hidden) and its own drafted token. Node j's output
predicts the token after its input token. A context node attends to context
nodes <= j; a draft node at depth k below context node P sits at rotary
position P + k and attends to every context node <= P, its draft ancestors and
itself. Keys and values of context nodes are cached per request (the session's
draft KV cache, part of the round's transaction); draft nodes' live for one
round.

Training uses *training-time test* (:meth:`Eagle3Head.ttt_logits`): step 1 runs
the teacher-forced context nodes with causal attention, step k feeds step k - 1's
own outputs and attends to the step-1 keys <= i plus the diagonal keys of steps
2..k at the same start i, exactly the keys a depth-k draft node sees when decoding.
"""

from __future__ import annotations

import torch
from torch import nn

from specgen.heads.modules import DraftHead, HeadConfig


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half convention): x [..., N, heads, hd], positions [..., N]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))  # [hd / 2]
    angles = positions.to(torch.float32).unsqueeze(-1) * inv  # [..., N, hd / 2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).unsqueeze(-2).to(x.dtype)  # [..., N, 1, hd]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).unsqueeze(-2).to(x.dtype)
    half = hd // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _Attention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * d, h * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, kv * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)


class _Mlp(nn.Module):
    def __init__(self, d: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.norm_eps
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.hidden_norm = nn.RMSNorm(d, eps=eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.mlp = _Mlp(d, cfg.intermediate_size)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """q [N, H, hd], keys/values [M, KV, hd], allowed [N, M] bool (None: all) -> [N, H, hd]."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, M, hd]
    v = values.repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)).float() * q.shape[-1] ** -0.5  # [H, N, M]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return (weights @ v).transpose(0, 1)  # [N, H, hd]


class Eagle3Head(DraftHead):
    """See the module docstring. States are pre-norm hiddens [N, d]."""

    kind = "eagle3"

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor):
        super().__init__(cfg, vocab_ids)
        if min(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) < 1 or \
                cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(f"an eagle3 head needs positive num_attention_heads (a multiple of "
                             f"num_key_value_heads) and head_dim, got {cfg}")
        d = cfg.hidden_size
        self.fc = nn.Linear(cfg.feature_size, d, bias=False) if cfg.feature_size != d else None
        self.midlayer = _Layer(cfg)
        self.norm = nn.RMSNorm(d, eps=cfg.norm_eps)

    def _hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """A target feature [..., F] or an own state [..., d] -> [..., d] in the head's dtype."""
        hidden = self.as_input(hidden)
        if self.fc is not None and hidden.shape[-1] != self.cfg.hidden_size:
            return self.fc(hidden)
        return hidden

    def project(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """Nodes (hidden [..., N, F or d], tokens [..., N]) at ``positions`` [..., N] ->
        (q [..., N, H, hd], k and v [..., N, KV, hd], residual [..., N, d])."""
        cfg, layer = self.cfg, self.midlayer
        residual = self._hidden(hidden)
        x = torch.cat([layer.input_layernorm(self.embed(tokens.reshape(-1)).reshape(*residual.shape)),
                       layer.hidden_norm(residual)], dim=-1)  # [..., N, 2d]
        lead = x.shape[:-1]
        attn = layer.self_attn
        q = attn.q_proj(x).reshape(*lead, cfg.num_attention_heads, cfg.head_dim)
        k = attn.k_proj(x).reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        v = attn.v_proj(x).reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        return rotate(q, positions, cfg.rope_theta), rotate(k, positions, cfg.rope_theta), v, residual

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attended [..., N, H, hd], residual [..., N, d] -> (state [..., N, d], draft logits [..., N, Vd])."""
        layer = self.midlayer
        h = residual + layer.self_attn.o_proj(attended.flatten(-2))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, self.draft_logits(self.norm(h))

    def forward_nodes(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                      past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                      allowed: torch.Tensor | None = None):
        """N nodes attending to ``past`` keys/values [P, KV, hd] and to each other.

        allowed: [N, P + N] bool, or None = every past key and causally among the N.
        Returns (states [N, d], logits [N, Vd], k [N, KV, hd], v [N, KV, hd]) -- the
        new nodes' keys and values, for a cache to append."""
        q, k, v, residual = self.project(hidden, tokens, positions)
        n = q.shape[0]
        keys = k if past_k is None else torch.cat([past_k, k])
        values = v if past_v is None else torch.cat([past_v, v])
        if allowed is None:
            past = keys.shape[0] - n
            allowed = torch.ones(n, past + n, dtype=torch.bool, device=q.device)
            allowed[:, past:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        state, logits = self.finish(attend(q, keys, values, allowed), residual)
        return state, logits, k, v

    def ttt_logits(self, inputs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Training-time test over windows: inputs [B, T, F] target features of
        consecutive positions, tokens [D, B, T] (tokens[k][b][i]: the token step k + 1
        reads at start i) -> draft logits [D, B, T, Vd]."""
        b, t = inputs.shape[:2]
        device = inputs.device
        base = torch.arange(t, device=device).expand(b, t)  # [B, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()  # [T, T]
        scale = self.cfg.head_dim ** -0.5
        groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        out, hidden = [], inputs
        ctx_k = ctx_v = None
        diag_k: list[torch.Tensor] = []
        diag_v: list[torch.Tensor] = []
        for step in range(tokens.shape[0]):
            q, k, v, residual = self.project(hidden, tokens[step], base + step)  # [B, T, H|KV, hd]
            if step == 0:
                ctx_k = k.repeat_interleave(groups, dim=2)  # [B, T, H, hd]
                ctx_v = v.repeat_interleave(groups, dim=2)
            else:
                diag_k.append(k.repeat_interleave(groups, dim=2))
                diag_v.append(v.repeat_interleave(groups, dim=2))
            scores = torch.einsum("bihd,bjhd->bhij", q, ctx_k).float() * scale  # [B, H, T, T]
            scores = scores.masked_fill(~causal, float("-inf"))
            own = [(q * dk).sum(-1).float().transpose(1, 2).unsqueeze(-1) * scale for dk in diag_k]  # [B, H, T, 1]
            weights = torch.softmax(torch.cat([scores, *own], dim=-1), dim=-1).to(q.dtype)
            attended = torch.einsum("bhij,bjhd->bihd", weights[..., :t], ctx_v)  # [B, T, H, hd]
            for m, dv in enumerate(diag_v):
                attended = attended + weights[..., t + m].transpose(1, 2).unsqueeze(-1) * dv
            hidden, logits = self.finish(attended, residual)
            out.append(logits)
        return torch.stack(out)
