"""The online batch: :class:`BatchScheduler` admits and cancels requests while it runs (see :mod:`specgen.batch`)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from specgen.batch.steps import Batch, prepare, unbatched_reason
from specgen.errors import ConfigError, SpecgenError, first_line
from specgen.events import FinishEvent, Generation, TokenEvent
from specgen.config.options import RequestOptions, parse_batch_size, with_overrides

log = logging.getLogger("specgen.batch")

class StepError(SpecgenError):
    """A batched step failed (rolled back); the rows it ran were removed. ``__cause__``: the error."""


@dataclass(frozen=True)
class Cancelled:
    """A handle's last item when it was cancelled (or its scheduler closed) before finishing:
    ``new_tokens`` TokenEvents had been delivered."""

    new_tokens: int


class Handle:
    """One request submitted to a :class:`BatchScheduler`.

    Its items, in order: TokenEvents, then exactly one of FinishEvent, :class:`Cancelled`
    or a SpecgenError (the request was refused when admitted, before any event; a
    :class:`StepError` when a step it ran in failed). With a ``callback`` each item is
    passed to it on the scheduler's thread (it must not block for long or raise); without
    one, iterate the handle (on any thread): it yields the events and Cancelled, and
    raises the error.
    """

    def __init__(self, prompt: object, prompt_ids: object, options: RequestOptions, variant: Hashable | None,
                 callback: Callable[[object], None] | None, cancelled: threading.Event | None = None):
        self.prompt, self.prompt_ids, self.options, self.variant = prompt, prompt_ids, options, variant
        self.cancelled = cancelled or threading.Event()
        self.delivered = 0  # TokenEvents delivered so far
        self._items: queue.SimpleQueue | None = None if callback else queue.SimpleQueue()
        self._callback = callback

    def deliver(self, item: object) -> None:
        if isinstance(item, TokenEvent):
            self.delivered += 1
        if self._callback is not None:
            self._callback(item)
        else:
            self._items.put(item)

    def __iter__(self) -> Iterator[TokenEvent | FinishEvent | Cancelled]:
        if self._items is None:
            raise ConfigError("a handle with a callback receives its events there; it cannot be iterated")
        while True:
            item = self._items.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, (FinishEvent, Cancelled)):
                return


class BatchScheduler:
    """An online batch: requests join while it runs and leave when they finish or are cancelled.

    One thread (started by :meth:`start`, or by the first :meth:`submit`) owns the pipeline:
    it admits queued requests, in submission order, whenever a slot is free (at most
    ``batch_size`` rows), checks each on admission (:func:`prepare`), and runs
    :meth:`Batch.step` while any row is active. :meth:`cancel` is honoured between steps:
    the row, at its last commit, is removed and its slot reused; other rows are untouched.
    A step that raises fails every row it ran (each handle gets a :class:`StepError`);
    the scheduler goes on with the next requests.

    variants: maps a request's ``variant`` key to a pipeline sharing ``pipe``'s models
    (its processor stack and guarantee then plan the row); called on the scheduler thread.
    chunked_prefill: a long prompt is prefilled a chunk per step while the other rows go on
    decoding, where the backend chunks prompts (:func:`specgen.batch.steps.prefill_chunks`);
    False: whole, in its row's first step (every other row waits for it).
    """

    def __init__(self, pipe, batch_size: int = 8, *, variants: Callable[[Hashable], object] | None = None,
                 chunked_prefill: bool = True):
        why = unbatched_reason(pipe)
        if why:
            raise ConfigError(f"the batch scheduler cannot run this pipeline: {why}")
        self.pipe, self.variants = pipe, variants
        self.batch = Batch(pipe, parse_batch_size(batch_size), chunked_prefill=chunked_prefill)
        self._waiting: queue.SimpleQueue[Handle | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    @property
    def pending(self) -> int:
        """Requests waiting for a slot."""
        return self._waiting.qsize()

    @property
    def active(self) -> int:
        """Rows running."""
        return self.batch.active

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called."""
        return self._closing.is_set()

    def start(self) -> None:
        with self._lock:
            if self.closed:
                raise ConfigError("this BatchScheduler is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="specgen-batch", daemon=True)
                self._thread.start()

    def submit(self, prompt=None, *, prompt_ids=None, variant: Hashable | None = None,
               callback: Callable[[object], None] | None = None, cancelled: threading.Event | None = None,
               options: RequestOptions | None = None, **overrides) -> Handle:
        """Queue one request (options and overrides as :meth:`specgen.engine.pipeline.Pipeline.stream` takes
        them); -> its handle. An unknown override raises ConfigError here; the values are checked
        when admitted: a bad one's handle gets the SpecgenError. cancelled: an Event that cancels
        the request when set (default: a new one; :meth:`cancel` sets it)."""
        if variant is not None and self.variants is None:
            raise ConfigError("this BatchScheduler has no variants; submit without variant=")
        options = with_overrides(options, overrides, "a request")
        handle = Handle(prompt, prompt_ids, options, variant, callback, cancelled)
        self.start()
        self._waiting.put(handle)
        return handle

    def cancel(self, handle: Handle) -> None:
        """Stop ``handle`` at its last commit (between steps); it then gets Cancelled."""
        handle.cancelled.set()

    def close(self) -> None:
        """Stop after the running step; active and queued requests get Cancelled."""
        with self._lock:
            self._closing.set()
            thread = self._thread
        if thread is not None:
            self._waiting.put(None)
            thread.join()

    def generate(self, prompt=None, options: RequestOptions | None = None, **overrides) -> Generation:
        """Submit and wait (any thread); -> the Generation. Raises the request's SpecgenError."""
        for item in self.submit(prompt, options=options, **overrides):
            if isinstance(item, FinishEvent):
                return item.generation
        raise SpecgenError("the request was cancelled")

    def _loop(self) -> None:
        while not self.closed:
            for row in self.batch.rows():
                if row.owner.cancelled.is_set():
                    self.batch.remove(row)
                    row.owner.deliver(Cancelled(row.owner.delivered))
            while not self.closed and not self.batch.full:
                try:
                    handle = self._waiting.get(block=not self.batch.active)
                except queue.Empty:
                    break
                if handle is not None:
                    self._admit(handle)
            if not self.closed and self.batch.active:
                self._step()
        for row in self.batch.rows():
            self.batch.remove(row)
            row.owner.deliver(Cancelled(row.owner.delivered))
        while True:
            try:
                handle = self._waiting.get_nowait()
            except queue.Empty:
                return
            if handle is not None:
                handle.deliver(Cancelled(0))

    def _admit(self, handle: Handle) -> None:
        if handle.cancelled.is_set():
            handle.deliver(Cancelled(0))
            return
        try:
            pipe = self.pipe if handle.variant is None else self.variants(handle.variant)
            spec = prepare(pipe, handle.prompt, handle.options, None, prompt_ids=handle.prompt_ids, caller="a request")
            self.batch.add(spec, handle)
        except SpecgenError as exc:
            handle.deliver(exc)
        except Exception as exc:  # a bug must not take the scheduler (and every later request) down
            log.exception("admitting a request failed")
            failure = StepError(f"internal error: {first_line(exc)}")
            failure.__cause__ = exc
            handle.deliver(failure)

    def _step(self) -> None:
        rows = self.batch.rows()
        try:
            for row, event in self.batch.step():
                if not row.owner.cancelled.is_set():
                    row.owner.deliver(event)
                elif isinstance(event, FinishEvent):  # finished in the step its cancel arrived in
                    row.owner.deliver(Cancelled(row.owner.delivered))
        except Exception as exc:  # the step rolled back: fail its rows, keep serving the others
            log.exception("a batched step failed")
            failure = StepError(f"generation failed: {first_line(exc)}")
            failure.__cause__ = exc
            for row in rows:
                if row in self.batch.slots:
                    self.batch.remove(row)
                    row.owner.deliver(failure)
