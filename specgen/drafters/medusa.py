"""Medusa drafter: K heads on the target feature, a static tree from config.

``tree`` is a list of index paths, like Medusa's choices files: ``[1, 0]`` is
the node whose first token is head 0's second most likely token and whose second
token is head 1's most likely one. Every prefix of a listed path must be listed
too. Nodes deeper than the round's budget are dropped. Candidates are
deterministic (q one-hot), ranked by the heads' distributions; under a grammar,
by the *masked* distribution after the node's parent path (ranks count allowed
tokens only, see :mod:`specgen.drafters.tree_grammar`), so every drafted node is
a token the grammar allows there.
"""

from __future__ import annotations

import math

import torch

from specgen.drafters.base import EMPTY, Proposal
from specgen.drafters.learned import LearnedDrafter, LearnedSession, load_for_target
from specgen.drafters.tree_grammar import masked_log_softmax
from specgen.errors import ConfigError

DEFAULT_TREE = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
                [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]


def validate_tree(tree, num_heads: int) -> list[tuple[int, ...]]:
    """Sorted, de-duplicated paths; a clear error for anything malformed."""
    paths = set()
    for entry in tree:
        path = tuple(entry) if isinstance(entry, (list, tuple)) else None
        if not path or not all(isinstance(i, int) and i >= 0 for i in path):
            raise ConfigError(f"drafter.tree entries must be non-empty lists of non-negative ints, got {entry!r}")
        if len(path) > num_heads:
            raise ConfigError(f"drafter.tree path {list(path)} is deeper than the head's {num_heads} Medusa heads")
        paths.add(path)
    if not paths:
        raise ConfigError("drafter.tree is empty; give at least one path, e.g. drafter.tree=[[0],[1],[0,0]]")
    for path in paths:
        if len(path) > 1 and path[:-1] not in paths:
            raise ConfigError(f"drafter.tree lists {list(path)} but not its parent {list(path[:-1])}")
    return sorted(paths, key=lambda p: (len(p), p))


class MedusaSession(LearnedSession):
    @torch.inference_mode()
    def propose(self, budget: int) -> Proposal:
        root = self.root(budget)
        if root is None:
            return EMPTY
        feature, _ = root
        d = self.drafter
        paths = [p for p in d.tree if len(p) <= budget]
        logits = self.head(feature)[:, 0]  # [K, Vd]
        grammar_root = self.grammar.root(self.ctx.committed) if self.grammar is not None else None
        if grammar_root is not None:
            return self._masked(paths, logits, grammar_root)
        probs, top = torch.softmax(logits.float(), dim=-1).topk(d.width, dim=-1)  # [K, width] each
        ids = self.head.vocab_ids[top].tolist()
        probs = probs.tolist()
        index = {path: i for i, path in enumerate(paths)}
        tokens = [ids[len(path) - 1][path[-1]] for path in paths]
        parents = [index[path[:-1]] if len(path) > 1 else -1 for path in paths]
        return Proposal(tokens, None, parents, confidence=[math.prod(probs[k][rank] for k, rank in enumerate(path))
                                                           for path in paths])  # product of head probabilities

    def _masked(self, paths: list[tuple[int, ...]], logits: torch.Tensor, grammar_root) -> Proposal:
        """The tree under a grammar: the node at ``path`` is the ``path[-1]``-th most likely
        token of head ``len(path) - 1`` *among those the grammar allows after its parent's
        path* (the masked, renormalised distribution). A rank beyond what the grammar
        allows drops the node and its subtree. One host read per tree level."""
        d, grammar = self.drafter, self.grammar
        kept = {(): (-1, grammar_root, 1.0)}  # path -> (node index, grammar state, path probability)
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        for depth in range(1, max((len(p) for p in paths), default=0) + 1):
            level = [p for p in paths if len(p) == depth and p[:-1] in kept]
            expanded = sorted({p[:-1] for p in level})  # the parents expanded at this level
            if not expanded:
                break
            allowed = grammar.allowed([kept[h][1] for h in expanded], depth)  # [P, Vd]
            logp = masked_log_softmax(logits[depth - 1].expand(len(expanded), -1), allowed)  # [P, Vd]
            top_logp, top = logp.topk(d.width, dim=-1)  # [P, width] each
            ids, logps = torch.stack([self.head.vocab_ids[top].double(), top_logp.double()]).tolist()
            row = {h: i for i, h in enumerate(expanded)}
            for path in level:
                parent, state, prob = kept[path[:-1]]
                token, lp = int(ids[row[path[:-1]]][path[-1]]), logps[row[path[:-1]]][path[-1]]
                if math.isinf(lp):
                    continue
                kept[path] = (len(tokens), grammar.advance(state, token), prob * math.exp(lp))
                tokens.append(token)
                parents.append(parent)
                confidence.append(kept[path][2])  # product of masked head probabilities
        if not tokens:
            return EMPTY  # the grammar allows no draft-vocabulary token here
        return Proposal(tokens, None, parents, confidence=confidence)


class MedusaDrafter(LearnedDrafter):
    """num_tokens: maximum tree depth (at most the number of heads)."""

    name = "medusa"
    shape = "tree"
    deterministic = True
    session_class = MedusaSession

    def __init__(self, head, vocab_size: int, num_tokens: int, head_file=None, *, tree=None):
        super().__init__(head, vocab_size, num_tokens, head_file)
        paths = validate_tree(tree if tree is not None else DEFAULT_TREE, head.cfg.num_heads)
        self.tree = [p for p in paths if len(p) <= self.max_tokens]
        self.tree_width = max(1, len(self.tree) // max(len(p) for p in self.tree))
        self.width = max(p[-1] for p in self.tree) + 1
        if self.width > head.cfg.draft_vocab_size:
            raise ConfigError(f"drafter.tree asks for rank {self.width - 1}, beyond the draft vocabulary")

    @property
    def max_nodes(self) -> int:
        return len(self.tree)


def build(*, runtime, head_file: str, num_tokens: int = 4, tree=None, kind: str = "medusa", head=None,
          dtype=None) -> MedusaDrafter:
    """Hydra factory. ``head`` (architecture) is read by specgen-train only; ``dtype``: the head's (None = the target's)."""
    loaded, path, vocab_size = load_for_target(runtime, head_file, "medusa", dtype)
    return MedusaDrafter(loaded, vocab_size, num_tokens, path, tree=tree)
