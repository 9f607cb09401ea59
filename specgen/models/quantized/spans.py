"""Which keys each query of a lean forward attends over (:mod:`specgen.models.quantized.model`).

A query at position ``p`` is computed in the shapes of a one-token step: over the first ``span(p)``
cache slots (``p + 1`` rounded up to a multiple of ``KEY_BUCKET``, at most the context length), with
an additive mask of ``-inf`` past ``p``. Queries that share a span go in one attention call as its
batch, the keys a view of the buffers with the batch axis expanded.

A chain's token at position ``p`` sits in slot ``p``. A draft tree's nodes (:class:`TreePart`) are
kept in node order after the chain, which is not the order a one-token step along a node's path
sees; so, per layer, each of a cover of the tree by root-to-leaf paths is written in turn into the
slots after the chain, in depth order (slot = position, as a chain's), and the nodes that path
covers attend as a chain's queries do (:class:`Span` ``path``); the nodes are then written back in
node order. Masked slots hold finite entries (stale ones, or zeros), whose weights are exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.sampling.tree_structure import ROOT


@dataclass
class TreePart:
    """The draft-tree nodes after a feed's chain: ``parents[j]`` is node j's parent (``ROOT``: the
    last chain token), each parent before its children. Node j's position is the last chain token's
    plus its depth."""

    parents: list[int]

    def __len__(self) -> int:
        return len(self.parents)

    def depths(self) -> list[int]:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        return depths

    def cover(self) -> list[tuple[list[int], list[int]]]:
        """Root-to-leaf paths covering every node, each with the nodes it serves (each node once):
        [(path: node indices in depth order, served: the path's nodes it serves, in depth order)]."""
        children = {parent for parent in self.parents}
        served: set[int] = set()
        out = []
        for leaf in (j for j in range(len(self.parents)) if j not in children):
            path = [leaf]
            while self.parents[path[-1]] != ROOT:
                path.append(self.parents[path[-1]])
            path.reverse()
            out.append((path, [j for j in path if j not in served]))
            served.update(path)
        return out


@dataclass
class Span:
    """Queries of a feed whose positions round up to the same key count ``span``: ``rows`` of them,
    feed rows ``row..row + rows - 1``, or the feed rows ``select`` [rows] (tree nodes); their
    attention's mask [rows, 1, 1, span] (0 where the query sees the slot, -inf past its position);
    the feed's keys and values as a batch of ``rows`` [layers, rows, kv_heads, span, head_dim] (views
    of its buffers, the batch axis expanded). ``path`` (tree nodes; None: none): the node indices
    [depth] to write, in depth order, into the slots after the chain before these queries attend."""

    row: int
    rows: int
    mask: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    select: torch.Tensor | None = None
    path: torch.Tensor | None = None


def key_span(position: int, bucket: int, limit: int) -> int:
    """How many cache slots a query at ``position`` attends over (the rest masked)."""
    return min(-(-(position + 1) // bucket) * bucket, limit)


def spans_of(start: int, n: int, tree: TreePart | None, keys: torch.Tensor, values: torch.Tensor, bucket: int,
             limit: int) -> list[Span]:
    """The queries of a feed of ``n`` tokens after ``start`` cached ones (the last ``len(tree)`` of them
    tree nodes), grouped by span: its chain's in order, then per covering path its nodes'.
    keys, values: the feed's buffers [layers, capacity, kv_heads, head_dim], reserved for every span."""
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [layers, kv, capacity, hd]
    chain = n - (len(tree) if tree is not None else 0)

    def runs(positions: list[int]):  # -> (first index, count, span) per run of one span
        i = 0
        while i < len(positions):
            span = key_span(positions[i], bucket, limit)
            count = 1
            while i + count < len(positions) and key_span(positions[i + count], bucket, limit) == span:
                count += 1
            yield i, count, span
            i += count

    def span_of(row: int, rows: list[int] | int, at: torch.Tensor, span: int, **extra) -> Span:
        count = len(at)
        shape = (keys.shape[0], count, keys.shape[1], span, keys.shape[3])  # [layers, rows, kv, span, hd]
        mask = torch.zeros(count, 1, 1, span).masked_fill_(torch.arange(span) > at[:, None, None, None], float("-inf"))
        return Span(row, count, mask, keys[:, None, :, :span].expand(shape), values[:, None, :, :span].expand(shape),
                    **extra)

    out = [span_of(first, count, torch.arange(start + first, start + first + count), span)
           for first, count, span in runs(list(range(start, start + chain)))]
    if tree is None:
        return out
    base, depths = start + chain, tree.depths()  # the first node's slot; a node at depth k: position base + k - 1
    for path, served in tree.cover():
        positions = [base - 1 + depths[j] for j in served]
        written = torch.tensor(path)
        for first, count, span in runs(positions):
            nodes = served[first:first + count]
            out.append(span_of(chain + nodes[0], count, torch.tensor(positions[first:first + count]), span,
                               select=torch.tensor(nodes) + chain, path=written))
            written = None  # the path stays written for the rest of its runs
    return out


def positions_of(start: int, n: int, tree: TreePart | None) -> torch.Tensor:
    """Each fed token's position [n]: the chain's in order, then each tree node's (the last chain
    token's plus its depth)."""
    if tree is None:
        return torch.arange(start, start + n)
    chain = n - len(tree)
    depths = torch.tensor(tree.depths(), dtype=torch.long)  # [nodes]
    return torch.cat([torch.arange(start, start + chain), start + chain - 1 + depths])
