"""EAGLE drafter: a feature-level head drafting an EAGLE-2 style dynamic tree.

Expansion: the root step turns (target feature, newest token) into the first
level's candidates, the ``top_k`` most likely tokens. At each further level the
``expand`` candidates with the highest cumulative draft log-probability are
expanded the same way (one batched head step per level). Finally the ``nodes``
best candidates overall are kept (rerank); scores never increase along a path
and parents are created first, so the kept set contains every kept node's
ancestors.

The tree is deterministic (q one-hot per node), so tree verification is exact
for any choice of nodes. Children are ranked by the head's draft distribution;
under a grammar, by the *masked* draft distribution of the node's path (see
:mod:`specgen.drafters.tree_grammar`), so every drafted node is a token the
grammar allows there. Penalties and the other processors are enforced at
verification, where a forbidden candidate simply has p = 0.
"""

from __future__ import annotations

import math

import torch

from specgen.drafters.base import EMPTY, Proposal
from specgen.drafters.learned import LearnedDrafter, LearnedSession, load_for_target
from specgen.drafters.tree_grammar import masked_log_softmax
from specgen.errors import ConfigError


class EagleSession(LearnedSession):
    @torch.inference_mode()
    def propose(self, budget: int) -> Proposal:
        """The tree is built on the head's device (scores, parents and frontiers are
        tensors) and read back once, after the rerank; under a grammar also once per
        expanded level (the grammar walks the chosen tokens on the host)."""
        root = self.root(budget)
        if root is None:
            return EMPTY
        feature, token = root
        grammar_root = self.grammar.root(self.ctx.committed) if self.grammar is not None else None
        states = None if grammar_root is None else [grammar_root]  # grammar state per frontier node
        d, device = self.drafter, feature.device
        level_tokens: list[torch.Tensor] = []  # per level [F * k] target ids
        level_parents: list[torch.Tensor] = []  # per level [F * k] global node index of the parent (-1 = root)
        level_scores: list[torch.Tensor] = []  # per level [F * k] float64 cumulative draft log-probability
        frontier = torch.full((1,), -1, dtype=torch.long, device=device)  # [F] global node indices
        frontier_scores = torch.zeros(1, dtype=torch.float64, device=device)  # [F]
        offset = 0
        state, logits = self.first_step(feature, token)  # [1, d], [1, Vd]
        for depth in range(1, budget + 1):
            if states is None:
                logp = torch.log_softmax(logits.float(), dim=-1)  # [F, Vd]
            else:
                logp = masked_log_softmax(logits, self.grammar.allowed(states, depth))  # [F, Vd]
            logp, index = logp.topk(d.top_k, dim=-1)  # [F, k]
            width = logp.numel()
            ids = self.head.vocab_ids[index].reshape(-1)  # [F * k]
            scores = (frontier_scores.unsqueeze(-1) + logp.double()).reshape(-1)  # [F * k]
            level_tokens.append(ids)
            level_parents.append(frontier.repeat_interleave(d.top_k))
            level_scores.append(scores)
            if depth == budget:
                break
            chosen = torch.sort(scores, descending=True, stable=True).indices[: d.expand]  # [E] within the level
            if states is not None:
                states = self._walk(states, chosen, ids, scores)
                if states is None:
                    break
            frontier, frontier_scores = offset + chosen, scores[chosen]
            offset += width
            state, logits = self.next_step(state, chosen // d.top_k, ids[chosen], depth)  # [E, d], [E, Vd]
        return self._rerank(torch.cat(level_tokens), torch.cat(level_parents), torch.cat(level_scores))

    def first_step(self, feature: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The root: (target feature [1, F], newest committed token) -> (state [1, d], logits [1, Vd])."""
        return self.head.step(feature, torch.tensor([token], device=feature.device))

    def next_step(self, states: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                  depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expand the chosen nodes of level ``depth``: their parents are rows ``rows`` [E] of the
        previous step's ``states``, their tokens ``tokens`` [E] -> (states [E, d], logits [E, Vd])."""
        return self.head.step(states[rows], tokens)

    def _walk(self, states: list, chosen: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor) -> list | None:
        """Grammar states of the chosen nodes (one host read); None when none of them has a
        finite score, i.e. the grammar allows nothing below this level."""
        picked, tokens, finite = torch.stack([chosen.double(), ids[chosen].double(), scores[chosen]]).tolist()
        if all(math.isinf(s) for s in finite):
            return None
        k = self.drafter.top_k
        return [self.grammar.advance(states[int(c) // k], int(t)) for c, t in zip(picked, tokens, strict=True)]

    def _rerank(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> Proposal:
        """Keep the ``nodes`` best of all drafted nodes [M] (and never one with score -inf:
        a token the grammar forbids); the one read of the round's draft."""
        keep = torch.sort(torch.sort(scores, descending=True, stable=True).indices[: self.drafter.nodes]).values  # [N]
        rows = torch.stack([tokens[keep].double(), parents[keep].double(), scores[keep], keep.double()])
        kept = [row for row in zip(*rows.tolist(), strict=True) if not math.isinf(row[2])]
        if not kept:
            return EMPTY  # the grammar allows no draft-vocabulary token here
        new_index = {int(old): new for new, (_, _, _, old) in enumerate(kept)}
        return Proposal([int(t) for t, _, _, _ in kept], None,
                        [-1 if p < 0 else new_index[int(p)] for _, p, _, _ in kept],
                        confidence=[math.exp(s) for _, _, s, _ in kept])  # cumulative draft probability


class Eagle3Session(EagleSession):
    """An attention head's session (:mod:`specgen.heads.eagle3`): it also keeps the
    head's keys and values of every committed context node (the draft KV cache)
    and the target features not yet turned into context nodes. All of it is part
    of :meth:`mark` (tensors are replaced, never written in place), so a rolled-back
    round restores it exactly. Draft nodes' keys and values live for one proposal.

    Context node j (absolute position ``base + j``) reads the target feature at that
    position and the committed token after it; rotary positions count from ``base``.
    """

    def __init__(self, drafter, ctx):
        super().__init__(drafter, ctx)
        self.base = 0
        self.keys: torch.Tensor | None = None  # [C, KV, hd]: context nodes at base .. base + C - 1
        self.values: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None  # [m, F]: features of positions base + C .. base + C + m - 1
        self._draft: tuple | None = None  # this proposal's draft nodes: (keys, values, ancestors [A, A], rows)

    @property
    def cached(self) -> int:
        return 0 if self.keys is None else self.keys.shape[0]

    def observe_features(self, position: int, features: torch.Tensor) -> None:
        super().observe_features(position, features)
        first = position - features.shape[0] + 1
        done = self.base + self.cached  # the first position without a context node
        known = done + (0 if self.pending is None else self.pending.shape[0])
        if (self.keys is None and self.pending is None) or not done <= first <= known:
            self.base, self.keys, self.values, self.pending = first, None, None, features  # start afresh
            return
        self.pending = features if first == done else torch.cat([self.pending[: first - done], features])

    def mark(self):
        return super().mark(), self.base, self.keys, self.values, self.pending

    def rollback(self, mark) -> None:
        inner, self.base, self.keys, self.values, self.pending = mark
        super().rollback(inner)

    def first_step(self, feature: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Turn the pending features into context nodes (the last one is the root) in one head forward."""
        head, tokens = self.head, self.ctx.committed.tokens
        device, start = head.vocab_ids.device, self.cached
        if self.pending is None:  # the root is already a context node (a second proposal): recompute its output
            root = torch.tensor([tokens[-1]], device=device)
            state, logits, _, _ = head.forward_nodes(feature, root, torch.tensor([start - 1], device=device),
                                                     self.keys[:-1], self.values[:-1])
            self._draft = None
            return state, logits
        count = self.pending.shape[0]
        first = self.base + start
        nxt = torch.tensor(tokens[first + 1: first + count + 1], device=device)  # [m] the token each node reads
        positions = torch.arange(start, start + count, device=device)  # [m]
        state, logits, keys, values = head.forward_nodes(self.pending.to(device), nxt, positions, self.keys,
                                                         self.values)
        self.keys = keys if self.keys is None else torch.cat([self.keys, keys])
        self.values = values if self.values is None else torch.cat([self.values, values])
        self.pending, self._draft = None, None
        return state[-1:], logits[-1:]

    def next_step(self, states: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                  depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft nodes at ``depth`` attend to every context node, their draft ancestors and themselves."""
        device, count = tokens.device, tokens.shape[0]
        if depth == 1 or self._draft is None:  # children of the root: no draft ancestors yet
            old_k = old_v = None
            ancestors = torch.zeros(count, 0, dtype=torch.bool, device=device)  # [E, A]
        else:
            old_k, old_v, old_anc, parent_index = self._draft
            parents = parent_index[rows]  # [E] indices among earlier draft nodes
            ancestors = old_anc[parents] | torch.nn.functional.one_hot(parents, old_anc.shape[1]).bool()
        total = ancestors.shape[1]
        allowed = torch.cat([torch.ones(count, self.cached, dtype=torch.bool, device=device), ancestors,
                             torch.eye(count, dtype=torch.bool, device=device)], dim=1)  # [E, C + A + E]
        past_k = self.keys if old_k is None else torch.cat([self.keys, old_k])
        past_v = self.values if old_v is None else torch.cat([self.values, old_v])
        positions = torch.full((count,), self.cached - 1 + depth, device=device)
        state, logits, keys, values = self.head.forward_nodes(states[rows], tokens, positions, past_k, past_v, allowed)
        grown = torch.zeros(total + count, total + count, dtype=torch.bool, device=device)
        if total:
            grown[:total, :total] = self._draft[2]
        grown[total:, :total] = ancestors
        self._draft = (keys if old_k is None else torch.cat([old_k, keys]),
                       values if old_v is None else torch.cat([old_v, values]), grown,
                       torch.arange(total, total + count, device=device))
        return state, logits


class EagleDrafter(LearnedDrafter):
    """num_tokens: the tree's maximum depth. top_k: children per expanded node.
    expand: nodes expanded per level. nodes: tree size after reranking."""

    name = "eagle"
    shape = "tree"
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
        if head.cfg.kind == "eagle3":
            self.session_class = Eagle3Session
        self.tree_width = min(self.top_k * self.expand, self.nodes)

    @property
    def max_nodes(self) -> int:
        return min(self.nodes, self.tree_width * self.max_tokens)


def build(*, runtime, head_file: str, num_tokens: int = 5, tree=None, kind: str = "eagle", head=None,
          dtype=None) -> EagleDrafter:
    """Hydra factory. ``tree``: {top_k, expand, nodes}; ``head`` (architecture) is read by specgen-train only;
    ``dtype``: the head's dtype (None = the target's)."""
    loaded, path, vocab_size = load_for_target(runtime, head_file, ("eagle", "eagle3"), dtype)
    return EagleDrafter(loaded, vocab_size, num_tokens, path, **dict(tree or {}))
