"""Turning processed logits into distributions and drawing from them.

All draws go through :func:`uniform` so that each sampled token consumes exactly
one number from the request's generator; this keeps seeded runs reproducible and
makes the RNG cost of a round easy to reason about.
"""

from __future__ import annotations

import torch

from specgen.errors import NumericalError


def uniform(generator: torch.Generator) -> float:
    """One draw from U[0, 1) using ``generator`` (on the generator's device)."""
    return float(torch.rand((), generator=generator, device=generator.device))


def normalise(logits: torch.Tensor) -> torch.Tensor:
    """Softmax of processed logits in float64.

    logits: [..., vocab], ``-inf`` marks forbidden tokens.
    Returns probabilities [..., vocab] (float64). Raises NumericalError if a row has
    NaN or no allowed token, since no distribution exists there.
    """
    if torch.isnan(logits).any():
        raise NumericalError("the model produced NaN logits; refusing to sample from them")
    finite_rows = torch.isfinite(logits).any(dim=-1) | (logits == float("inf")).any(dim=-1)
    if not bool(finite_rows.all()):
        raise NumericalError("every token is forbidden at this position (all logits are -inf)")
    return torch.softmax(logits.to(torch.float64), dim=-1)


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from ``probs`` [vocab] by inverse CDF with a single uniform.

    Tokens with zero probability are never returned: the search finds the first
    index whose cumulative mass exceeds ``u * total``.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # [vocab]
    total = float(cdf[-1])
    if not total > 0.0:
        raise NumericalError("cannot sample from a distribution with no mass")
    target = torch.tensor([uniform(generator) * total], dtype=torch.float64, device=cdf.device)
    index = int(torch.searchsorted(cdf, target, right=True))
    return min(index, probs.shape[-1] - 1)


def greedy_token(logits: torch.Tensor) -> int:
    """Argmax of processed logits [vocab]; ties go to the lowest id (torch.argmax)."""
    if torch.isnan(logits).any():
        raise NumericalError("the model produced NaN logits; refusing to pick a token")
    return int(torch.argmax(logits, dim=-1))
