"""The chat's engine side: history, prompt building and the streaming loop.

Nothing here imports Textual. :func:`run_reply` runs in the app's thread
worker; it hands batches of tokens and a stats snapshot to a callback (the app
turns them into messages) and stops at a cancel flag between events, closing
the stream so the engine ends the request on a committed round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specgen.errors import SpecgenError, first_line
from specgen.events import FinishEvent, TokenEvent
from specgen.stats import Stats
from specgen.tui.tally import PanelSnapshot, Tally

#: Seconds between two updates handed to the UI while tokens stream.
UPDATE_INTERVAL = 0.05


@dataclass
class ChatHistory:
    """The conversation so far, as chat messages.

    use_template: apply the tokenizer's chat template (else the history is
    flattened into a ``User: ... / Assistant:`` transcript, for tokenizers
    without one, e.g. ``target=tiny``).
    """

    use_template: bool
    messages: list[dict] = field(default_factory=list)

    def add(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})

    def clear(self) -> None:
        self.messages.clear()

    def drop_last(self) -> None:
        """Forget the last message (a user turn whose reply failed, so it can be retried)."""
        if self.messages:
            self.messages.pop()

    def prompt(self) -> str | list[dict]:
        """What to pass to ``Pipeline.stream``: messages, or one transcript string."""
        if self.use_template:
            return list(self.messages)
        lines = [f"{_speaker(m['role'])}: {m['content']}" for m in self.messages]
        return "\n".join([*lines, "Assistant:"])

    def stop_strings(self, defaults: tuple[str, ...]) -> tuple[str, ...]:
        """Stop strings for a reply: a transcript also stops where the next user turn starts."""
        return defaults if self.use_template else (*defaults, "\nUser:")


def _speaker(role: str) -> str:
    return {"user": "User", "assistant": "Assistant", "system": "System"}.get(role, role.title())


def uses_template(pipe) -> bool:
    """Whether replies use the chat template: the ``chat`` setting, or auto-detected."""
    chat = pipe.defaults.chat
    if chat in ("auto", None):
        return pipe.tokenizer.has_chat_template
    return str(chat).lower() in ("true", "1", "yes") if isinstance(chat, str) else bool(chat)


def reply_guarantee(pipe, speculative: bool) -> str:
    """The guarantee a reply runs under when speculation is on or off for it."""
    if pipe.speculative and not speculative:
        return "off: toggled off (^t)"
    return pipe.guarantee


@dataclass(frozen=True)
class ReplyUpdate:
    """A batch for the UI. ``finish_reason`` is set on the last one only.

    tokens: the engine's own (immutable) TokenEvents, in order.
    tail: text the engine released at the end (held back until then).
    error: a user-facing message when the reply failed; the tokens so far are kept.
    """

    tokens: tuple[TokenEvent, ...]
    snapshot: PanelSnapshot
    finish_reason: str | None = None
    tail: str = ""
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ReplyRequest:
    """One reply to generate: prompt, limits and whether to speculate."""

    prompt: str | list[dict]
    speculative: bool
    seed: int
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()


def open_stream(pipe, request: ReplyRequest, stats: Stats):
    """Start the stream; the engine fills ``stats`` as rounds commit."""
    return pipe.stream(request.prompt, max_new_tokens=request.max_new_tokens, seed=request.seed,
                       stop=list(request.stop), speculative=request.speculative, stats=stats)


def run_reply(pipe, request: ReplyRequest, cancel: threading.Event, emit: Callable[[ReplyUpdate], None],
              interval: float = UPDATE_INTERVAL) -> ReplyUpdate:
    """Stream one reply, calling ``emit`` with batches; return (and emit) the final update.

    Cancelling (``cancel`` set) closes the stream between events: the engine has
    committed or rolled back every round by then, and the partial reply stands
    with finish_reason "cancelled". Errors become ``ReplyUpdate.error``; none escape.
    """
    guarantee = reply_guarantee(pipe, request.speculative)
    speculative = request.speculative and pipe.speculative
    tally = Tally(guarantee, speculative)
    batch: list[TokenEvent] = []
    last = time.perf_counter()
    try:
        stream = open_stream(pipe, request, tally.live)
        for event in stream:
            if isinstance(event, FinishEvent):
                tally.finish(event.generation.stats)
                return _final(emit, batch, tally, event.finish_reason, tail=event.text)
            batch.append(event)
            if cancel.is_set():
                stream.close()
                return _final(emit, batch, tally, "cancelled")
            if time.perf_counter() - last >= interval:
                emit(ReplyUpdate(tuple(batch), tally.snapshot()))
                batch, last = [], time.perf_counter()
        return _final(emit, batch, tally, "cancelled")
    except SpecgenError as exc:
        return _final(emit, batch, tally, "error", error=str(exc))
    except Exception as exc:  # the UI must survive any engine failure
        return _final(emit, batch, tally, "error", error=f"{type(exc).__name__}: {first_line(exc, 'unexpected error')}")


def _final(emit, batch, tally: Tally, reason: str, *, tail: str = "", error: str | None = None) -> ReplyUpdate:
    update = ReplyUpdate(tuple(batch), tally.snapshot(reason), reason, tail, error)
    emit(update)
    return update


def load_pipeline(cfg):
    """Build the pipeline quietly for the app; raise SpecgenError with a clear message on any failure."""
    from specgen.build import build_pipeline

    try:
        return build_pipeline(cfg, progress=False)
    except SpecgenError:
        raise
    except Exception as exc:
        raise SpecgenError(f"could not load the models: {type(exc).__name__}: {first_line(exc, 'unexpected error')}") from exc
