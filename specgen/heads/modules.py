"""Learned draft heads: small modules on top of a frozen target.

Every head reads target *features* (hidden states the target computed anyway)
and reuses the target's token embedding and LM head, frozen and never stored
with the head: :meth:`DraftHead.attach` borrows them from the loaded target.
The LM head is cut to a *draft vocabulary* (``vocab_ids``, the most frequent
tokens); the head's distribution is zero outside it, which exact verification
handles like any other zero of q.

* :class:`EagleHead` -- EAGLE: fuse a feature with the next token's embedding,
  one decoder block, predict the next feature; recursive, drafts a tree.
  ``feature_layers`` picks EAGLE-3 style features from several target layers.
* :class:`MtpHead` -- sequential multi-token prediction (DeepSeek-V3 style
  normalised inputs), one shared module applied recursively for a chain.
* :class:`MedusaHead` -- K residual heads on the last feature, head k predicting
  the token k steps after the next one.

The EAGLE and MTP decoder blocks have no self-attention: a target feature
already summarises the whole prefix, and an attention-free block keeps draft
state to one vector per node (no draft KV cache to roll back). The ``eagle3``
kind (:mod:`specgen.heads.eagle3`; :mod:`specgen.heads.kinds` builds any kind) has one real attention layer over the
context and the draft path, with a per-request draft KV cache.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from specgen.models import packed_linear
from specgen.models.causal_lm import select_features


#: The most Medusa heads (head k predicts the token k + 1 ahead: more than a round's draft tokens are unused).
MAX_MEDUSA_HEADS = 64
#: Config fields only one kind reads: left out of other kinds' JSON (and so of their files and signatures).
_KIND_FIELDS = {"block_size": "dspark", "markov_rank": "dspark"}


@dataclass
class HeadConfig:
    """kind: eagle | eagle3 | mtp | medusa | dspark. hidden_size: the target's. feature_layers: target
    hidden-state indices concatenated into the input feature ([] = the final,
    normalised hidden state the LM head reads). num_heads: Medusa heads (K).
    intermediate_size: width of the decoder block's MLP. draft_vocab_size: len(vocab_ids).
    block_size, markov_rank: a dspark head's block positions (γ_max) and Markov rank r; stored
    (in :meth:`to_json`) for dspark heads only, so other kinds' configs read as before."""

    kind: str
    hidden_size: int
    draft_vocab_size: int
    feature_layers: list[int] = field(default_factory=list)
    intermediate_size: int = 1536
    num_heads: int = 4
    norm_eps: float = 1e-5
    num_attention_heads: int = 0  # eagle3: the attention layer's heads, KV heads and head size
    num_key_value_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    block_size: int = 6  # dspark: γ_max, the base rows one backbone pass produces
    markov_rank: int = 64  # dspark: r, the rank of the Markov correction

    def to_json(self) -> str:
        fields = asdict(self)
        for name, kind in _KIND_FIELDS.items():
            if self.kind != kind:
                fields.pop(name)
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HeadConfig:
        return cls(**json.loads(text))

    @property
    def feature_size(self) -> int:
        return self.hidden_size * max(1, len(self.feature_layers))


