"""Greedy verification of a draft tree: follow the children equal to the target's argmax
(:mod:`specgen.sampling.tree` for the terms)."""

from __future__ import annotations

from collections.abc import Callable

from specgen.sampling.probs import NoAllowedToken
from specgen.sampling.tree_structure import ROOT, TreeVerdict, check_tree, tree_children


def verify_tree_greedy(
    tokens: list[int],
    parents: list[int],
    target_argmax: Callable[[int], int | None],
) -> TreeVerdict:
    """Greedy verification: follow the children equal to the target's argmax.

    target_argmax: node -> argmax id of the processed target row after that node's
    path (-1 = root), None where nothing is allowed; called for the root and each
    accepted node. None at an accepted node ends with "dead_end" (module docstring);
    None at the root raises NoAllowedToken.
    At each node the first child (in node order) whose token equals the argmax is
    accepted; the next token is the argmax at the last accepted node, so the output
    equals plain greedy decoding token for token. ``checked``/``accept_probs`` list
    the children tried (0.0 for mismatches, 1.0 for the accepted one).
    """
    check_tree(tokens, parents)
    children = tree_children(parents)
    path: list[int] = []
    checked: list[int] = []
    accept_probs: list[float] = []
    node = ROOT
    while True:
        best = target_argmax(node)
        if best is None:
            if node == ROOT:
                raise NoAllowedToken("target: every token is forbidden at the first position (all logits are -inf)")
            return TreeVerdict(path, [tokens[i] for i in path], None, "dead_end", tuple(checked),
                               tuple(accept_probs))
        best = int(best)
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
