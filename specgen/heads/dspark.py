"""The DSpark head: a semi-autoregressive block drafter.

One *backbone* pass reads the target feature of the newest processed token and
the embedding of the newest committed token and produces ``block_size`` (γ_max)
base logit rows U_1..U_γ over the draft vocabulary at once:

    x    = fuse(RMSNorm(feature), RMSNorm(embedding(token)))          [N, d]
    h_k  = RMSNorm(Block(x + position_k))                              [N, γ, d]
    U_k  = LM head rows of the draft vocabulary applied to h_k         [N, γ, Vd]

A low-rank *Markov* head then corrects position k with the token x_{k-1} drawn
just before it (x_0 = the newest committed token):

    logits_k(v) = U_k(v) + W1[x_{k-1}] · W2[:, v]

with W1 [Vd + 1, r] (``markov_in``; row Vd stands for every token outside the
draft vocabulary) and W2 [r, Vd] (``markov_out``, zero at initialisation, so an
untrained correction is 0). A *confidence* c_k = sigmoid(w · [h_k, W1[x_{k-1}]] + b)
in [0, 1] estimates the probability that the token drawn at k is accepted; it
reads the backbone state of k and the token drawn before k, never the token drawn
at k, so a drafter may stop a chain on it before drawing (a stopping time of the
drafter's own information). Training fits c_k to c*_k = 1 - TV(q_k, p_k)
(:func:`specgen.train.losses.confidence_target`).

The backbone's positions do not attend to one another: each base row is a
function of (feature, token, k), so a round computes all of them in one pass and
the chain's sequential part is the Markov correction alone (a rank-r product).
"""

from __future__ import annotations

import torch
from torch import nn

from specgen.heads.modules import Block, DraftHead, HeadConfig


class DsparkHead(DraftHead):
    """See the module docstring. ``vocab_ids`` is fixed at construction (as for every head);
    the target-id -> draft-index lookup the Markov head reads is derived from it."""

    kind = "dspark"

    def __init__(self, cfg: HeadConfig, vocab_ids: torch.Tensor):
        super().__init__(cfg, vocab_ids)
        if cfg.block_size < 1 or cfg.markov_rank < 1:
            raise ValueError(f"a dspark head needs block_size >= 1 and markov_rank >= 1, got {cfg}")
        d, r, vd = cfg.hidden_size, cfg.markov_rank, cfg.draft_vocab_size
        self.reduce = nn.Linear(cfg.feature_size, d, bias=False) if cfg.feature_size != d else None
        self.feature_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.embed_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.fuse = nn.Linear(2 * d, d, bias=False)
        self.positions = nn.Parameter(torch.randn(cfg.block_size, d) * 0.5)  # [γ, d]
        self.backbone = Block(d, cfg.intermediate_size, cfg.norm_eps)
        self.out_norm = nn.RMSNorm(d, eps=cfg.norm_eps)
        self.markov_in = nn.Embedding(vd + 1, r)  # W1 [Vd + 1, r]
        nn.init.normal_(self.markov_in.weight, 0.0, r ** -0.5)
        self.markov_out = nn.Parameter(torch.zeros(r, vd))  # W2 [r, Vd]
        self.confidence_head = nn.Linear(d + r, 1)
        nn.init.zeros_(self.confidence_head.bias)
        self._index_from(self.vocab_ids)

    def _index_from(self, vocab_ids: torch.Tensor) -> None:
        sorted_ids, order = vocab_ids.sort()
        self.register_buffer("sorted_ids", sorted_ids, persistent=False)  # [Vd] ascending target ids
        self.register_buffer("sorted_order", order, persistent=False)  # [Vd] their draft indices

    def attach(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, packed: bool = False) -> None:
        super().attach(embed_weight, lm_head_weight, packed)
        self._index_from(self.vocab_ids)

    def draft_index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids [...] -> draft indices [...] in [0, Vd], Vd for ids outside the draft vocabulary."""
        tokens = tokens.to(self.sorted_ids.device).contiguous()
        slot = torch.searchsorted(self.sorted_ids, tokens).clamp_max(self.sorted_ids.numel() - 1)
        found = self.sorted_ids[slot] == tokens
        return torch.where(found, self.sorted_order[slot], torch.full_like(slot, self.sorted_ids.numel()))

    def block(self, feature: torch.Tensor, tokens: torch.Tensor,
              count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The backbone, once per round: feature [N, F] (a target feature), tokens [N] (the newest
        committed target ids) -> (states [N, K, d], base rows U [N, K, Vd]), K = ``count``
        (at most block_size; None = block_size) positions, computed in one pass."""
        count = self.cfg.block_size if count is None else count
        if not 1 <= count <= self.cfg.block_size:
            raise ValueError(f"a dspark head drafts 1..{self.cfg.block_size} positions, asked for {count}")
        feature = self.as_input(feature)
        if self.reduce is not None and feature.shape[-1] != self.cfg.hidden_size:
            feature = self.reduce(feature)
        x = self.fuse(torch.cat([self.feature_norm(feature), self.embed_norm(self.embed(tokens))], dim=-1))  # [N, d]
        states = self.out_norm(self.backbone(x.unsqueeze(1) + self.positions[:count]))  # [N, K, d]
        return states, self.draft_logits(states)

    def _markov_rows(self, previous: torch.Tensor) -> torch.Tensor:
        """previous [...] target ids -> W1 rows [..., r]."""
        return self.markov_in(self.draft_index(previous))

    def markov(self, base: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """base rows [..., Vd] of position k, previous [...] the target ids x_{k-1} -> logits_k [..., Vd]."""
        return base + self._markov_rows(previous) @ self.markov_out.to(base.dtype)

    def confidence_logit(self, state: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """state [..., d] of position k, previous [...] target ids x_{k-1} -> the logit of c_k [...]."""
        rows = self._markov_rows(previous).to(state.dtype)
        return self.confidence_head(torch.cat([state, rows], dim=-1)).squeeze(-1)

    def confidence(self, state: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """c_k in [0, 1], shapes as :meth:`confidence_logit`."""
        return torch.sigmoid(self.confidence_logit(state, previous).float())

    def teacher_forced(self, feature: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training: feature [B, F] at start i, tokens [D, B] (tokens[k - 1] = the data's token i + k:
        the block's input token for k = 1, and x_{k-1} for every position k) -> (logits [D, B, Vd],
        confidence logits [D, B]) of positions 1..D, each predicting the target's distribution at i + k."""
        depth = tokens.shape[0]
        states, base = self.block(feature, tokens[0], depth)  # [B, D, d], [B, D, Vd]
        previous = tokens.transpose(0, 1)  # [B, D]
        logits = self.markov(base, previous).transpose(0, 1)  # [D, B, Vd]
        return logits, self.confidence_logit(states, previous).transpose(0, 1)
