"""Pure sampling maths: distributions, draws and speculative acceptance.

Nothing here touches a model, a cache or I/O; every function takes tensors and
an explicit ``torch.Generator`` and returns plain values.
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
from specgen.sampling.rejection import (
    Verdict,
    positive_residual,
    verify_chain,
    verify_chain_greedy,
)
from specgen.sampling.tree import verify_tree
from specgen.sampling.tree_greedy import verify_tree_greedy
from specgen.sampling.tree_structure import (
    TreeVerdict,
    ancestor_matrix,
    ancestors,
    tree_children,
    tree_depths,
    tree_paths,
)

__all__ = [
    "NAN_CODE",
    "NONE_ALLOWED_CODE",
    "NoAllowedToken",
    "TreeVerdict",
    "Verdict",
    "ancestor_matrix",
    "ancestors",
    "argmax_codes",
    "argmax_or_none",
    "argmax_tokens",
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
    "verify_chain",
    "verify_chain_greedy",
    "verify_tree",
    "verify_tree_greedy",
]
