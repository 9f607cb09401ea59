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

import torch

from specgen.drafters.base import EMPTY, Proposal
from specgen.drafters.learned import LearnedDrafter, LearnedSession, load_for_target
from specgen.errors import ConfigError


class EagleSession(LearnedSession):
    @torch.inference_mode()
    def propose(self, budget: int) -> Proposal:
        root = self.root(budget)
        if root is None:
            return EMPTY
        feature, token = root
        d = self.drafter
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        states: list[torch.Tensor] = []  # the head state each node's own step starts from, [d]
        frontier = [-1]
        frontier_scores = [0.0]
        state, logits = self.head.step(feature, torch.tensor([token], device=feature.device))  # [1, d], [1, Vd]
        for depth in range(1, budget + 1):
            logp, index = torch.log_softmax(logits.float(), dim=-1).topk(d.top_k, dim=-1)  # [F, k]
            ids = self.head.vocab_ids[index].tolist()
            level = []
            for f, parent in enumerate(frontier):
                for j in range(d.top_k):
                    level.append(len(tokens))
                    tokens.append(ids[f][j])
                    parents.append(parent)
                    scores.append(frontier_scores[f] + float(logp[f, j]))
                    states.append(state[f])
            if depth == budget:
                break
            frontier = sorted(level, key=lambda i: -scores[i])[: d.expand]
            frontier_scores = [scores[i] for i in frontier]
            state, logits = self.head.step(torch.stack([states[i] for i in frontier]),
                                           torch.tensor([tokens[i] for i in frontier], device=feature.device))
        keep = sorted(sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: d.nodes])
        new_index = {old: new for new, old in enumerate(keep)}
        return Proposal([tokens[i] for i in keep], None,
                        [-1 if parents[i] < 0 else new_index[parents[i]] for i in keep])


class EagleDrafter(LearnedDrafter):
    """num_tokens: the tree's maximum depth. top_k: children per expanded node.
    expand: nodes expanded per level. nodes: tree size after reranking."""

    name = "eagle"
    deterministic = True
    session_class = EagleSession

    def __init__(self, head, vocab_size: int, num_tokens: int, head_file=None, *, top_k: int = 4, expand: int = 4,
                 nodes: int = 16):
        super().__init__(head, vocab_size, num_tokens, head_file)
        for key, value in (("top_k", top_k), ("expand", expand), ("nodes", nodes)):
            if int(value) != value or value < 1:
                raise ConfigError(f"drafter.tree.{key} must be a positive integer, got {value}")
        self.top_k, self.expand, self.nodes = int(top_k), int(expand), int(nodes)


def build(*, runtime, head_file: str, num_tokens: int = 5, tree=None, kind: str = "eagle", head=None) -> EagleDrafter:
    """Hydra factory. ``tree``: {top_k, expand, nodes}; ``head`` (architecture) is read by specgen-train only."""
    loaded, path, vocab_size = load_for_target(runtime, head_file, "eagle")
    return EagleDrafter(loaded, vocab_size, num_tokens, path, **dict(tree or {}))
