"""The schedulers: the one thread that owns the pipeline and runs requests.

The pipeline is not thread-safe, so one thread runs every request, handing each
engine event to the job's ``deliver`` callback (called on that thread; the app
forwards it to its event loop). :func:`make_scheduler` picks one of two:

* :class:`BatchWorker` (whenever the pipeline batches: no drafter, ngram, a small
  model): jobs join a :class:`specgen.batch.BatchScheduler` as they arrive and
  advance together, up to ``batch_size`` at a time, each row with its own
  processor stack (per-request temperature / top_p), grammar, seed and RNG;
* :class:`SerialWorker` (what is not batched yet, :func:`specgen.batch.unbatched_reason`:
  eagle, medusa, mtp, dspark, compiled targets): jobs run **one at a time**.

Cancelling a job (a client that went away) is a flag read between steps: a
queued job is skipped; a running one stops at its last committed round (the
batched row is removed and its slot reused; the serial stream is closed) and
the others go on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from specgen.batch import BatchScheduler, Cancelled, StepError, unbatched_reason
from specgen.engine.pipeline import Pipeline
from specgen.errors import SpecgenError, first_line
from specgen.events import FinishEvent
from specgen.serve.protocol import APIError, GenRequest
from specgen.serve.request_stack import Variants, differs

log = logging.getLogger("specgen.serve")


@dataclass(frozen=True)
class Failure:
    """The request failed: ``error`` is what the client gets (before any event: as the HTTP status)."""

    error: APIError


@dataclass(frozen=True)
class Stopped:
    """The request was cancelled and its stream closed after ``new_tokens`` committed tokens."""

    new_tokens: int


@dataclass
class Job:
    """One request for the scheduler.

    deliver: called on the worker thread with each TokenEvent, then exactly one of
    FinishEvent, :class:`Failure` or :class:`Stopped`.
    """

    request: GenRequest
    deliver: Callable[[object], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler(Protocol):
    """What the app needs from a scheduler: start/close with the app, take jobs, say how many wait
    and how it runs them (``info``: shown by /v1/models)."""

    @property
    def pending(self) -> int: ...

    @property
    def info(self) -> dict: ...

    def start(self) -> None: ...

    def submit(self, job: Job) -> None: ...

    def close(self) -> None: ...


class SerialWorker:
    """Runs jobs one at a time on its own thread; the only code that touches ``pipe``."""

    def __init__(self, pipe: Pipeline, reason: str = "one request at a time"):
        self.pipe = pipe
        self.info = {"scheduler": "serial", "batch_size": 1, "note": reason}
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._variants = Variants(pipe)

    @property
    def pending(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return self._jobs.qsize()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="specgen-serve-worker", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Stop after the running job; jobs still queued are not run."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run(job)
            except Exception as exc:  # a bug must not take the worker (and every later request) down
                log.exception("request %s failed", job.request.id)
                job.deliver(Failure(APIError(500, f"internal error: {first_line(exc)}")))

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.deliver(Stopped(0))
            return
        req = job.request
        try:
            stream = self._variants.get(req.sampling).stream(req.prompt, req.options, prompt_ids=req.prompt_ids)
        except SpecgenError as exc:
            job.deliver(Failure(APIError(400, first_line(exc))))
            return
        new_tokens = 0
        try:
            for event in stream:
                if job.cancelled.is_set():
                    job.deliver(Stopped(new_tokens))
                    return
                job.deliver(event)
                if isinstance(event, FinishEvent):
                    return
                new_tokens += 1
        except SpecgenError as exc:
            job.deliver(Failure(APIError(500, f"generation failed: {first_line(exc)}")))
        finally:
            stream.close()


class BatchWorker:
    """Runs jobs together on a :class:`~specgen.batch.BatchScheduler` (its thread owns ``pipe``)."""

    def __init__(self, pipe: Pipeline, batch_size: int = 8):
        self.pipe = pipe
        self.info = {"scheduler": "batched", "batch_size": batch_size,
                     "note": f"up to {batch_size} requests advance together"}
        self.batch = BatchScheduler(pipe, batch_size, variants=Variants(pipe).get)

    @property
    def pending(self) -> int:
        """Jobs waiting for a row (not counting the rows running)."""
        return self.batch.pending

    @property
    def active(self) -> int:
        """Jobs running."""
        return self.batch.active

    def start(self) -> None:
        self.batch.start()

    def submit(self, job: Job) -> None:
        req = job.request
        variant = req.sampling if differs(self.pipe, req.sampling) else None
        self.batch.submit(req.prompt, prompt_ids=req.prompt_ids, variant=variant, cancelled=job.cancelled,
                          callback=lambda item: job.deliver(_served(item)), options=req.options)

    def close(self) -> None:
        """Stop after the running step; running and queued jobs get Stopped."""
        self.batch.close()


def _served(item: object) -> object:
    """A batch handle's item as the app's: events as they are, Cancelled -> Stopped, errors -> Failure."""
    if isinstance(item, Cancelled):
        return Stopped(item.new_tokens)
    if isinstance(item, StepError):  # logged with its traceback by the batch scheduler
        return Failure(APIError(500, first_line(item)))
    if isinstance(item, SpecgenError):
        return Failure(APIError(400, first_line(item)))
    return item


def make_scheduler(pipe: Pipeline, batch_size: int = 8) -> Scheduler:
    """A :class:`BatchWorker` when ``pipe`` batches, else a :class:`SerialWorker` saying why not."""
    why = unbatched_reason(pipe)
    if why is None:
        return BatchWorker(pipe, batch_size)
    return SerialWorker(pipe, f"one request at a time: {why}")
