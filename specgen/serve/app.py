"""The ASGI app (Starlette): OpenAI-compatible routes over a scheduler of engine events.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
server-sent events ending with ``data: [DONE]``, or one JSON response),
``GET /v1/models``, ``GET /metrics`` (Prometheus text), ``GET /health``.

A request is parsed and checked on the event loop (:mod:`specgen.serve.protocol`),
then handed to the scheduler as a :class:`~specgen.serve.worker.Job`; its events
come back through an asyncio queue. The response waits for the first item, so
an error the engine raises before generating (a schema that does not compile, a
prompt longer than the context) is still a 4xx. A body over ``max_request_bytes``
gets 413 (from its Content-Length, or as soon as the bytes read pass the limit),
and a client that goes away while sending its body costs one log line. A client that goes away, while
its request waits, runs or streams, cancels its job: a queued job is skipped, a
running one stops at its last commit and frees its row (:mod:`specgen.serve.worker`).
``GET /v1/models`` says how requests are scheduled (``specgen``: batched or serial).
Like the CLI and the chat UI the app only reads events: it never reaches into rounds.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from specgen.engine.chat import uses_template
from specgen.engine.pipeline import Pipeline
from specgen.errors import SpecgenError
from specgen.events import FinishEvent, TokenEvent
from specgen.config.options import check_prompt_size
from specgen.serve import protocol
from specgen.serve.metrics import CONTENT_TYPE, Metrics
from specgen.serve.protocol import APIError, GenRequest
from specgen.serve.worker import Failure, Job, Scheduler, Stopped, make_scheduler

#: Seconds between checks that a streaming client is still connected while it waits for tokens.
DISCONNECT_POLL_S = 0.2
#: The largest request body the server reads, in bytes (``max_request_bytes`` in conf/serve.yaml).
MAX_REQUEST_BYTES = 4 * 2**20

log = logging.getLogger("specgen.serve")


def served_model_name(pipe: Pipeline) -> str:
    """The ``model`` clients must ask for: the target's name in the config."""
    return str(pipe.config.target.get("name") or "specgen")


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Disconnected(Exception):
    pass


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes, over this server's limit of {limit:,} bytes "
                         "(max_request_bytes)", code="request_too_large")


