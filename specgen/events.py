"""What the engine yields. Consumers (CLI, TUI, scripts, bench) only read these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from specgen.guarantee import Guarantee
from specgen.sampling.logprobs import TokenLogprob
from specgen.stats import Stats

#: How a committed token was produced (see :class:`TokenEvent`).
TokenKind = Literal["accepted", "resampled", "bonus", "plain"]
TOKEN_KINDS: tuple[str, ...] = get_args(TokenKind)

#: Why a request ended (see :class:`Generation`).
FinishReason = Literal["eos", "length", "stop", "context", "dead_end"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


@dataclass(frozen=True)
class TokenEvent:
    """One committed token.

    kind: "accepted" (a draft token kept), "resampled" (drawn from the residual
        after a rejection), "bonus" (drawn from the target after every draft token
        was accepted), "plain" (drawn from the target with nothing drafted: speculation
        off, or a speculative round that drafted nothing).
    draft_position: 1-based position in the round's draft this token took (for
        "bonus", number of drafts + 1); None for "plain".
    accept_prob: min(1, p/q) for accepted tokens and for the rejected draft token
        a resample replaced; None for bonus/plain.
    text: text this token releases (may be "" while a character or a possible
        stop string is incomplete).
    gamma: draft tokens (tree nodes) the round verified, as fixed or as the
        planner chose them; 0 for the "plain" token of a speculative round that
        drafted nothing; None when speculation is off.
    logprob: the token's logprob and top alternatives when the request asked for them
        (``logprobs=k``; the law is in README "Logprobs"), else None.
    """

    token_id: int
    text: str
    kind: TokenKind
    draft_position: int | None
    accept_prob: float | None
    round: int
    gamma: int | None = None
    logprob: TokenLogprob | None = None


@dataclass(frozen=True)
class FinishEvent:
    """Last event of a stream: remaining text and the whole result."""

    text: str
    finish_reason: FinishReason
    generation: Generation

    kind = "finish"


@dataclass(frozen=True)
class Generation:
    """The result of one request.

    text / token_ids: new tokens only (token_ids include an EOS that ended it).
    guarantee: what the run promised (``str(guarantee)`` is its printed form, e.g. "exact").
    finish_reason: "eos" | "length" | "stop" | "context" (context window full) | "dead_end".
    logprobs: one per token of token_ids when the request asked (``logprobs=k``), else None.
    prompt_logprobs: with ``echo=True``, one per prompt token (the first None: nothing predicts it),
        the target's teacher-forced raw log-softmax (see :meth:`specgen.engine.pipeline.Pipeline.score`), else None.
    """

    text: str
    token_ids: list[int]
    guarantee: Guarantee
    finish_reason: FinishReason
    stats: Stats
    prompt_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
