"""The scheduler: the one thread that owns the pipeline and runs requests.

The pipeline is not thread-safe, so one worker thread takes :class:`Job`\\ s
from a queue and runs them **one at a time**, handing each engine event to the
job's ``deliver`` callback (called on the worker thread; the app forwards it to
its event loop). Anything with :class:`Scheduler`'s three methods can replace
:class:`SerialWorker`: a batched scheduler that advances many jobs together
keeps the same ``Job`` / ``deliver`` contract.

Cancelling a job (a client that went away) is a flag the worker reads between
events: a queued job is skipped, a running one has its stream closed, which
ends the request on a committed round (the engine rolls an interrupted round
back), and the worker moves on to the next job.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from specgen.engine import Pipeline
from specgen.errors import SpecgenError, first_line
from specgen.events import FinishEvent
from specgen.serve.protocol import APIError, GenRequest, Sampling
from specgen.serve.sampling import differs, with_sampling

log = logging.getLogger("specgen.serve")
#: Sampling variants of the pipeline kept (least recently used dropped): each holds a rebuilt stack.
MAX_VARIANTS = 16


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
    """What the app needs from a scheduler: start/close with the app, take jobs, say how many wait."""

    @property
    def pending(self) -> int: ...

    def start(self) -> None: ...

    def submit(self, job: Job) -> None: ...

    def close(self) -> None: ...


class SerialWorker:
    """Runs jobs one at a time on its own thread; the only code that touches ``pipe``."""

    def __init__(self, pipe: Pipeline):
        self.pipe = pipe
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._variants: dict[Sampling, Pipeline] = {}

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

    def _pipeline(self, sampling: Sampling) -> Pipeline:
        if not differs(self.pipe, sampling):
            return self.pipe
        variant = self._variants.pop(sampling, None) or with_sampling(self.pipe, sampling)
        self._variants[sampling] = variant  # most recently used last
        while len(self._variants) > MAX_VARIANTS:
            self._variants.pop(next(iter(self._variants)))
        return variant

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.deliver(Stopped(0))
            return
        req = job.request
        try:
            stream = self._pipeline(req.sampling).stream(req.prompt, prompt_ids=req.prompt_ids, **req.options)
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
