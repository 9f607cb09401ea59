"""Coupled verification of a deterministic draft tree (every node one-hot on its token).

At each level of the walk (the root, then each accepted node) the target row r is drawn from
with that level's own uniform, ``y = inverse-CDF(r, u[level])``, as a plain step would draw it.
If a child of the node carries token y the walk descends into the first such child; otherwise
the round ends with y. The law is recursive rejection sampling's with one-hot siblings
(:mod:`specgen.sampling.tree`): child x1 is kept with r(x1), x2 with r(x2) / (1 - r(x1)) given
x1 was not, ..., and with none kept y follows r without the children's tokens -- which is the
distribution of y given that it is none of them. The walk uses one uniform per committed token,
``u[0]`` at the root and ``u[d]`` at depth d, so a seeded request's tokens equal plain decoding's
whatever trees were drafted (:func:`specgen.sampling.tree.verify_tree` rewinds the generator).

The reported ``checked`` / ``accept_probs`` are RRS's: the siblings in node order up to the kept
one, each with its conditional acceptance probability.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specgen.sampling.probs import draw_on_device, raise_for_row, sample_token
from specgen.sampling.rejection import RESIDUAL_EPS
from specgen.sampling.tree_structure import tree_depths

#: decide(node, row [vocab], level values (p of each child's token first), depth, checked, accept_probs)
#: -> (the child kept, None) or (None, the round's next token); it appends what it tried to checked/accept_probs.
Decide = Callable[[int, torch.Tensor, list, int, list, list], tuple]


def lazy_draws(generator: torch.Generator, u: list[float]) -> Callable[[int, torch.Tensor, int], int]:
    """draw(node, row, level) for rows fetched one at a time: one read per level."""
    return lambda node, row, level: sample_token(row, generator, u[level])


def prefetched_draws(rows: torch.Tensor, parents: list[int], u: torch.Tensor) -> Callable[[int, torch.Tensor, int], int]:
    """draw(node, row, level) for prefetched rows ([num_nodes + 1, vocab], root first): every row
    drawn on the device with its level's uniform (u: [num_nodes + 1]) and read back in one transfer."""
    levels = torch.tensor([0, *tree_depths(parents)], dtype=torch.long, device=u.device)  # [N + 1]
    ids, total = draw_on_device(rows.to(torch.float64), u[levels].to(rows.device, torch.float64))  # [N + 1], [N + 1]
    values = torch.cat([ids.to(torch.float64), total]).tolist()
    width = len(parents) + 1

    def draw(node: int, row: torch.Tensor, level: int) -> int:
        raise_for_row(values[width + node + 1], "cannot sample")
        return int(values[node + 1])

    return draw


def coupled_levels(draw: Callable[[int, torch.Tensor, int], int], children: dict[int, list[int]],
                   tokens: list[int]) -> Decide:
    """The coupled decision at each level of :func:`specgen.sampling.tree.verify_tree`'s walk
    (module docstring): draw y from the node's row with the level's uniform; keep the first child
    carrying y, or end the round with y."""

    def decide(node: int, row: torch.Tensor, level: list, depth: int, checked: list[int],
               accept_probs: list[float]) -> tuple[int | None, int | None]:
        kids = children[node]
        y = draw(node, row, depth)
        child = _level(level[: len(kids)], kids, tokens, y, checked, accept_probs)
        return (child, None) if child is not None else (None, y)

    return decide


def _level(child_p: list[float], kids: list[int], tokens: list[int], y: int, checked: list[int],
           accept_probs: list[float]) -> int | None:
    """The first child whose token is y, or None; records the siblings tried with RRS's
    conditional acceptance probabilities (a repeated token's is 0)."""
    remaining, removed = 1.0, set()
    for child, p_x in zip(kids, child_p, strict=True):
        token = tokens[child]
        r_x = 0.0 if token in removed else p_x / remaining if remaining > RESIDUAL_EPS else 0.0
        checked.append(child)
        accept_probs.append(min(1.0, r_x))
        if token == y:
            return child
        if token not in removed:
            removed.add(token)
            remaining -= p_x
    return None
