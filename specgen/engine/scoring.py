"""The logprobs of committed tokens, recorded by a round from the rows it already computed.

The law (README "Logprobs"): the log-softmax (float64) of the processed target row a token was
drawn from or verified against -- the p of its round at the run's temperature; under greedy
decoding the row after the processors that can change the argmax, at temperature 1 -- or of the
raw target row when the request asks for ``logprobs_of="raw"``. A token accepted from a draft is
scored on its verify row, so it reports what plain decoding reports up to the backend's batch
invariance (bit for bit where verify rows equal single-token rows). ``ctx`` below is the
request's :class:`specgen.engine.round.RoundContext`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specgen.processors import PathHistory
from specgen.sampling.logprobs import TokenLogprob, token_logprobs
from specgen.sampling.verdict import Verdict
from specgen.engine.state import Request


def score_committed(ctx, raw: torch.Tensor, logits: torch.Tensor,
                    tokens: list[int]) -> list[TokenLogprob] | None:
    """The logprobs of ``tokens`` (row i's token at row i) when the request asks for them, else None.

    raw / logits: [>= len(tokens), vocab] the target's raw and processed rows the tokens were drawn
    from or verified against. The law: log-softmax of the processed row (the p the token came from,
    at the run's temperature; greedy, at temperature 1 after the processors that can change the
    argmax), or of the raw row with ``ctx.raw_logprobs``. No forward: the round's own rows."""
    if ctx.logprobs is None:
        return None
    return token_logprobs(raw if ctx.raw_logprobs else logits, tokens, ctx.logprobs)


def kept_scores(request: Request, ctx, scores: list[TokenLogprob] | None, kept: int) -> None:
    """After a commit that kept ``kept`` tokens: their logprobs join the request's and the emit stage's."""
    request.scored = None if scores is None else scores[:kept]
    if scores is not None:
        request.logprobs.extend(request.scored)


def tree_scores(request: Request, ctx, tree: Verdict, paths: list[list[int]],
                row_logits: Callable[[int], torch.Tensor]) -> list[TokenLogprob]:
    """The emitted tokens' logprobs (:func:`score_committed`): token i from the row of the i-th node
    on the accepted path's way down (the root's first), processed on that node's path."""
    nodes = [-1, *tree.path][: len(tree.emitted)]
    raw = torch.cat([row_logits(node + 1) for node in nodes])  # [num_emitted, vocab]
    history = PathHistory(request.committed, [paths[node] if node >= 0 else [] for node in nodes])
    logits = raw if ctx.raw_logprobs else (ctx.stack.read_only(raw, history) if ctx.stack.greedy
                                           else ctx.stack.logits(raw, history))
    return score_committed(ctx, raw, logits, tree.emitted)


def scored(request: Request, i: int) -> TokenLogprob | None:
    """The logprob of the last commit's i-th kept token (None when the request asks for none)."""
    return None if request.scored is None else request.scored[i]
