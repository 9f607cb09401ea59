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

**dead_end** -- a node's row is draft-dependent: if ``target_probs(node)`` of an
accepted node allows nothing (all zero), the prefix through that node is a dead
end (:mod:`specgen.sampling.rejection`); the verdict keeps the path, adds no
token, and the request ends with ``finish_reason="dead_end"``. An empty root row
still raises NoAllowedToken.

**Exactness**, one level at a time (then induct on depth, since an accepted child
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
those tokens removed, the law :mod:`specgen.sampling.tree_coupled` realises by
drawing one token per level. Each level's uniforms are fresh and used once in both
modes (lazy and prefetched target rows), so the two are the same procedure.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specgen.errors import NumericalError
from specgen.sampling.probs import sample_token, uniforms
from specgen.sampling.rejection import (
    check_health,
    positive_residual,
    row_health,
    rows_health,
)
from specgen.sampling.verdict import Verdict
from specgen.sampling.tree_coupled import coupled_levels, lazy_draws, prefetched_draws
from specgen.sampling.tree_structure import (
    ROOT,
    check_tree,
    ancestor_matrix,
    ancestors,
    tree_children,
    tree_depths,
    tree_paths,
)

__all__ = ["ROOT", "ancestor_matrix", "ancestors", "tree_children", "tree_depths", "tree_paths",
           "verify_tree"]


# --------------------------------------------------------------------------- rows


def _as_row(row: torch.Tensor, vocab: int | None, what: str) -> torch.Tensor:
    if not isinstance(row, torch.Tensor) or row.dim() != 1:
        shape = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
        raise ValueError(f"{what} must be a [vocab] tensor, got {shape}")
    if vocab is not None and row.shape[0] != vocab:
        raise ValueError(f"{what} has vocab {row.shape[0]}, expected {vocab}")
    return row.to(torch.float64)


def _check_row(row: torch.Tensor, vocab: int | None, what: str, read: list[int] = (),
               extra: torch.Tensor | None = None, allow_empty: bool = False) -> tuple[torch.Tensor, list, bool]:
    """Check a target row ([vocab]) and read its probabilities at ``read`` token ids and
    the values of ``extra`` ([E], e.g. uniforms), in one transfer -> (row as float64,
    [p(t) for t in read] + extra values, whether the row is all zero). An all-zero row
    raises NoAllowedToken unless ``allow_empty``."""
    row = _as_row(row, vocab, what)
    parts = [row_health(row), row[torch.tensor(list(read), dtype=torch.long, device=row.device)]]
    if extra is not None:
        parts.append(extra.to(row.device, torch.float64))
    values = torch.cat(parts).tolist()
    check_health(values[:4], what, allow_empty)
    return row, values[4:], bool(values[2])


def _check_draft(draft_probs: torch.Tensor, num_nodes: int, vocab: int) -> torch.Tensor:
    """Shape checks of all draft rows ([num_nodes, vocab]), reading nothing back."""
    if draft_probs.dim() != 2 or draft_probs.shape[0] != num_nodes:
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)} does not match {num_nodes} x vocab")
    if draft_probs.shape[1] != vocab:
        raise ValueError(f"draft_probs vocab {draft_probs.shape[1]} does not match target vocab {vocab}")
    return draft_probs.to(torch.float64)  # its values are checked in the root's read (verify_tree)


# --------------------------------------------------------------------------- verification


