"""The chat's engine side: fitting the history (:class:`specgen.engine.chat.ChatHistory`) into the
context, and the streaming loop.

Nothing here imports Textual. :func:`run_reply` runs in the app's thread
worker; it fits the conversation into the model's context, hands batches of
tokens and a stats snapshot to a callback (the app puts them in an
:class:`UpdateInbox` and wakes the UI) and stops at a cancel flag between events,
closing the stream so the engine ends the request on a committed round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from specgen.engine.chat import ChatHistory, uses_template
from specgen.errors import PromptError, SpecgenError, first_line
from specgen.events import FinishEvent, TokenEvent
from specgen.guarantee import Guarantee
from specgen.config.options import RequestOptions, parse_chat
from specgen.stats import Stats
from specgen.tui.tally import PanelSnapshot, Tally

#: Seconds between two updates handed to the UI while tokens stream (about one per frame at 30 fps).
UPDATE_INTERVAL = 1 / 30
#: Share of the model's context kept free for a reply when old turns are dropped to fit.
REPLY_SHARE = 4


def fit_history(pipe, history: ChatHistory, max_new_tokens: int | None = None) -> tuple[str | list[dict], int]:
    """The prompt for ``history`` and how many of its oldest turns were left out to fit the context.

    The prompt must leave ``min(max_new_tokens, context // REPLY_SHARE)`` tokens
    for the reply; the oldest turns are dropped (system messages never) until it
    does. Raises PromptError when even the last message alone cannot fit in the
    context; a last message that fits with less room for the reply is sent as is.
    """
    context = pipe.target.context_length
    max_new = pipe.defaults.max_new_tokens if max_new_tokens is None else max_new_tokens
    limit = context - min(max_new, max(1, context // REPLY_SHARE))
    drops = history.droppable()
    for drop in drops:
        prompt = history.prompt(drop)
        size = len(pipe.encode(prompt))
        if size <= limit:
            return prompt, drop
    if size < context:
        return prompt, drops[-1]
    raise PromptError(f"the message is too long: with it the prompt needs {size} tokens but the model's context "
                      f"is {context}; shorten it"
                      + (" (Ctrl+N starts a new chat)" if len(drops) > 1 else ""))


def prepare_reply(pipe, history: ChatHistory, typed: str) -> None:
    """While ``typed`` is being written as the next user message of ``history``: prefill in the
    background what that turn's prompt will begin with (:meth:`Pipeline.prepare`: the conversation
    up to the message's last complete word, fitted as the reply will fit it). Nothing it meets stops
    the chat: a conversation that does not fit, bad input or a failure prepares nothing, and sending
    the message reports what is wrong."""
    draft = history.copy()
    draft.add("user", typed)
    try:
        prompt, _ = fit_history(pipe, draft)
        pipe.prepare(prompt)
    except Exception:  # a background prefill must not end the app (an uncaught worker error would)
        pass


def reply_guarantee(pipe, speculative: bool) -> Guarantee:
    """The guarantee a reply runs under when speculation is on or off for it."""
    if pipe.speculative and not speculative:
        return Guarantee.off("toggled off (^t)")
    return pipe.guarantee


@dataclass(frozen=True)
class ReplyUpdate:
    """A batch for the UI. ``finish_reason`` is set on the last one only.

    tokens: the engine's own (immutable) TokenEvents, in order.
    tail: text the engine released at the end (held back until then).
    error: a user-facing message when the reply failed; the tokens so far are kept.
    dropped: how many of the oldest turns were left out of the prompt to fit the context.
    """

    tokens: tuple[TokenEvent, ...]
    snapshot: PanelSnapshot
    finish_reason: str | None = None
    tail: str = ""
    error: str | None = None
    dropped: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: ReplyUpdate) -> ReplyUpdate:
        """This update followed by ``later``, as one: tokens and tail joined, the rest from ``later``."""
        return ReplyUpdate(self.tokens + later.tokens, later.snapshot, later.finish_reason, self.tail + later.tail,
                           later.error or self.error, max(self.dropped, later.dropped))


class UpdateInbox:
    """Where the worker leaves updates for the UI thread, merged until taken.

    ``put`` returns True only when the inbox was empty, so the worker wakes the
    UI with one message and never more than one is waiting: however fast tokens
    arrive, the UI draws them in batches of whatever came since its last frame
    and its queue (and Esc behind it) never backs up.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: ReplyUpdate | None = None

    def put(self, update: ReplyUpdate) -> bool:
        """Add ``update``; True when the UI must be told (the inbox was empty)."""
        with self._lock:
            was_empty = self._waiting is None
            self._waiting = update if was_empty else self._waiting.then(update)
            return was_empty

    def take(self) -> ReplyUpdate | None:
        """Everything put since the last take, as one update (None if nothing)."""
        with self._lock:
            update, self._waiting = self._waiting, None
            return update


@dataclass(frozen=True)
class ReplyRequest:
    """One reply to generate: prompt, limits and whether to speculate.

    prompt: a ready prompt, or a ChatHistory snapshot that :func:`fit_history`
    fits into the context in the worker.
    """

    prompt: str | list[dict] | ChatHistory
    speculative: bool
    seed: int
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()


def open_stream(pipe, prompt: str | list[dict], request: ReplyRequest, stats: Stats):
    """Start the stream; the engine fills ``stats`` as rounds commit."""
    options = RequestOptions(max_new_tokens=request.max_new_tokens, seed=request.seed, stop=request.stop,
                             speculative=request.speculative, stats=stats)
    return pipe.stream(prompt, options)


def run_reply(pipe, request: ReplyRequest, cancel: threading.Event, emit: Callable[[ReplyUpdate], None],
              interval: float = UPDATE_INTERVAL) -> ReplyUpdate:
    """Stream one reply, calling ``emit`` with batches; return (and emit) the final update.

    A ChatHistory prompt is first fitted into the context (:func:`fit_history`);
    every update carries how many old turns were left out. Cancelling
    (``cancel`` set) closes the stream between events: the engine has committed
    or rolled back every round by then, and the partial reply stands with
    finish_reason "cancelled". Errors become ``ReplyUpdate.error``; none escape.
    """
    guarantee = reply_guarantee(pipe, request.speculative)
    speculative = request.speculative and pipe.speculative
    tally = Tally(guarantee, speculative)
    batch: list[TokenEvent] = []
    dropped = 0
    last = time.perf_counter()
    try:
        prompt = request.prompt
        if isinstance(prompt, ChatHistory):
            prompt, dropped = fit_history(pipe, prompt, request.max_new_tokens)
        stream = open_stream(pipe, prompt, request, tally.live)
        for event in stream:
            if isinstance(event, FinishEvent):
                tally.finish(event.generation.stats)
                return _final(emit, batch, tally, event.finish_reason, dropped, tail=event.text)
            batch.append(event)
            if cancel.is_set():
                stream.close()
                return _final(emit, batch, tally, "cancelled", dropped)
            if time.perf_counter() - last >= interval:
                emit(ReplyUpdate(tuple(batch), tally.snapshot(), dropped=dropped))
                batch, last = [], time.perf_counter()
        return _final(emit, batch, tally, "cancelled", dropped)
    except SpecgenError as exc:
        return _final(emit, batch, tally, "error", dropped, error=str(exc))
    except Exception as exc:  # the UI must survive any engine failure
        return _final(emit, batch, tally, "error", dropped,
                      error=f"{type(exc).__name__}: {first_line(exc, 'unexpected error')}")


def _final(emit, batch, tally: Tally, reason: str, dropped: int, *, tail: str = "",
           error: str | None = None) -> ReplyUpdate:
    update = ReplyUpdate(tuple(batch), tally.snapshot(reason), reason, tail, error, dropped)
    emit(update)
    return update


def load_pipeline(cfg):
    """Build the pipeline quietly for the app; raise SpecgenError with a clear message on any failure."""
    from specgen.engine.assemble import build_pipeline

    try:
        pipe = build_pipeline(cfg, progress=False)
        uses_template(pipe)  # a bad chat= setting fails here, not later on the UI thread
        return pipe
    except SpecgenError:
        raise
    except Exception as exc:
        raise SpecgenError(f"could not load the models: {type(exc).__name__}: {first_line(exc, 'unexpected error')}") from exc
