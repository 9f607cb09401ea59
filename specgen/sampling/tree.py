"""Speculative acceptance for a tree of drafted tokens.

Terms (SpecInfer, Miao et al. 2024; multi-draft speculative sampling, Chen et al.
2023 / Sun et al. 2023), on top of those in :mod:`specgen.sampling.rejection`:

* **tree** -- ``tokens[i]`` is node ``i``'s token and ``parents[i]`` its parent
  node, ``-1`` for a child of the root (the committed prefix). ``parents[i] < i``,
  so nodes are topologically ordered; siblings are tried in node-index order.
* **draft_probs[i]** -- the distribution ``tokens[i]`` was drawn from, given the
  tokens of its ancestors and of its earlier siblings (and of the earlier siblings
  of each ancestor): e.g. ``q`` itself for siblings drawn i.i.d., or ``q`` with
  the earlier siblings' tokens removed and renormalised for siblings drawn without
  replacement. ``None`` means every node is deterministic (one-hot on its token),
  which is exact for any tree. Drafting must not see the target's uniforms.
* **target_probs(node)** -- the target's distribution of the token that follows
  ``node`` on its root path (``node = -1``: the first new token). It is called
  lazily, only for the root and the nodes that get accepted.

Recursive rejection sampling (RRS): at the current node with target row ``r = p``,
try each child ``c`` in order: accept with probability ``min(1, r(x_c) / q_c(x_c))``
and descend (``r = target_probs(c)``); on rejection set ``r <- (r - q_c)+``
normalised and try the next sibling. With no child accepted (or at a leaf) draw
the next token from ``r``: the residual if a sibling was rejected here
("resampled"), else ``p`` itself ("bonus").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specgen.errors import NumericalError
from specgen.sampling.probs import sample_token, uniform
from specgen.sampling.rejection import positive_residual

#: Probability rows must sum to 1 within this tolerance.
PROB_SUM_TOL = 1e-6

ROOT = -1


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying one draft tree.

    path: accepted node indices, root -> leaf (empty if the first level failed).
    tokens: the accepted nodes' tokens, same order as ``path``.
    next_token: the one token the target adds after the path (resampled or bonus).
    kind: "resampled" if a child of the last accepted node (or of the root) was
        rejected, else "bonus" (that node is a leaf of the tree).
    checked: every node whose acceptance was tested, in test order (accepted
        nodes and rejected siblings alike).
    accept_probs: ``min(1, r/q)`` for each node in ``checked`` (aligned with it);
        ``r`` is the row in force at that moment (a residual after a rejected
        sibling). The accepted nodes' values are ``accept_probs`` at the
        positions where ``checked`` holds a ``path`` node.
    """

    path: list[int]
    tokens: list[int]
    next_token: int
    kind: str
    checked: tuple[int, ...] = field(default=())
    accept_probs: tuple[float, ...] = field(default=())

    @property
    def num_accepted(self) -> int:
        """How many draft nodes were kept (the depth of the accepted path)."""
        return len(self.path)

    @property
    def emitted(self) -> list[int]:
        """All tokens this round commits: accepted tokens, then ``next_token``."""
        return [*self.tokens, self.next_token]


# --------------------------------------------------------------------------- structure


def _check_parents(parents: list[int]) -> None:
    for i, parent in enumerate(parents):
        if not isinstance(parent, int) or isinstance(parent, bool):
            raise ValueError(f"parents[{i}] must be an int, got {type(parent).__name__}")
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a node's parent must be -1 (root) or an earlier node (< {i})")


def _check_tree(tokens: list[int], parents: list[int]) -> None:
    if len(tokens) != len(parents):
        raise ValueError(f"tree has {len(tokens)} tokens but {len(parents)} parents")
    _check_parents(parents)
    for i, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"tokens[{i}] = {token!r} is not a token id")


