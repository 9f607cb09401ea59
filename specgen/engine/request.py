"""One checked request and its bookkeeping, shared by the single engine and the batched one.

:class:`RequestPlan` is what :meth:`specgen.engine.pipeline.Pipeline.plan_request` derives from a
prompt and its options; :func:`specgen.engine.pipeline.Pipeline.stream` runs one, and each row of
:mod:`specgen.batch` is one. :func:`record` and :func:`finish` keep a request's Stats and
build its :class:`~specgen.events.Generation` the same way in both engines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specgen.events import FinishEvent, Generation, TokenEvent
from specgen.guarantee import Guarantee
from specgen.config.options import RequestOptions
from specgen.processors import ProcessorStack
from specgen.engine.state import Request
from specgen.stats import Stats


@dataclass
class RequestPlan:
    """One checked request: the prompt's ids, its token limit (``context_bound``: the
    context, not max_new_tokens, sets it), its resolved options, whether it speculates,
    its guarantee, processor stack and γ (0 when it does not speculate). next_turn: for
    chat messages, the reply's text -> the ids a next turn's prompt is expected to start with
    ([] when not known); None for other prompts."""

    ids: list[int]
    max_new: int
    context_bound: bool
    options: RequestOptions
    use_spec: bool
    guarantee: Guarantee
    stack: ProcessorStack
    gamma: int | str
    next_turn: Callable[[str], list[int]] | None


def record(stats: Stats, events: Sequence[TokenEvent], start: float) -> None:
    """After a round or step committed ``events``: time to first token (once), new tokens, wall
    (seconds since ``start``, a ``time.perf_counter`` reading)."""
    now = time.perf_counter()
    if stats.ttft is None:
        stats.ttft = now - start
    stats.new_tokens += len(events)
    stats.wall = now - start


def finish(request: Request, plan: RequestPlan, stats: Stats, start: float) -> FinishEvent:
    """The request's last event: its held-back text and :class:`Generation`. Invariant: the request
    has a finish reason; "length" becomes "context" when the context, not max_new_tokens, bound it."""
    stats.wall = time.perf_counter() - start
    reason = request.finish_reason
    if reason == "length" and plan.context_bound:
        reason = "context"
    tail = request.text.flush()
    logprobs = None if plan.options.logprobs is None else list(request.logprobs)
    generation = Generation(request.text.text, list(request.generated), plan.guarantee, reason, stats, plan.ids,
                            logprobs, request.prompt_logprobs)
    return FinishEvent(tail, reason, generation)