def verify_tree(
    tokens: list[int],
    parents: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: Callable[[int], torch.Tensor] | torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Exact speculative sampling over a draft tree by recursive rejection sampling
    (the proof: module docstring, "Exactness").

    tokens:       num_nodes token ids
    parents:      num_nodes parent indices (-1 = root, parents[i] < i)
    draft_probs:  [num_nodes, vocab] float64 (see module docstring), or None for
                  deterministic nodes (q one-hot on the token)
    target_probs: either node -> [vocab] float64 target row after that node's path
                  (-1 = root), called once for the root and once per accepted node
                  ("lazy"); or every row at once, [num_nodes + 1, vocab] with row 0
                  the root and row 1 + i node i ("prefetched"). An all-zero row of an
                  accepted node ends with "dead_end" (module docstring), an all-zero
                  root row raises NoAllowedToken; rows never visited are not checked.
    Uniforms: at each visited node, one per child plus one for a final draw; child
    ``i`` uses ``u[i]``. Lazy: drawn per visited node. Prefetched: drawn for every
    node in one call (node order, root first), unused ones discarded.
    Deterministic nodes (``draft_probs`` None) are verified by coupling instead
    (:mod:`specgen.sampling.tree_coupled`): the same law, one uniform per level, and
    the generator left as if one uniform had been drawn per committed token, so a
    seeded run's tokens equal plain decoding's. Prefetched rows then take one more
    read (every row drawn ahead).
    Host reads, lazy: one per visited node (the row's checks, the children's p -- and
    q -- values and the uniforms, with the draft rows' checks at the root), one per
    rejected sampled sibling after the first, and one for the final draw.
    Prefetched: one for the whole tree, one per rejected sampled sibling after the
    first, and one for the final draw -- independent of the tree's size.

    Raises ValueError for a malformed tree or mismatched shapes, NumericalError for
    NaN / negative / unnormalised rows or a node with zero draft probability.
    """
    check_tree(tokens, parents)
    num_nodes = len(tokens)
    if draft_probs is not None and (draft_probs.dim() != 2 or draft_probs.shape[0] != num_nodes):
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)} does not match {num_nodes} x vocab")
    children = tree_children(parents)
    prefetched = isinstance(target_probs, torch.Tensor)
    root_row = None if prefetched else _as_row(target_probs(ROOT), None, "target_probs(-1)")  # [vocab] float64
    vocab = _tree_vocab(tokens, target_probs if prefetched else None, root_row)
    if draft_probs is not None:
        draft_probs = _check_draft(draft_probs, num_nodes, vocab)
    start = generator.get_state() if draft_probs is None else None
    level_u = uniforms(generator, num_nodes + 1) if draft_probs is None else None  # [N + 1] coupled: u[depth]
    if prefetched:
        visit = _prefetch(target_probs, tokens, parents, children, draft_probs, generator)
    else:
        visit = _lazy_visitor(root_row, target_probs, tokens, children, draft_probs, vocab, generator)
    if draft_probs is None:
        draw = prefetched_draws(target_probs, parents, level_u) if prefetched else lazy_draws(generator,
                                                                                              level_u.tolist())
        verdict = _walk(visit, tokens, children, coupled_levels(draw, children, tokens))
        generator.set_state(start)  # one uniform per committed token (tree_coupled)
        uniforms(generator, len(verdict.path) + (verdict.next_token is not None))
        return verdict
    return _walk(visit, tokens, children, _rejection_levels(draft_probs, children, tokens, generator))


def _tree_vocab(tokens: list[int], rows: torch.Tensor | None, root_row: torch.Tensor | None) -> int:
    """The vocabulary size, from the prefetched ``rows`` ([num_nodes + 1, vocab]) or the
    lazily read ``root_row`` ([vocab]); ValueError for a shape or token id that does not fit."""
    if rows is not None:
        if rows.dim() != 2 or rows.shape[0] != len(tokens) + 1:
            raise ValueError(f"target_probs shape {tuple(rows.shape)} does not match "
                             f"{len(tokens) + 1} x vocab (the root, then every node)")
        vocab = rows.shape[1]
    else:
        vocab = root_row.shape[0]
    for i, token in enumerate(tokens):
        if token >= vocab:
            raise ValueError(f"tokens[{i}] = {token} is outside the vocabulary of {vocab}")
    return vocab


def _lazy_visitor(root_row: torch.Tensor, target_probs: Callable[[int], torch.Tensor], tokens: list[int],
                  children: dict[int, list[int]], draft_probs: torch.Tensor | None, vocab: int,
                  generator: torch.Generator):
    """``visit(node) -> (row, level values, empty)`` for the lazy walk: the checked row after
    ``node``, with what its level needs, in one read: p of the children's tokens and, for
    sampled drafts, their q and the level's uniforms (one per child plus one for a final draw;
    a one-hot tree's coupled walk draws its own) and, at the root, the draft rows' checks; and
    whether the row (of a node, not the root) is empty.

    root_row: [vocab] float64, already fetched; draft_probs: [num_nodes, vocab] float64 or None."""
    one_hot = draft_probs is None

    def visit(node: int) -> tuple[torch.Tensor, list, bool]:
        row = root_row if node == ROOT else target_probs(node)
        kids = children[node]
        read = [tokens[c] for c in kids]
        extra = []
        if not one_hot:
            extra.append(uniforms(generator, len(kids) + 1))
            index = torch.tensor(kids, dtype=torch.long, device=draft_probs.device)
            ids = torch.tensor(read, dtype=torch.long, device=draft_probs.device)
            extra.insert(0, draft_probs[index, ids])  # [k] q of each child's token
            if node == ROOT:
                extra.insert(0, row_health(draft_probs))
        device = row.device if isinstance(row, torch.Tensor) else torch.device("cpu")
        extra = torch.cat([e.to(device, torch.float64) for e in extra]) if extra else None
        row, values, empty = _check_row(row, vocab, f"target_probs({node})", read, extra, node != ROOT)
        if not one_hot and node == ROOT:
            check_health(values[len(read): len(read) + 4], "draft_probs")
            values = values[: len(read)] + values[len(read) + 4:]
        return row, values, empty

    return visit


def _walk(visit, tokens: list[int], children: dict[int, list[int]], decide) -> Verdict:
    """The walk from the root, one level at a time: ``decide`` (a
    :data:`~specgen.sampling.tree_coupled.Decide`) keeps a child, and the walk descends into it,
    or gives the round's next token; an accepted node whose row is empty ends it ("dead_end")."""
    row, level, _ = visit(ROOT)  # [vocab], values for the root's children
    path: list[int] = []
    checked: list[int] = []
    accept_probs: list[float] = []
    node = ROOT
    while True:
        accepted, next_token = decide(node, row, level, len(path), checked, accept_probs)
        if accepted is None:
            kind = "resampled" if children[node] else "bonus"
            return Verdict.tree(path, [tokens[i] for i in path], next_token, kind, tuple(checked),
                               tuple(accept_probs))
        path.append(accepted)
        node = accepted
        row, level, empty = visit(node)
        if empty:
            return Verdict.tree(path, [tokens[i] for i in path], None, "dead_end", tuple(checked),
                               tuple(accept_probs))


def _rejection_levels(draft_probs: torch.Tensor, children: dict[int, list[int]], tokens: list[int],
                      generator: torch.Generator):
    """Recursive rejection sampling's decision at each level against sampled siblings
    (:func:`_sampled_level`): the child accepted, or the draw from the row left after
    rejecting them all (the residual) or from p itself at a leaf."""

    def decide(node, row, level, depth, checked, accept_probs):
        accepted, final_row, u = _sampled_level(row, draft_probs, level, children[node], tokens, checked,
                                                accept_probs)
        return (accepted, None) if accepted is not None else (None, sample_token(final_row, generator, u))

    return decide


def _prefetch(rows: torch.Tensor, tokens: list[int], parents: list[int], children: dict[int, list[int]],
              draft_probs: torch.Tensor | None, generator: torch.Generator):
    """Read what the whole walk may need in one transfer -- each row's checks, p of every
    node's token under its parent's row and, for sampled drafts, q of it, every level's
    uniforms and the draft rows' checks (a one-hot tree's coupled walk draws its own
    uniforms) -- and return ``visit(node) -> (row, level values, empty)`` as the lazy
    walk's, reading nothing more.

    rows: [num_nodes + 1, vocab] target rows, root first."""
    num_nodes = len(tokens)
    rows = rows.to(torch.float64)  # [N + 1, vocab]
    device = rows.device
    ids = torch.tensor(tokens, dtype=torch.long).to(device)  # [N]
    parent_rows = torch.tensor([parent + 1 for parent in parents], dtype=torch.long).to(device)  # [N]
    parts = [rows_health(rows).flatten(), rows[parent_rows, ids]]  # [(N + 1) * 4], [N] p of each token under its parent
    if draft_probs is not None:
        nodes = torch.arange(num_nodes, device=draft_probs.device)
        parts.append(draft_probs[nodes, ids.to(draft_probs.device)].to(device))  # [N] q of each node's token
        parts.append(row_health(draft_probs).to(device))  # [4]
        parts.append(uniforms(generator, 2 * num_nodes + 1).to(device, torch.float64))  # [2N + 1]
    values = torch.cat(parts).tolist()
    health, values = values[: 4 * (num_nodes + 1)], values[4 * (num_nodes + 1):]
    child_p, values = values[:num_nodes], values[num_nodes:]
    child_q: list[float] = []
    if draft_probs is not None:
        child_q, values = values[:num_nodes], values[num_nodes:]
        check_health(values[:4], "draft_probs")
        values = values[4:]
    offsets, start = {}, 0
    for node in [ROOT, *range(num_nodes)]:
        offsets[node] = start
        start += len(children[node]) + 1

    def visit(node: int) -> tuple[torch.Tensor, list, bool]:
        r = node + 1
        check_health(health[4 * r: 4 * r + 4], f"target_probs({node})", allow_empty=node != ROOT)
        kids = children[node]
        level = [child_p[c] for c in kids] + [child_q[c] for c in kids if draft_probs is not None]
        level += values[offsets[node]: offsets[node] + len(kids) + 1]  # the uniforms: none for a one-hot tree
        return rows[r], level, bool(health[4 * r + 2])

    return visit


def _sampled_level(p_row, draft_probs, values, kids, tokens, checked, accept_probs):
    """One level of RRS against sampled siblings, from the values read with the row:
    p of each child's token, q of it, then len(kids) + 1 uniforms. After a rejection the
    row is the residual, and the next sibling's r(x) takes one more read.
    -> (accepted child or None, row to draw from [vocab], the final draw's uniform)."""
    k = len(kids)
    first_p, q_values, u = values[:k], values[k: 2 * k], values[2 * k:]
    row = p_row  # [vocab], the target row, replaced by residuals on rejection
    for i, child in enumerate(kids):
        token = tokens[child]
        q_x = q_values[i]
        if not q_x > 0.0:
            raise NumericalError(f"draft node {child} (token {token}) has zero draft probability")
        r_x = first_p[i] if row is p_row else row[token].item()
        ratio = min(1.0, r_x / q_x)
        checked.append(child)
        accept_probs.append(ratio)
        if u[i] < ratio:
            return child, row, None
        row = positive_residual(row, draft_probs[child])
    return None, row, u[-1]