class Block(nn.Module):
    """Pre-norm SwiGLU MLP with a residual: [N, d] -> [N, d]."""

    def __init__(self, d: int, inner: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=eps)
        self.gate = nn.Linear(d, inner, bias=False)
        self.up = nn.Linear(d, inner, bias=False)
        self.down = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class DraftHead(nn.Module):
    """Base: holds the draft vocabulary and the borrowed, frozen target tensors."""

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).clone())  # [Vd] target ids
        self.embed_weight: torch.Tensor | None = None  # [V, d], frozen, borrowed
        self.lm_rows: torch.Tensor | None = None  # [Vd, d], frozen, borrowed
        self.packed_lm_rows: packed_linear.PackedWeight | None = None  # set by attach(packed=True)

    def attach(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, packed: bool = False) -> None:
        """Borrow the target's embedding [V, d] and LM head [V, d] (rows cut to the draft vocab).

        Call it after moving the head to its device and dtype: the cut LM-head
        rows (a copy anyway) are stored in the head's dtype, so a head may run in
        a dtype other than the target's (``drafter.dtype``) without a per-step cast.
        packed: draft logits and the head's linear layers run on oneDNN-packed weights
        where that applies (:mod:`specgen.models.packed_linear`; inference only)."""
        self.embed_weight = embed_weight.detach()
        self.lm_rows = lm_head_weight.detach()[self.vocab_ids.to(lm_head_weight.device)].to(self._dtype)
        self.packed_lm_rows = packed_linear.PackedWeight() if packed else None
        if packed:
            packed_linear.install(self)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] target ids -> [N, d] in the head's dtype."""
        return nn.functional.embedding(tokens, self.embed_weight).to(self.vocab_ids.device, self._dtype)

    def as_input(self, feature: torch.Tensor) -> torch.Tensor:
        """A target feature [..., F] (float32 from the round, or the target's dtype) in the head's dtype."""
        return feature.to(self.vocab_ids.device, self._dtype)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits over the draft vocabulary [..., Vd] (the head's dtype)."""
        if self.packed_lm_rows is not None:
            out = packed_linear.packed_product(hidden, self.lm_rows, None, self.packed_lm_rows)
            if out is not None:
                return out
        return hidden @ self.lm_rows.to(hidden.dtype).T

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


class RecursiveHead(DraftHead):
    """A head applied recursively: step(state, tokens) -> (next state [N, d], logits [N, Vd]).
    The first state is a target feature [N, F] (reduced to d when F != d), later ones its own."""

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor):
        super().__init__(cfg, vocab_ids)
        d = cfg.hidden_size
        self.reduce = nn.Linear(cfg.feature_size, d, bias=False) if cfg.feature_size != d else None

    def _as_state(self, state: torch.Tensor) -> torch.Tensor:
        state = self.as_input(state)
        if self.reduce is not None and state.shape[-1] != self.cfg.hidden_size:
            return self.reduce(state)
        return state


class EagleHead(RecursiveHead):
    """step(feature, token): feature [N, F] (a target feature) or [N, d] (a
    predicted one), token [N] the token that follows it -> next feature [N, d]."""

    kind = "eagle"

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor):
        super().__init__(cfg, vocab_ids)
        d = cfg.hidden_size
        self.fuse = nn.Linear(2 * d, d, bias=False)
        self.block = Block(d, cfg.intermediate_size, cfg.norm_eps)
        self.out_norm = nn.RMSNorm(d, eps=cfg.norm_eps)

    def step(self, feature: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (next feature [N, d], draft logits [N, Vd])."""
        x = self.fuse(torch.cat([self._as_state(feature), self.embed(tokens)], dim=-1))
        nxt = self.out_norm(self.block(x))
        return nxt, self.draft_logits(nxt)


class MtpHead(RecursiveHead):
    """DeepSeek-V3 style MTP depth, shared across depths: RMSNorm(state) and
    RMSNorm(embedding) -> projection -> block -> next state; logits from the
    normalised state. state [N, F] (target feature) or [N, d] (own state)."""

    kind = "mtp"

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor):
        super().__init__(cfg, vocab_ids)
        d = cfg.hidden_size
        self.state_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.embed_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = Block(d, cfg.intermediate_size, cfg.norm_eps)
        self.out_norm = nn.RMSNorm(d, eps=cfg.norm_eps)

    def step(self, state: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (next state [N, d], draft logits [N, Vd])."""
        x = self.proj(torch.cat([self.state_norm(self._as_state(state)), self.embed_norm(self.embed(tokens))], dim=-1))
        nxt = self.block(x)
        return nxt, self.draft_logits(self.out_norm(nxt))


class MedusaHead(DraftHead):
    """K heads of one residual SiLU layer each on the final target feature.

    forward(feature [N, d]) -> logits [K, N, Vd]; with the feature of the token
    at position i, head k (0-based) predicts position i + 2 + k (the target's own
    LM head predicts i + 1)."""

    kind = "medusa"

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor):
        super().__init__(cfg, vocab_ids)
        d = cfg.hidden_size
        self.heads = nn.ModuleList(nn.Linear(d, d) for _ in range(cfg.num_heads))
        for head in self.heads:
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    def forward(self, feature: torch.Tensor) -> torch.Tensor:
        feature = self.as_input(feature)
        hidden = torch.stack([feature + nn.functional.silu(head(feature)) for head in self.heads])  # [K, N, d]
        return self.draft_logits(hidden)


__all__ = ["DraftHead", "EagleHead", "HeadConfig", "MedusaHead", "MtpHead", "select_features"]
