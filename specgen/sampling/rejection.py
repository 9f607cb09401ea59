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
* **dead_end** -- target row ``i >= 1`` allows no token (all zero: e.g. the
  grammar has no continuation after draft tokens ``0..i-1``, see
  :mod:`specgen.grammar.processor`). If verification reaches row ``i`` -- every
  earlier draft token accepted -- the round commits those ``i`` tokens and no
  other, and the request ends with ``finish_reason="dead_end"``: exactly where
  plain decoding, having committed the same tokens, would meet the dead end. If
  an earlier token is rejected, the empty row is never looked at. An empty row 0
  (the committed position) still raises :class:`NoAllowedToken`, as in plain
  decoding.

Each accepted path contributes ``min(p, q)`` and each rejection ``p - min(p, q)``,
so the committed token has distribution exactly ``p``.

**Deterministic drafts are verified by coupling.** For a one-hot q on draft token d the rule
above accepts d with probability p(d) and otherwise draws from p without d. Drawing
``y = inverse-CDF(p, u)`` with the position's uniform and accepting iff ``y == d`` (emitting y
at the first mismatch) has exactly that law, and the token at each position is then the one
plain decoding draws with the same uniform. The verifier consumes one uniform per committed
token, so a seeded request gives the same tokens whatever the draft lengths were: plain
decoding's tokens (:func:`verify_chain`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.errors import NumericalError
from specgen.sampling.probs import NoAllowedToken, draw_on_device, raise_for_row, sample_token, uniforms
from specgen.sampling.verdict import Verdict

#: Residual mass below this (relative to 1) is treated as round-off, see positive_residual.
RESIDUAL_EPS = 1e-12
#: Probability rows must sum to 1 within this tolerance.
PROB_SUM_TOL = 1e-6