async def _read_json(request: Request, limit: int) -> object:
    """The request body parsed as JSON (400 when it is not JSON, or nests too deeply for the parser).
    413 when it is over ``limit`` bytes, by its Content-Length before anything is read or else once
    the bytes read pass it; _Disconnected when the client goes away while sending it."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(f"{int(length):,}", limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"more than {limit:,}", limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise _Disconnected from None
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply to parse") from None


def _too_many_tokens(prompt: str | list[dict], longest: int | None, context_length: int, name: str) -> None:
    """APIError 400 when ``prompt`` has so many characters that, at ``longest`` characters a token at
    most, it cannot fit the context (the engine would refuse it only after tokenising it); only
    lengths are read. None: the tokenizer's longest token is not known, nothing is refused here."""
    if longest is None:
        return
    chars = len(prompt.strip()) if isinstance(prompt, str) else sum(len(m["content"].strip()) for m in prompt)
    fewest = -(-chars // longest)
    if fewest >= context_length:
        raise APIError(400, f"the {name} has {chars:,} characters, so at least {fewest:,} tokens (this tokenizer's "
                            f"tokens span at most {longest} character{'s' if longest != 1 else ''}); the model's context is {context_length:,} "
                            "tokens; shorten it", param=name)


class Server:
    """Routes, the scheduler that owns the pipeline, and the metrics."""

    def __init__(self, pipe: Pipeline, *, model: str | None = None, scheduler: Scheduler | None = None,
                 batch_size: int = 8, max_request_bytes: int = MAX_REQUEST_BYTES):
        self.model = model or served_model_name(pipe)
        self.max_request_bytes = max_request_bytes
        self.context_length = pipe.target.context_length
        self.longest_token_chars = pipe.tokenizer.longest_token_chars  # read once: a pass over the vocabulary
        self.scheduler = scheduler or make_scheduler(pipe, batch_size)
        self.metrics = Metrics(self.model, pipe.guarantee)
        self.use_template = uses_template(pipe)
        self.decode = pipe.tokenizer.decode

    def submit(self, req: GenRequest) -> tuple[Job, asyncio.Queue]:
        """Queue ``req``; its events arrive on the returned asyncio queue."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def deliver(item: object) -> None:  # on the worker thread
            if isinstance(item, Stopped):
                self.metrics.stopped(item.new_tokens)
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the loop has closed (server shutting down): nobody is listening
                pass

        job = Job(req, deliver)
        self.scheduler.submit(job)
        return job, items

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        endpoint = request.url.path
        try:
            req = await self._parse(request, kind)
        except APIError as exc:
            self.metrics.request(endpoint, "invalid")
            return _error(exc)
        except _Disconnected:
            log.warning("%s: the client went away while sending its request body", endpoint)
            self.metrics.request(endpoint, "cancelled")
            return Response(status_code=499)
        job, items = self.submit(req)
        done = False
        try:
            first = await self._next(request, items)
            if isinstance(first, Failure):
                done = True
                self.metrics.request(endpoint, "invalid" if first.error.status < 500 else "error")
                return _error(first.error)
            if req.stream:
                done = True  # the stream's own cleanup cancels from here on
                return StreamingResponse(self._events(request, req, job, items, first), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            item = first
            while not isinstance(item, (FinishEvent, Failure)):
                item = await self._next(request, items)
            done = True
            if isinstance(item, Failure):
                self.metrics.request(endpoint, "error")
                return _error(item.error)
            self.metrics.generation(item.generation)
            self.metrics.request(endpoint, "ok")
            return JSONResponse(protocol.response(req, self.model, item.generation, self.decode))
        except _Disconnected:
            return Response(status_code=499)  # nobody reads it: the client has gone
        finally:
            if not done:
                job.cancel()
                self.metrics.request(endpoint, "cancelled")

    async def _parse(self, request: Request, kind: str) -> GenRequest:
        """The checked request (APIError otherwise), its prompt refused by its size alone when it
        cannot fit the context (:func:`~specgen.config.options.check_prompt_size`, then by the tokenizer's
        longest token, :func:`_too_many_tokens`): such a prompt never reaches the scheduler, whose
        thread would tokenise it between batched steps."""
        body = await _read_json(request, self.max_request_bytes)
        if kind == "chat":
            req = protocol.parse_chat(body, self.model, use_template=self.use_template)
        else:
            req = protocol.parse_completion(body, self.model)
        if req.prompt is not None:
            try:
                check_prompt_size(req.prompt, self.context_length, "messages" if kind == "chat" else "prompt")
            except SpecgenError as exc:
                raise APIError(400, str(exc), param="messages" if kind == "chat" else "prompt") from None
            _too_many_tokens(req.prompt, self.longest_token_chars, self.context_length,
                             "messages" if kind == "chat" else "prompt")
        return req

    async def _next(self, request: Request, items: asyncio.Queue) -> object:
        while True:
            try:
                return await asyncio.wait_for(items.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise _Disconnected from None

    async def _events(self, request: Request, req: GenRequest, job: Job, items: asyncio.Queue,
                      item: object) -> AsyncIterator[str]:
        """The SSE body: text chunks, a last chunk with the finish reason and ``specgen``, [DONE]."""
        endpoint, outcome, offset = request.url.path, "cancelled", 0  # offset: the next token's text_offset
        try:
            if req.kind == "chat":
                yield _sse(protocol.chunk(req, self.model, None, first=True))
            while True:
                if isinstance(item, TokenEvent) and (item.text or item.logprob is not None):
                    yield _sse(protocol.chunk(req, self.model, item.text, event=item, decode=self.decode,
                                              offset=offset))
                    offset += len(self.decode([item.token_id])) if item.logprob is not None else 0
                elif isinstance(item, FinishEvent):
                    gen = item.generation
                    self.metrics.generation(gen)  # finished, whether or not the client reads the rest
                    if item.text:
                        yield _sse(protocol.chunk(req, self.model, item.text))
                    yield _sse(protocol.chunk(req, self.model, None, gen=gen))
                    if req.include_usage:
                        yield _sse(protocol.usage_chunk(req, self.model, gen))
                    yield _sse("[DONE]")
                    outcome = "ok"
                    return
                elif isinstance(item, Failure):
                    yield _sse(item.error.body())
                    yield _sse("[DONE]")
                    outcome = "error"
                    return
                item = await self._next(request, items)
        except _Disconnected:
            return
        finally:
            if outcome == "cancelled":
                job.cancel()
            self.metrics.request(endpoint, outcome)

    async def models(self, request: Request) -> Response:
        info = dict(getattr(self.scheduler, "info", {}))
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                         "owned_by": "specgen", "specgen": info}]})

    async def prometheus(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(getattr(self.scheduler, "pending", 0)), media_type=CONTENT_TYPE)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind))


async def _server_error(request: Request, exc: Exception) -> Response:
    return _error(APIError(500, "internal server error"))


def create_app(pipe: Pipeline, *, model: str | None = None, scheduler: Scheduler | None = None,
               batch_size: int = 8, max_request_bytes: int = MAX_REQUEST_BYTES) -> Starlette:
    """The ASGI app serving ``pipe``; the scheduler (by default :func:`make_scheduler` with
    ``batch_size``) starts and stops with it; a request body over ``max_request_bytes`` gets 413."""
    server = Server(pipe, model=model, scheduler=scheduler, batch_size=batch_size,
                    max_request_bytes=max_request_bytes)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        server.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.scheduler.close)

    routes = [Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
              Route("/v1/models", server.models, methods=["GET"]),
              Route("/metrics", server.prometheus, methods=["GET"]),
              Route("/health", server.health, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.server = server
    return app
