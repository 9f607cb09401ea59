"""Pure sampling maths: distributions, draws and speculative acceptance.

Verification has one entry point, :func:`~specgen.sampling.verify.verify`, and one outcome
type, :class:`~specgen.sampling.verdict.Verdict`, for chains and trees. Nothing here touches a
model, a cache or I/O; every function takes tensors and an explicit ``torch.Generator`` and
returns plain values.
"""

from specgen.sampling.probs import (
    NAN_CODE,
    NONE_ALLOWED_CODE,
    NoAllowedToken,
    argmax_codes,
    argmax_or_none,
    argmax_tokens,
    draw_on_device,
    greedy_token,
    normalise,
    sample_token,
    uniform,
    uniforms,
)
from specgen.sampling.rejection import positive_residual, verify_chain
from specgen.sampling.tree import verify_tree
from specgen.sampling.tree_structure import (
    ancestor_matrix,
    ancestors,
    chain_parents,
    tree_children,
    tree_depths,
    tree_paths,
)
from specgen.sampling.verdict import Verdict, VerdictKind
from specgen.sampling.verify import verify, verify_chain_greedy, verify_greedy, verify_tree_greedy

#: A tree's verdict from its path (:meth:`Verdict.tree`), the constructor tree verdicts had before
#: chains and trees shared one :class:`Verdict`.
TreeVerdict = Verdict.tree

__all__ = [
    "NAN_CODE",
    "NONE_ALLOWED_CODE",
    "NoAllowedToken",
    "TreeVerdict",
    "Verdict",
    "VerdictKind",
    "ancestor_matrix",
    "ancestors",
    "argmax_codes",
    "argmax_or_none",
    "argmax_tokens",
    "chain_parents",
    "draw_on_device",
    "greedy_token",
    "normalise",
    "positive_residual",
    "sample_token",
    "tree_children",
    "tree_depths",
    "tree_paths",
    "uniform",
    "uniforms",
    "verify",
    "verify_chain",
    "verify_chain_greedy",
    "verify_greedy",
    "verify_tree",
    "verify_tree_greedy",
]