def positive_residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Normalised ``max(p - q, 0)`` for one position (both [vocab], float64) or row by row
    (both [..., vocab]), read nothing back.

    Fallback, defined and tested: if the residual has (numerically) no mass --
    which happens only when p and q agree up to round-off, so a rejection had
    probability ~0 -- the target row itself is returned. That is the limit of the
    residual as q -> p along any path and never assigns mass where p is zero.
    """
    residual = (target_probs - draft_probs).clamp_min(0.0)  # [..., vocab]
    mass = residual.sum(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(mass > RESIDUAL_EPS, residual / mass, target_probs / target_probs.sum(dim=-1, keepdim=True))


def row_health(probs: torch.Tensor) -> torch.Tensor:
    """[..., vocab] probability rows -> [4] float64 on their device, read together with
    other values: (any non-finite, any negative, any all-zero row, worst |row sum - 1|
    over the rows that are not all zero)."""
    if probs.numel() == 0:
        return torch.zeros(4, dtype=torch.float64, device=probs.device)
    sums = probs.sum(dim=-1)  # [...]
    zero = sums == 0  # [...]
    return torch.stack([(~torch.isfinite(probs)).any(), (probs < 0).any(), zero.any(),
                        (sums - 1.0).abs().masked_fill(zero, 0.0).nan_to_num(0.0).max()]).to(torch.float64)


def rows_health(probs: torch.Tensor) -> torch.Tensor:
    """[R, vocab] probability rows -> [R, 4] float64: :func:`row_health` of each row on its own."""
    sums = probs.sum(dim=-1)  # [R]
    zero = sums == 0  # [R]
    return torch.stack([(~torch.isfinite(probs)).any(dim=-1), (probs < 0).any(dim=-1), zero,
                        (sums - 1.0).abs().masked_fill(zero, 0.0).nan_to_num(0.0)], dim=-1).to(torch.float64)


def check_health(health: list[float], what: str, allow_empty: bool = False) -> None:
    """Raise for the values of :func:`row_health` (NaN, negative, nothing allowed, unnormalised).

    allow_empty: all-zero rows are dead ends the caller handles (target rows at
    draft positions, module docstring), not an error."""
    nonfinite, negative, zero_row, worst = health
    if nonfinite:
        raise NumericalError(f"{what} contains NaN or Inf (NaN logits?)")
    if negative:
        raise NumericalError(f"{what} has negative probabilities")
    if zero_row and not allow_empty:
        raise NoAllowedToken(f"{what}: every token is forbidden at a position (all logits are -inf)")
    if worst > PROB_SUM_TOL:
        raise NumericalError(f"{what} sums to 1 ± {worst:.3g}, not 1 (rows must be normalised)")


def check_tokens(tokens: list[int], vocab: int, what: str = "draft_tokens") -> None:
    """Every entry a plain int id in [0, vocab) (host-side, reads nothing back)."""
    for i, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
            raise ValueError(f"{what}[{i}] = {token!r} is not a token id of a vocabulary of {vocab}")


def _draft_row(draft_probs: torch.Tensor | None, token: int, like: torch.Tensor) -> torch.Tensor:
    if draft_probs is not None:
        return draft_probs
    row = torch.zeros_like(like)
    row[token] = 1.0
    return row


@dataclass(frozen=True)
class _ChainReads:
    """What :func:`verify_chain` reads back in its one read of the inputs, checked.

    dead: num_draft + 1 flags, True where the target row allows nothing; p_values,
    q_values: p(x_i) and q(x_i) of each draft token (q = 1.0 for a deterministic draft);
    u_values: the num_draft + 1 uniforms; ahead: the draws made ahead (None without
    draw_ahead), as :func:`_draws_ahead` lays them out."""

    dead: list[bool]
    p_values: list[float]
    q_values: list[float]
    u_values: list[float]
    ahead: list[float] | None


def _check_chain_shapes(target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                        draft_tokens: list[int]) -> int:
    """Shape and token-id checks of :func:`verify_chain`'s inputs (reads nothing back); -> vocab."""
    num_draft = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != num_draft + 1:
        raise ValueError(f"need {num_draft + 1} target rows for {num_draft} draft tokens, "
                         f"got shape {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (num_draft, vocab):
        raise ValueError(f"draft_probs shape {tuple(draft_probs.shape)} does not match {num_draft} x vocab")
    check_tokens(draft_tokens, vocab)
    return vocab


def _read_chain(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, index: torch.Tensor,
                generator: torch.Generator, draw_ahead: bool) -> _ChainReads:
    """Gather the rows' health, the empty rows, p(x) and q(x) of every draft token, the
    num_draft + 1 uniforms (drawn here, in one call) and, with ``draw_ahead``, every final
    draw, and read them back in one transfer; raise for unhealthy rows (NoAllowedToken for
    an empty target row 0).

    index: [num_draft] the draft token ids on the target rows' device."""
    num_draft = index.shape[0]
    device = target_probs.device
    positions = torch.arange(num_draft, device=device)  # [num_draft]
    p_x = target_probs[positions, index].to(torch.float64)  # [num_draft]
    empty = (target_probs.sum(dim=-1) == 0).to(torch.float64)  # [num_draft + 1] 1.0 where nothing is allowed
    parts = [row_health(target_probs), empty, p_x]
    if draft_probs is not None:
        parts += [row_health(draft_probs), draft_probs[positions, index].to(torch.float64)]
    u = uniforms(generator, num_draft + 1).to(device, torch.float64)  # [num_draft + 1]
    if draw_ahead:
        parts.append(_draws_ahead(target_probs, draft_probs, index, u))  # [2 * (num_draft + 1)]
    values = torch.cat([*parts, u]).tolist()  # the one read of the inputs
    ahead = None
    if draw_ahead:  # take the draws out: [..., draws ahead (2 (n + 1)), u (n + 1)]
        width = num_draft + 1
        ahead, values = values[-3 * width: -width], values[: -3 * width] + values[-width:]
    check_health(values[:4], "target_probs", allow_empty=True)
    dead = [bool(v) for v in values[4: 5 + num_draft]]
    if dead[0]:
        raise NoAllowedToken("target_probs: every token is forbidden at the first position (all logits are -inf)")
    values = values[5 + num_draft:]
    if draft_probs is not None:
        check_health(values[num_draft: 4 + num_draft], "draft_probs")
        q_values = values[4 + num_draft: 4 + 2 * num_draft]
    else:
        q_values = [1.0] * num_draft
    return _ChainReads(dead, values[:num_draft], q_values, values[-(num_draft + 1):], ahead)


def _resample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: list[int],
              reads: _ChainReads, i: int, generator: torch.Generator) -> int:
    """The token drawn after rejecting draft token ``i``: from the normalised positive
    residual of target row ``i`` against draft row ``i`` (one-hot for a deterministic
    draft) with ``u[i + 1]``, or the draw made ahead for that row."""
    if reads.ahead is not None:
        return _drawn_ahead(reads.ahead, i, len(draft_tokens))
    p_row = target_probs[i]
    q_row = _draft_row(None if draft_probs is None else draft_probs[i], draft_tokens[i], p_row)
    return sample_token(positive_residual(p_row, q_row), generator, reads.u_values[i + 1])


