"""Speculative acceptance for a chain of drafted tokens.

Terms, defined once (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with
Speculative Sampling"):

* **target_probs** -- the target's distribution at each candidate position, after
  every processor, conditioned on the committed prefix plus the candidates before
  that position. Row ``i`` scores draft token ``i``; the last row is the bonus row.
* **draft_probs** -- the distribution the drafter actually sampled candidate ``i``
  from. ``None`` means the draft was deterministic (q is one-hot on the token).
* **accepted** -- a draft token kept with probability ``min(1, p(x) / q(x))``.
* **resampled** -- after the first rejection at position ``i``, a token drawn from
  the normalised positive residual ``(p_i - q_i)+``; the round ends there.
* **bonus** -- when every draft token is accepted, one extra token drawn from the
  last target row.

Each accepted path contributes ``min(p, q)`` and each rejection ``p - min(p, q)``,
so the committed token has distribution exactly ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.errors import NumericalError
from specgen.sampling.probs import sample_token, uniform

#: Residual mass below this (relative to 1) is treated as round-off, see positive_residual.
RESIDUAL_EPS = 1e-12


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one chain.

    num_accepted: how many leading draft tokens were kept (0..len(draft)).
    next_token: the one token the target adds (resampled or bonus).
    kind: "resampled" if a draft token was rejected, else "bonus".
    accept_probs: min(1, p/q) for every draft position that was checked.
    """

    num_accepted: int
    next_token: int
    kind: str
    accept_probs: tuple[float, ...]


def positive_residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Normalised ``max(p - q, 0)`` for one position (both [vocab], float64).

    Fallback, defined and tested: if the residual has (numerically) no mass --
    which happens only when p and q agree up to round-off, so a rejection had
    probability ~0 -- the target row itself is returned. That is the limit of the
    residual as q -> p along any path and never assigns mass where p is zero.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)  # [vocab]
    mass = float(residual.sum())
    if mass <= RESIDUAL_EPS:
        return target_probs / target_probs.sum()
    return residual / mass


def _draft_row(draft_probs: torch.Tensor | None, token: int, like: torch.Tensor) -> torch.Tensor:
    if draft_probs is not None:
        return draft_probs
    row = torch.zeros_like(like)
    row[token] = 1.0
    return row


def verify_chain(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: list[int],
    generator: torch.Generator,
) -> Verdict:
    """Exact speculative sampling over a chain.

    target_probs: [num_draft + 1, vocab] float64
    draft_probs:  [num_draft, vocab] float64, or None for a deterministic draft
    draft_tokens: num_draft token ids
    Consumes one uniform per checked position plus one for the final draw.
    """
    num_draft = len(draft_tokens)
    if target_probs.shape[0] != num_draft + 1:
        raise ValueError(f"need {num_draft + 1} target rows for {num_draft} draft tokens, got {target_probs.shape[0]}")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_draft, target_probs.shape[1]):
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)} does not match {num_draft} x vocab")
    accept_probs: list[float] = []
    for i, token in enumerate(draft_tokens):
        p_row = target_probs[i]
        q_row = _draft_row(None if draft_probs is None else draft_probs[i], token, p_row)
        q_x = float(q_row[token])
        if not q_x > 0.0:
            raise NumericalError(f"draft token {token} at position {i + 1} has zero draft probability")
        ratio = min(1.0, float(p_row[token]) / q_x)
        accept_probs.append(ratio)
        if uniform(generator) < ratio:
            continue
        next_token = sample_token(positive_residual(p_row, q_row), generator)
        return Verdict(i, next_token, "resampled", tuple(accept_probs))
    bonus = sample_token(target_probs[num_draft], generator)
    return Verdict(num_draft, bonus, "bonus", tuple(accept_probs))


def verify_chain_greedy(target_tokens: list[int], draft_tokens: list[int]) -> Verdict:
    """Greedy verification: keep the longest prefix equal to the target's argmaxes.

    target_tokens: num_draft + 1 argmax ids of the processed target logits.
    The output equals plain greedy decoding token for token.
    """
    if len(target_tokens) != len(draft_tokens) + 1:
        raise ValueError("need one more target token than draft tokens")
    accept_probs: list[float] = []
    for i, token in enumerate(draft_tokens):
        if token != target_tokens[i]:
            accept_probs.append(0.0)
            return Verdict(i, target_tokens[i], "resampled", tuple(accept_probs))
        accept_probs.append(1.0)
    return Verdict(len(draft_tokens), target_tokens[-1], "bonus", tuple(accept_probs))
