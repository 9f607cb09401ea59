"""EAGLE drafter: a feature-level head drafting an EAGLE-2 style dynamic tree.

Expansion: the root step turns (target feature, newest token) into the first
level's candidates, the ``top_k`` most likely tokens. At each further level the
``expand`` candidates with the highest cumulative draft log-probability are
expanded the same way (one batched head step per level). Finally the ``nodes``
best candidates overall are kept (rerank); scores never increase along a path
and parents are created first, so the kept set contains every kept node's
ancestors.

The tree is deterministic (q one-hot per node), so tree verification is exact
for any choice of nodes. Children are ranked by the head's raw logits: masks and
penalties of the processor stack are enforced at verification, where a masked
candidate simply has p = 0.
"""

from __future__ import annotations

import math

import torch

from specgen.drafters.base import EMPTY, Proposal
from specgen.drafters.learned import LearnedDrafter, LearnedSession, load_for_target
from specgen.errors import ConfigError


class EagleSession(LearnedSession):
    @torch.inference_mode()
    def propose(self, budget: int) -> Proposal:
        """The tree is built on the head's device (scores, parents and frontiers are
        tensors) and read back once, after the rerank."""
        root = self.root(budget)
        if root is None:
            return EMPTY
        feature, token = root
        d, device = self.drafter, feature.device
        level_tokens: list[torch.Tensor] = []  # per level [F * k] target ids
        level_parents: list[torch.Tensor] = []  # per level [F * k] global node index of the parent (-1 = root)
        level_scores: list[torch.Tensor] = []  # per level [F * k] float64 cumulative draft log-probability
        frontier = torch.full((1,), -1, dtype=torch.long, device=device)  # [F] global node indices
        frontier_scores = torch.zeros(1, dtype=torch.float64, device=device)  # [F]
        offset = 0
        state, logits = self.head.step(feature, torch.tensor([token], device=device))  # [1, d], [1, Vd]
        for depth in range(1, budget + 1):
            logp, index = torch.log_softmax(logits.float(), dim=-1).topk(d.top_k, dim=-1)  # [F, k]
            width = logp.numel()
            ids = self.head.vocab_ids[index].reshape(-1)  # [F * k]
            scores = (frontier_scores.unsqueeze(-1) + logp.double()).reshape(-1)  # [F * k]
            level_tokens.append(ids)
            level_parents.append(frontier.repeat_interleave(d.top_k))
            level_scores.append(scores)
            if depth == budget:
                break
            chosen = torch.sort(scores, descending=True, stable=True).indices[: d.expand]  # [E] within the level
            frontier, frontier_scores = offset + chosen, scores[chosen]
            offset += width
            state, logits = self.head.step(state[chosen // d.top_k], ids[chosen])  # [E, d], [E, Vd]
        tokens, parents, scores = torch.cat(level_tokens), torch.cat(level_parents), torch.cat(level_scores)
        keep = torch.sort(torch.sort(scores, descending=True, stable=True).indices[: d.nodes]).values  # [N]
        rows = torch.stack([tokens[keep].double(), parents[keep].double(), scores[keep], keep.double()])
        kept_tokens, kept_parents, kept_scores, kept_index = rows.tolist()  # the one read of the round's draft
        new_index = {int(old): new for new, old in enumerate(kept_index)}
        return Proposal([int(t) for t in kept_tokens], None,
                        [-1 if p < 0 else new_index[int(p)] for p in kept_parents],
                        confidence=[math.exp(s) for s in kept_scores])  # cumulative draft probability


class EagleDrafter(LearnedDrafter):
    """num_tokens: the tree's maximum depth. top_k: children per expanded node.
    expand: nodes expanded per level. nodes: tree size after reranking."""

    name = "eagle"
    deterministic = True
    auto_max_tokens = 6
    session_class = EagleSession

    def __init__(self, head, vocab_size: int, num_tokens: int, head_file=None, *, top_k: int = 4, expand: int = 4,
                 nodes: int = 16):
        super().__init__(head, vocab_size, num_tokens, head_file)
        for key, value in (("top_k", top_k), ("expand", expand), ("nodes", nodes)):
            if int(value) != value or value < 1:
                raise ConfigError(f"drafter.tree.{key} must be a positive integer, got {value}")
        self.top_k, self.expand, self.nodes = int(top_k), int(expand), int(nodes)
        self.tree_width = min(self.top_k * self.expand, self.nodes)


def build(*, runtime, head_file: str, num_tokens: int = 5, tree=None, kind: str = "eagle", head=None,
          dtype=None) -> EagleDrafter:
    """Hydra factory. ``tree``: {top_k, expand, nodes}; ``head`` (architecture) is read by specgen-train only;
    ``dtype``: the head's dtype (None = the target's)."""
    loaded, path, vocab_size = load_for_target(runtime, head_file, "eagle", dtype)
    return EagleDrafter(loaded, vocab_size, num_tokens, path, **dict(tree or {}))
