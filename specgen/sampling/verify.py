"""One entry point for verification: :func:`verify` -> :class:`~specgen.sampling.verdict.Verdict`,
for chains and trees, sampled and greedy.

A chain is a tree with one child per node (``parents=None`` says so). Three branches, one law
each, all exact (terms: :mod:`specgen.sampling.rejection`, :mod:`specgen.sampling.tree`):

* **greedy** -- follow the children equal to the target's argmax (:func:`verify_greedy`); the
  output equals plain greedy decoding token for token.
* **sampled tree** -- recursive rejection sampling, or coupling for one-hot drafts
  (:func:`specgen.sampling.tree.verify_tree`).
* **sampled chain with every row at hand** -- the chain fast path
  (:func:`specgen.sampling.rejection.verify_chain`): the same law as the tree walk, with one host
  read for the whole chain and its uniforms drawn in one call (a seeded request's stream of
  uniforms is the chain verifier's, so seeded chains give the tokens they always gave).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specgen.sampling.probs import NoAllowedToken
from specgen.sampling.rejection import verify_chain
from specgen.sampling.tree import verify_tree
from specgen.sampling.tree_structure import ROOT, chain_parents, check_tree, tree_children
from specgen.sampling.verdict import Verdict

#: Greedy targets: the argmax id after each node (root first), or node -> that id; None: nothing allowed.
Argmaxes = Sequence[int | None] | Callable[[int], int | None]
#: Sampled targets: probability rows [num_nodes + 1, vocab] (root first), or node -> [vocab] row.
Rows = torch.Tensor | Callable[[int], torch.Tensor]


def verify(tokens: list[int], parents: list[int] | None, target: Argmaxes | Rows,
           generator: torch.Generator | None = None, *, draft_probs: torch.Tensor | None = None,
           greedy: bool = False, draw_ahead: bool = False) -> Verdict:
    """Verify a drafted chain or tree against the target; -> one :class:`Verdict`.

    tokens: num_nodes drafted token ids; parents: num_nodes parent indices (-1 = root,
    parents[i] < i), or None for a chain (``[-1, 0, 1, ...]``).
    target: greedy -- the argmax id of the processed target row after each node (-1 = root),
    None where nothing is allowed, as a sequence of num_nodes + 1 ids (root first) or a callable
    node -> id; sampled -- float64 probability rows, a [num_nodes + 1, vocab] tensor (root
    first: "prefetched") or a callable node -> [vocab] row (called for the root and each
    accepted node: "lazy").
    generator: the request's target generator (sampled only); draft_probs: [num_nodes, vocab]
    float64 rows the nodes were drawn from, None for a deterministic draft (sampled only).
    greedy: the greedy branch; draw_ahead: a prefetched chain also makes every possible final
    draw on the device and reads it with the rest (:func:`verify_chain`; the tree walk has no
    such option and ignores it).
    A chain with prefetched rows takes the chain fast path (module docstring); a chain with lazy
    rows is walked as a tree. Errors: as the branch's verifier raises them.
    """
    if greedy:
        return verify_greedy(tokens, parents, target)
    if parents is None and isinstance(target, torch.Tensor):
        return verify_chain(target, draft_probs, tokens, generator, draw_ahead=draw_ahead)
    return verify_tree(tokens, chain_parents(len(tokens)) if parents is None else parents, draft_probs, target,
                       generator)


def verify_greedy(tokens: list[int], parents: list[int] | None, target_argmax: Argmaxes) -> Verdict:
    """Greedy verification: follow the children equal to the target's argmax.

    target_argmax: as :func:`verify`'s greedy ``target``; read for the root and each accepted
    node. None at an accepted node ends with "dead_end" (:mod:`specgen.sampling.rejection`);
    None at the root raises NoAllowedToken.
    At each node the first child (in node order) whose token equals the argmax is accepted;
    the next token is the argmax at the last accepted node, so the output equals plain greedy
    decoding token for token. ``checked``/``accept_probs`` list the children tried (0.0 for
    mismatches, 1.0 for the accepted one).
    """
    parents = chain_parents(len(tokens)) if parents is None else parents
    check_tree(tokens, parents)
    argmax = target_argmax if callable(target_argmax) else _indexed(target_argmax, len(tokens))
    children = tree_children(parents)
    path: list[int] = []
    checked: list[int] = []
    accept_probs: list[float] = []
    node = ROOT
    while True:
        best = argmax(node)
        if best is None:
            if node == ROOT:
                raise NoAllowedToken("target: every token is forbidden at the first position (all logits are -inf)")
            return Verdict.tree(path, [tokens[i] for i in path], None, "dead_end", tuple(checked), tuple(accept_probs))
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
            return Verdict.tree(path, [tokens[i] for i in path], best, kind, tuple(checked), tuple(accept_probs))
        path.append(accepted)
        node = accepted


def _indexed(argmaxes: Sequence[int | None], num_nodes: int) -> Callable[[int], int | None]:
    """node -> its argmax, from num_nodes + 1 argmax ids (root first)."""
    if len(argmaxes) != num_nodes + 1:
        raise ValueError("need one more target token than draft tokens")

    def argmax(node: int) -> int | None:
        return argmaxes[node + 1]

    return argmax


def verify_chain_greedy(target_tokens: Sequence[int | None], draft_tokens: list[int]) -> Verdict:
    """:func:`verify_greedy` of a chain, the target's num_draft + 1 argmax ids first."""
    return verify_greedy(draft_tokens, None, target_tokens)


def verify_tree_greedy(tokens: list[int], parents: list[int], target_argmax: Callable[[int], int | None]) -> Verdict:
    """:func:`verify_greedy` of a tree with its argmaxes read node by node."""
    return verify_greedy(tokens, parents, target_argmax)