def verify_chain(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_tokens: list[int],
    generator: torch.Generator,
    draw_ahead: bool = False,
) -> Verdict:
    """Exact speculative sampling over a chain.

    target_probs: [num_draft + 1, vocab] float64, rows summing to 1 (rows >= 1 may be all zero: dead ends)
    draft_probs:  [num_draft, vocab] float64 rows summing to 1, or None for a deterministic draft
    draft_tokens: num_draft token ids in [0, vocab)
    Draws num_draft + 1 uniforms in one call: ``u[i]`` decides position ``i``, and
    the final draw (residual after a rejection at ``i``, or the bonus) uses
    ``u[i + 1]`` -- the numbers one :func:`~specgen.sampling.probs.uniform` per
    checked position plus one for the final draw would give.

    A deterministic draft (``draft_probs`` None) is verified by coupling (module
    docstring): position ``i`` draws ``y_i`` from target row ``i`` with ``u[i]`` as
    :func:`~specgen.sampling.probs.sample_token` would, keeps draft token ``i`` iff
    ``y_i`` equals it and otherwise ends the round with ``y_i``; full acceptance adds
    the bonus drawn with ``u[num_draft]``. The generator is then left as if one
    uniform had been drawn per committed token, so a seeded run's tokens equal plain
    decoding's with the same seed, whatever the draft lengths.

    An all-zero target row ``i >= 1`` is a dead end: reaching it gives
    a "dead_end" verdict with ``i`` tokens accepted (module docstring).

    Host reads: one for the input checks, p(x) and q(x) of every draft token, the
    empty target rows and the uniforms together, one for the final draw.
    draw_ahead: also make the final draw of every possible outcome on the device (the
    residual after a rejection at each position, the bonus) with the same uniforms,
    and read them with the rest: one read per round and the same verdicts, for
    (num_draft + 1) x vocab more work -- worth it where a read stalls a stream. Raises
    ValueError for mismatched shapes or a bad token id, NumericalError for NaN /
    negative / unnormalised rows (NoAllowedToken for target row 0 or a draft row
    with nothing allowed) or a draft token with zero draft probability.
    """
    num_draft = len(draft_tokens)
    _check_chain_shapes(target_probs, draft_probs, draft_tokens)
    index = torch.tensor(draft_tokens, dtype=torch.long, device=target_probs.device)  # [num_draft]
    start = generator.get_state() if draft_probs is None and num_draft else None
    reads = _read_chain(target_probs, draft_probs, index, generator, draw_ahead)
    if draft_probs is None:
        verdict = _verify_coupled(target_probs, draft_tokens, reads, generator)
        used = verdict.num_accepted + (verdict.next_token is not None)
        if start is not None and used < num_draft + 1:  # give back the uniforms of positions not committed
            generator.set_state(start)
            uniforms(generator, used)
        return verdict
    accept_probs: list[float] = []
    for i, token in enumerate(draft_tokens):
        if reads.dead[i]:
            return Verdict.chain(draft_tokens, i, None, "dead_end", tuple(accept_probs))
        if not reads.q_values[i] > 0.0:
            raise NumericalError(f"draft token {token} at position {i + 1} has zero draft probability")
        ratio = min(1.0, reads.p_values[i] / reads.q_values[i])
        accept_probs.append(ratio)
        if not reads.u_values[i] < ratio:
            next_token = _resample(target_probs, draft_probs, draft_tokens, reads, i, generator)
            return Verdict.chain(draft_tokens, i, next_token, "resampled", tuple(accept_probs))
    if reads.dead[num_draft]:
        return Verdict.chain(draft_tokens, num_draft, None, "dead_end", tuple(accept_probs))
    if reads.ahead is not None:
        bonus = _drawn_ahead(reads.ahead, num_draft, num_draft)
        return Verdict.chain(draft_tokens, num_draft, bonus, "bonus", tuple(accept_probs))
    bonus = sample_token(target_probs[num_draft], generator, reads.u_values[num_draft])
    return Verdict.chain(draft_tokens, num_draft, bonus, "bonus", tuple(accept_probs))


