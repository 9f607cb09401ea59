"""Turning processed logits into distributions and drawing from them.

All draws go through :func:`uniform` (or :func:`uniforms`, several in one call)
so that each sampled token consumes exactly one number from the request's
generator; this keeps seeded runs reproducible and makes the RNG cost of a
round easy to reason about.

Host syncs: on a GPU every value read back to Python stalls the stream, so these
functions read once per call: :func:`normalise` reads nothing (a row with NaN
logits comes out NaN, a row with no allowed token all zero, and the consumer --
:func:`sample_token`, :func:`argmax_tokens`, the verifiers -- refuses it in the
one read it makes anyway).
"""

from __future__ import annotations

import numpy as np
import torch

from specgen.errors import NumericalError


class NoAllowedToken(NumericalError):  # noqa: N818 (reads as the condition it names)
    """Every token is forbidden at a position (all processed logits are -inf)."""


NAN_MESSAGE = "the model produced NaN logits; refusing to sample from them"
FORBIDDEN_MESSAGE = "every token is forbidden at this position (all logits are -inf)"


def uniform(generator: torch.Generator) -> float:
    """One draw from U[0, 1) using ``generator`` (on the generator's device)."""
    return float(torch.rand((), generator=generator, device=generator.device))


def uniforms(generator: torch.Generator, count: int) -> torch.Tensor:
    """``count`` draws from U[0, 1) in one call: [count] float32 on the generator's device.

    The same numbers, in order, as ``count`` calls of :func:`uniform`."""
    return torch.rand(count, generator=generator, device=generator.device)


def normalise(logits: torch.Tensor) -> torch.Tensor:
    """Softmax of processed logits in float64, without reading anything back.

    logits: [..., vocab], ``-inf`` marks forbidden tokens.
    Returns probabilities [..., vocab] (float64). A row with a NaN logit is NaN
    and a row with no allowed token is all zero: no distribution exists there,
    and every consumer in :mod:`specgen.sampling` raises on such a row
    (:class:`NoAllowedToken` for the zero row, NumericalError for NaN).
    """
    probs = torch.softmax(logits.to(torch.float64), dim=-1)  # [..., vocab]
    forbidden = (logits == float("-inf")).all(dim=-1, keepdim=True)  # [..., 1]
    return probs.masked_fill(forbidden, 0.0)


def raise_for_row(total: float, what: str = "the distribution") -> None:
    """The error for a row whose mass is ``total`` (NaN: NaN logits; 0: nothing allowed)."""
    if total != total:
        raise NumericalError(f"{what}: {NAN_MESSAGE}")
    if not total > 0.0:
        raise NoAllowedToken(f"{what}: {FORBIDDEN_MESSAGE}")


def sample_token(probs: torch.Tensor, generator: torch.Generator, u: torch.Tensor | float | None = None) -> int:
    """Draw one token from ``probs`` [vocab] by inverse CDF with a single uniform.

    u: the uniform to use (a drawn number, e.g. from :func:`uniforms`); None draws one.
    Tokens with zero probability are never returned: the search finds the first
    index whose cumulative mass exceeds ``u * total``. One read: the index and
    the total mass together (a NaN or zero total raises, see :func:`raise_for_row`).
    """
    index, total = draw_on_device(probs, uniforms(generator, 1) if u is None else u)
    index_value, total_value = torch.cat([index.to(torch.float64), total]).tolist()
    raise_for_row(total_value, "cannot sample")
    return int(index_value)


def draw_on_device(probs: torch.Tensor, u: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse-CDF draw of :func:`sample_token` without reading anything back.

    probs: [vocab] with one uniform ``u`` -> (token [1] long, total mass [1] float64);
    or rows [R, vocab] with ``u`` [R], one draw per row -> ([R], [R]); on probs' device.
    A token is only meaningful when its total is finite and > 0 (:func:`raise_for_row`);
    it is always a valid id, so it can be fed on before the caller reads both."""
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)  # [..., vocab]
    total = cdf[..., -1:]  # [..., 1]
    u = torch.as_tensor(u, dtype=torch.float64, device=cdf.device).reshape(total.shape)  # [..., 1]
    index = torch.searchsorted(cdf, u * total, right=True).clamp_max(probs.shape[-1] - 1)  # [..., 1]
    return (index, total) if probs.dim() == 1 else (index.squeeze(-1), total.squeeze(-1))


def argmax_tokens(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of processed logits [N, vocab] in one read; ties go to the lowest id.

    Raises NumericalError for a row with a NaN logit and :class:`NoAllowedToken`
    for a row with every logit -inf."""
    out = argmax_or_none(logits)
    if None in out:
        raise NoAllowedToken(FORBIDDEN_MESSAGE)
    return out


def argmax_or_none(logits: torch.Tensor) -> list[int | None]:
    """Argmax of each row of processed logits [N, vocab] in one read, None for a row with
    every logit -inf (nothing allowed); ties go to the lowest id. Raises NumericalError
    for a row with a NaN logit."""
    out = argmax_codes(logits).tolist()
    if NAN_CODE in out:
        raise NumericalError(NAN_MESSAGE.replace("sample from", "pick a token from"))
    return [None if value == NONE_ALLOWED_CODE else value for value in out]


#: Whether :func:`argmax_codes` reads host (CPU) float rows with numpy; a device's rows take torch's
#: path (tests that count a device's reads on the CPU switch this off to run that path).
HOST_NUMPY = True
#: Codes of :func:`argmax_codes` for rows without an argmax.
NAN_CODE, NONE_ALLOWED_CODE = -1, -2


def argmax_codes(logits: torch.Tensor) -> torch.Tensor:
    """Argmax of each row of processed logits [N, vocab] without reading anything back ->
    [N] long: the argmax id (ties to the lowest), NAN_CODE for a row with a NaN logit,
    NONE_ALLOWED_CODE for a row with every logit -inf."""
    if HOST_NUMPY and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) \
            and not logits.requires_grad:
        # on the host, numpy: its argmax reads a row in one vectorised pass (torch's indexed max walks
        # it element by element) with the same answer, the first maximum or the first NaN of a row
        rows = logits.numpy().reshape(-1, logits.shape[-1])  # [N, vocab]
        indices = rows.argmax(axis=-1)  # [N]
        values = rows[np.arange(len(indices)), indices]  # [N]
        codes = np.where(np.isnan(values), NAN_CODE, np.where(values == -np.inf, NONE_ALLOWED_CODE, indices))
        return torch.from_numpy(codes.astype(np.int64, copy=False)).reshape(logits.shape[:-1])
    values, indices = logits.max(dim=-1)  # [N], [N]
    nan = torch.isnan(values)  # [N]: the maximum is NaN iff the row holds one, so one value per row is read
    return torch.where(nan, NAN_CODE, torch.where(values == float("-inf"), NONE_ALLOWED_CODE, indices))


def greedy_token(logits: torch.Tensor) -> int:
    """Argmax of processed logits [vocab]; ties go to the lowest id (see :func:`argmax_tokens`)."""
    return argmax_tokens(logits.unsqueeze(0))[0]
