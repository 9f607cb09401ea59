"""The shape of a draft tree: checks, children, depths, root paths, ancestors, the tree
part of an attention mask (a verification's outcome is :class:`specgen.sampling.verdict.Verdict`).

A tree is ``parents``: ``parents[i]`` is node ``i``'s parent, :data:`ROOT` (-1) for a
child of the committed prefix, and ``parents[i] < i`` (nodes are topologically
ordered). Pure host-side functions; only :func:`ancestor_matrix` builds a tensor.
"""

from __future__ import annotations

import torch

ROOT = -1


def _check_parents(parents: list[int]) -> None:
    for i, parent in enumerate(parents):
        if not isinstance(parent, int) or isinstance(parent, bool):
            raise ValueError(f"parents[{i}] must be an int, got {type(parent).__name__}")
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a node's parent must be -1 (root) or an earlier node (< {i})")


def check_tree(tokens: list[int], parents: list[int]) -> None:
    """ValueError unless ``tokens`` and ``parents`` form a tree (module docstring) of token ids."""
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


def chain_parents(num_nodes: int) -> list[int]:
    """The parents of a chain of ``num_nodes`` tokens: one child per node."""
    return list(range(-1, num_nodes - 1))