def tree_children(parents: list[int]) -> dict[int, list[int]]:
    """{node: its children in order}, with key ``-1`` for the root; leaves map to []."""
    _check_parents(parents)
    children: dict[int, list[int]] = {ROOT: [], **{i: [] for i in range(len(parents))}}
    for i, parent in enumerate(parents):
        children[parent].append(i)
    return children


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node; children of the root have depth 1."""
    _check_parents(parents)
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent == ROOT else depths[parent] + 1)
    return depths


def tree_paths(parents: list[int]) -> list[list[int]]:
    """For each node, the node indices from the root's child down to it (inclusive)."""
    _check_parents(parents)
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        paths.append([i] if parent == ROOT else [*paths[parent], i])
    return paths


def ancestors(parents: list[int], node: int) -> list[int]:
    """Strict ancestors of ``node`` (node indices), nearest first; [] for a root child."""
    _check_parents(parents)
    if not 0 <= node < len(parents):
        raise ValueError(f"node {node} is not in a tree of {len(parents)} nodes")
    out: list[int] = []
    node = parents[node]
    while node != ROOT:
        out.append(node)
        node = parents[node]
    return out


def ancestor_matrix(parents: list[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Bool [N, N]: ``[i, j]`` is True iff ``j == i`` or ``j`` is an ancestor of ``i``.

    Row ``i`` is the set of tree nodes that node ``i`` may attend to (on top of the
    committed prefix), i.e. the tree part of a 4D attention mask. Lower-triangular
    because ``parents[i] < i``.
    """
    _check_parents(parents)
    num_nodes = len(parents)
    mask = torch.zeros((num_nodes, num_nodes), dtype=torch.bool)  # [N, N]
    for i, parent in enumerate(parents):
        if parent != ROOT:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask if device is None else mask.to(device)


# --------------------------------------------------------------------------- rows


def _check_row(row: torch.Tensor, vocab: int | None, what: str) -> torch.Tensor:
    if not isinstance(row, torch.Tensor) or row.dim() != 1:
        shape = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
        raise ValueError(f"{what} must be a [vocab] tensor, got {shape}")
    if vocab is not None and row.shape[0] != vocab:
        raise ValueError(f"{what} has vocab {row.shape[0]}, expected {vocab}")
    row = row.to(torch.float64)
    if not bool(torch.isfinite(row).all()):
        raise NumericalError(f"{what} contains NaN or Inf")
    if bool((row < 0).any()):
        raise NumericalError(f"{what} has negative probabilities")
    if abs(float(row.sum()) - 1.0) > PROB_SUM_TOL:
        raise NumericalError(f"{what} sums to {float(row.sum())}, not 1")
    return row


def _check_draft(draft_probs: torch.Tensor, num_nodes: int, vocab: int) -> torch.Tensor:
    """All draft rows at once ([num_nodes, vocab]); same checks as _check_row."""
    if draft_probs.dim() != 2 or draft_probs.shape[0] != num_nodes:
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)} does not match {num_nodes} x vocab")
    if draft_probs.shape[1] != vocab:
        raise ValueError(f"draft_probs vocab {draft_probs.shape[1]} does not match target vocab {vocab}")
    draft_probs = draft_probs.to(torch.float64)
    if num_nodes == 0:
        return draft_probs
    if not bool(torch.isfinite(draft_probs).all()):
        raise NumericalError("draft_probs contains NaN or Inf")
    if bool((draft_probs < 0).any()):
        raise NumericalError("draft_probs has negative probabilities")
    worst = float((draft_probs.sum(dim=-1) - 1.0).abs().max())
    if worst > PROB_SUM_TOL:
        raise NumericalError(f"a draft_probs row is off normalisation by {worst}")
    return draft_probs


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    row = torch.zeros_like(like)  # [vocab]
    row[token] = 1.0
    return row


# --------------------------------------------------------------------------- verification


def verify_tree(
    tokens: list[int],
    parents: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: Callable[[int], torch.Tensor],
    generator: torch.Generator,
) -> TreeVerdict:
    """Exact speculative sampling over a draft tree by recursive rejection sampling.

    tokens:       num_nodes token ids
    parents:      num_nodes parent indices (-1 = root, parents[i] < i)
    draft_probs:  [num_nodes, vocab] float64 (see module docstring), or None for
                  deterministic nodes (q one-hot on the token)
    target_probs: node -> [vocab] float64 target row after that node's path
                  (-1 = root); called once for the root and once per accepted node
    Consumes one uniform per checked node plus one for the final draw.

    Exactness, one level at a time (then induct on depth, since an accepted child
    c restarts the same procedure with p = target_probs(c) and c's children): at a
    node with row r, the first child x ~ q is kept with prob min(r, q)(x), so the
    output is x with mass min(r, q)(x), and on rejection (total mass sum (r - q)+)
    the rest of the level is an RRS against the residual (r - q)+ / sum, which does
    not depend on the rejected token; by induction on the number of remaining
    siblings (base: a direct draw from the row) that rest emits exactly the
    residual, so the total is min(r, q) + (r - q)+ = r. Later siblings may be drawn
    from any law given the earlier ones (i.i.d., without replacement) as long as
    draft_probs holds that law. With one-hot siblings x1, x2, ... this reads:
    accept x1 w.p. p(x1), else x2 w.p. p(x2) / (1 - p(x1)), ..., else sample p with
    those tokens removed.

    Raises ValueError for a malformed tree or mismatched shapes, NumericalError for
    NaN / negative / unnormalised rows or a node with zero draft probability.
    """
    _check_tree(tokens, parents)
    num_nodes = len(tokens)
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != num_nodes):
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)} does not match {num_nodes} x vocab")
    children = tree_children(parents)

    p_row = _check_row(target_probs(ROOT), None, "target_probs(-1)")  # [vocab]
    vocab = p_row.shape[0]
    if draft_probs is not None:
        draft_probs = _check_draft(draft_probs, num_nodes, vocab)
    for i, token in enumerate(tokens):
        if token >= vocab:
            raise ValueError(f"tokens[{i}] = {token} is outside the vocabulary of {vocab}")

    path: list[int] = []
    checked: list[int] = []
    accept_probs: list[float] = []
    node = ROOT
    while True:
        row = p_row  # [vocab], the target row, replaced by residuals on rejection
        accepted = None
        for child in children[node]:
            token = tokens[child]
            if draft_probs is None:
                q_row = _one_hot(token, row)
            else:
                q_row = draft_probs[child]  # [vocab]
            q_x = float(q_row[token])
            if not q_x > 0.0:
                raise NumericalError(f"draft node {child} (token {token}) has zero draft probability")
            ratio = min(1.0, float(row[token]) / q_x)
            checked.append(child)
            accept_probs.append(ratio)
            if uniform(generator) < ratio:
                accepted = child
                break
            row = positive_residual(row, q_row)
        if accepted is None:
            kind = "resampled" if children[node] else "bonus"
            next_token = sample_token(row, generator)
            return TreeVerdict(
                path, [tokens[i] for i in path], next_token, kind, tuple(checked), tuple(accept_probs)
            )
        path.append(accepted)
        node = accepted
        p_row = _check_row(target_probs(node), vocab, f"target_probs({node})")


def verify_tree_greedy(
    tokens: list[int],
    parents: list[int],
    target_argmax: Callable[[int], int],
) -> TreeVerdict:
    """Greedy verification: follow the children equal to the target's argmax.

    target_argmax: node -> argmax id of the processed target row after that node's
    path (-1 = root); called for the root and each accepted node.
    At each node the first child (in node order) whose token equals the argmax is
    accepted; the next token is the argmax at the last accepted node, so the output
    equals plain greedy decoding token for token. ``checked``/``accept_probs`` list
    the children tried (0.0 for mismatches, 1.0 for the accepted one).
    """
    _check_tree(tokens, parents)
    children = tree_children(parents)
    path: list[int] = []
    checked: list[int] = []
    accept_probs: list[float] = []
    node = ROOT
    while True:
        best = int(target_argmax(node))
        accepted = None
        for child in children[node]:
            checked.append(child)
            if tokens[child] == best:
                accept_probs.append(1.0)
                accepted = child
                break
            accept_probs.append(0.0)
        if accepted is None:
            kind = "resampled" if children[node] else "bonus"
            return TreeVerdict(path, [tokens[i] for i in path], best, kind, tuple(checked), tuple(accept_probs))
        path.append(accepted)
        node = accepted
