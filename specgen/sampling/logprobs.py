"""Log-probabilities of chosen tokens under a row of logits, with the k most likely alternatives.

The law every reported logprob follows (see README "Logprobs"): the log-softmax, in
float64, of the logits row the token was drawn from or verified against. Each row is
reduced on its own, so a row's numbers do not depend on how many rows are scored together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import math

import torch

#: The most alternatives a request may ask for (as the OpenAI API allows).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """token_id's log-probability and the ``top`` most likely tokens as (token_id, logprob) pairs,
    most likely first (ties: the lower id first), forbidden (-inf) tokens left out; ``top`` is empty
    when no alternatives were asked."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits: [N, vocab] (N >= len(tokens)); tokens: the id chosen at each of the first len(tokens)
    rows; top: alternatives per token (0..MAX_TOP_LOGPROBS). One host read for all rows."""
    n = len(tokens)
    if not n:
        return []
    logp = torch.log_softmax(logits[:n].to(torch.float64), dim=-1)  # [n, vocab]
    index = torch.tensor(tokens, dtype=torch.long, device=logp.device).unsqueeze(-1)  # [n, 1]
    chosen = logp.gather(-1, index).squeeze(-1)  # [n]
    if not top:
        return [TokenLogprob(t, v) for t, v in zip(tokens, chosen.tolist(), strict=True)]
    values, ids = torch.sort(logp, dim=-1, descending=True, stable=True)  # [n, vocab] each: ties keep the lower id first
    k = min(top, logp.shape[-1])
    read = torch.cat([chosen.unsqueeze(-1), values[:, :k], ids[:, :k].to(torch.float64)], dim=-1).tolist()  # [n, 1+2k]
    return [TokenLogprob(t, row[0], tuple((int(i), v) for i, v in zip(row[1 + k:], row[1:1 + k], strict=True)
                                          if v != -math.inf))
            for t, row in zip(tokens, read, strict=True)]