def _draws_ahead(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, index: torch.Tensor,
                 u: torch.Tensor) -> torch.Tensor:
    """Every final draw :func:`verify_chain` may need, without a read: row ``i < n`` is the
    residual after rejecting draft token ``i`` (:func:`positive_residual`, row by row),
    row ``n`` the bonus row; row ``i`` is drawn with ``u[i + 1]`` as :func:`sample_token`
    would. For a deterministic draft (coupled), row ``i`` is target row ``i`` drawn with
    ``u[i]``. -> [2 * (n + 1)] float64: the drawn ids, then each row's total mass."""
    num_draft = index.shape[0]
    p = target_probs.to(torch.float64)  # [n + 1, vocab]
    if draft_probs is None:  # coupled: row i is target row i drawn with u[i] (module docstring)
        rows, draws = p, u  # [n + 1, vocab], [n + 1]
    else:
        q = draft_probs.to(p.device, torch.float64)  # [n, vocab]
        rows = torch.cat([positive_residual(p[:num_draft], q), p[num_draft:]])  # [n + 1, vocab]
        draws = torch.cat([u[1:], u[num_draft:]])  # [n + 1]: rows i < n use u[i + 1], the bonus row u[n]
    ids, total = draw_on_device(rows, draws)  # [n + 1], [n + 1]
    return torch.cat([ids.to(torch.float64), total])


def _drawn_ahead(ahead: list[float], row: int, num_draft: int) -> int:
    """The id drawn ahead for ``row``, refused as :func:`sample_token` refuses its row."""
    raise_for_row(ahead[num_draft + 1 + row], "cannot sample")
    return int(ahead[row])


def _verify_coupled(target_probs: torch.Tensor, draft_tokens: list[int], reads: _ChainReads,
                    generator: torch.Generator) -> Verdict:
    """The coupled verdict of a deterministic draft (:func:`verify_chain`): each reached
    row is drawn with its own uniform, row by row (or read from the draws made ahead)."""
    num_draft = len(draft_tokens)

    def drawn(row: int) -> int:
        if reads.ahead is not None:
            return _drawn_ahead(reads.ahead, row, num_draft)
        return sample_token(target_probs[row], generator, reads.u_values[row])

    accept_probs: list[float] = []
    for i, token in enumerate(draft_tokens):
        if reads.dead[i]:
            return Verdict.chain(draft_tokens, i, None, "dead_end", tuple(accept_probs))
        accept_probs.append(min(1.0, reads.p_values[i]))
        y = drawn(i)
        if y != token:
            return Verdict.chain(draft_tokens, i, y, "resampled", tuple(accept_probs))
    if reads.dead[num_draft]:
        return Verdict.chain(draft_tokens, num_draft, None, "dead_end", tuple(accept_probs))
    return Verdict.chain(draft_tokens, num_draft, drawn(num_draft), "bonus", tuple(accept_probs))
