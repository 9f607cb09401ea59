"""The OpenAI wire format: request bodies in, response bodies and SSE chunks out.

Parsing maps a request's OpenAI fields, and only those, onto specgen's
per-request options (:mod:`specgen.config.options`): a request can never carry a config
override. Every field is checked here, before the request is queued, and a bad
one raises :class:`APIError` naming it (an OpenAI-style 4xx body); a field this
server does not implement is refused, never silently ignored.
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from specgen.errors import SpecgenError
from specgen.events import Generation, TokenEvent
from specgen.config.options import RequestOptions, check_prompt, check_temperature, parse_int, parse_seed, parse_stop
from specgen.serve.logprobs import (Decode, LogprobRequest, chat_logprobs, completion_logprobs, merge,
                                    parse_chat_logprobs, parse_completion_logprobs)

#: Bits of a seed the server draws for a request without one: below 2**53, so a JSON client that reads
#: the reported seed as a double (JavaScript, many JSON libraries) can send it back unchanged to replay.
DRAWN_SEED_BITS = 53
#: Fields accepted but with no effect on the output (OpenAI bookkeeping).
_NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier"})
#: Fields accepted when they hold their neutral value (the value the OpenAI API documents as "off").
_NEUTRAL = {"n": 1, "best_of": 1, "suffix": None,
            "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None,
            "tool_choice": None, "parallel_tool_calls": None}
_COMMON = {"model", "stream", "stream_options", "max_tokens", "seed", "stop", "temperature", "top_p",
           "response_format"}
_FIELDS = {"completion": _COMMON | {"prompt", "logprobs", "echo"},
           "chat": _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}}
#: specgen finish reasons as OpenAI's: a stop string, EOS or a grammar dead end -> "stop"; a token or context
#: limit -> "length" (the response's ``specgen.finish_reason`` keeps specgen's own).
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "dead_end": "stop"}


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API sends it."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Sampling:
    """A request's sampling parameters; None = the server's configured value."""

    temperature: float | None = None
    top_p: float | None = None


@dataclass
class GenRequest:
    """One parsed request: what to generate and how to answer.

    kind: "completion" or "chat". prompt: text or chat messages (None when
    prompt_ids is given). options: the request's ``Pipeline.stream`` options
    (max_new_tokens, seed, stop, chat, schema; None where the pipeline's default applies). seed: the seed used (drawn at
    random when the request gave none, and reported back).
    """

    kind: str
    prompt: str | list[dict] | None
    prompt_ids: list[int] | None
    options: RequestOptions
    sampling: Sampling
    seed: int
    stream: bool = False
    include_usage: bool = False
    logprobs: LogprobRequest = LogprobRequest()
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def _fail(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def check_fields(body: object, kind: str) -> Mapping:
    """The body as a mapping whose fields are all ones this server implements (400 otherwise)."""
    if not isinstance(body, Mapping):
        raise _fail(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name in _FIELDS[kind] or name in _NO_EFFECT:
            continue
        if name in _NEUTRAL:
            neutral = _NEUTRAL[name]
            if value is None or value == neutral or (neutral is None and not value):
                continue
            raise _fail(f"{name}={value!r} is not supported by specgen-serve (only {neutral!r})", name)
        raise _fail(f"unknown or unsupported field {name!r}", name)
    return body


def check_model(body: Mapping, model: str) -> None:
    """400 without a model; 404 (code model_not_found) for a name other than the served model."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise _fail("model is required: the name of the served model", "model")
    if name != model:
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{model}'",
                       param="model", code="model_not_found")


def _number(body: Mapping, name: str, low: float, high: float | None, *, low_allowed: bool) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(f"{name} must be a number, got {value!r}", name)
    if value < low or (value == low and not low_allowed) or (high is not None and value > high):
        wording = f"{'>=' if low_allowed else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
        raise _fail(f"{name} must be {wording}, got {value!r}", name)
    return float(value)


def _schema(body: Mapping) -> dict | None:
    """response_format: text -> None, json_object -> any object, json_schema -> its ``schema`` (a JSON object;
    a string is refused, since specgen would read it as a file path)."""
    spec = body.get("response_format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise _fail("response_format.type must be text, json_object or json_schema", "response_format")
    inner = spec.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, Mapping) else None
    if not isinstance(schema, Mapping):
        raise _fail("response_format.json_schema.schema must be a JSON Schema object", "response_format")
    return dict(schema)


def _guarded(parse, *args, param: str):
    try:
        return parse(*args)
    except SpecgenError as exc:
        raise _fail(str(exc), param) from None


def _common(body: Mapping, kind: str, max_tokens_name: str, logprobs: LogprobRequest) -> dict:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _fail(f"stream must be true or false, got {stream!r}", "stream")
    usage = body.get("stream_options") or {}
    if not isinstance(usage, Mapping) or not isinstance(usage.get("include_usage", False), bool):
        raise _fail("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    seed = body.get("seed")
    seed = secrets.randbits(DRAWN_SEED_BITS) if seed is None else _guarded(parse_seed, seed, "seed", param="seed")
    max_tokens = body.get(max_tokens_name)
    options = RequestOptions(seed=seed, stop=_guarded(parse_stop, body.get("stop"), "stop", param="stop"),
                             schema=_schema(body), logprobs=logprobs.top, echo=logprobs.echo or None,
                             max_new_tokens=None if max_tokens is None
                             else _max_tokens(max_tokens, max_tokens_name, 0 if logprobs.echo else 1))
    temperature = _number(body, "temperature", 0.0, None, low_allowed=True)
    if temperature is not None:
        _guarded(check_temperature, temperature, param="temperature")
    sampling = Sampling(temperature, _number(body, "top_p", 0.0, 1.0, low_allowed=False))
    return {"kind": kind, "options": options, "sampling": sampling, "seed": seed, "stream": stream,
            "include_usage": stream and bool(usage.get("include_usage", False)), "logprobs": logprobs}


def _max_tokens(value: object, name: str, minimum: int) -> int:
    try:
        return parse_int(value, name, minimum=minimum)
    except SpecgenError as exc:
        raise _fail(str(exc), name) from None


def parse_completion(body: object, model: str) -> GenRequest:
    """A ``/v1/completions`` body: ``prompt`` is text or token ids, or a one-item list of either (a batch of
    one), continued as raw text (no chat template)."""
    body = check_fields(body, "completion")
    check_model(body, model)
    prompt, prompt_ids = body.get("prompt"), None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt (text or token ids), as lm-eval's local-completions sends
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt, prompt_ids = None, prompt
    elif not isinstance(prompt, str):
        raise _fail("prompt must be a string or a list of token ids, or a list of one of them "
                    "(one prompt per request)", "prompt")
    else:
        _guarded(check_prompt, prompt, "prompt", param="prompt")
    common = _common(body, "completion", "max_tokens", parse_completion_logprobs(body, _fail))
    common["options"] = replace(common["options"], chat=False)
    return GenRequest(prompt=prompt, prompt_ids=prompt_ids, **common)


def _message_text(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _fail(f"messages[{index}].content must be a string or a list of text parts", "messages")


def _message(message: Mapping, index: int) -> dict:
    """One message as the pipeline takes it: role, content and, when given, ``name`` (a participant's
    name: handed to the chat template, which renders it where it reads ``message.name``, as vLLM does;
    a transcript writes it after the role). 400 for a name that is not a non-empty string."""
    out = {"role": message.get("role"), "content": _message_text(message.get("content"), index)}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str) or not name.strip() or "\n" in name:
            raise _fail(f"messages[{index}].name must be a non-empty one-line string, got {name!r}", "messages")
        out["name"] = name
    return out


def parse_chat(body: object, model: str, *, use_template: bool) -> GenRequest:
    """A ``/v1/chat/completions`` body. use_template: render ``messages`` with the tokenizer's chat
    template; else as a ``User: ... / Assistant:`` transcript that also stops at the next ``\\nUser:``
    (tokenizers without a template, as the chat UI does)."""
    from specgen.engine.chat import ChatHistory

    body = check_fields(body, "chat")
    check_model(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages must be a non-empty list of {role, content} objects", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise _fail(f"messages[{index}] must be an object with role and content", "messages")
    messages = [_message(m, i) for i, m in enumerate(messages)]
    try:
        messages = check_prompt(messages, "messages")
    except SpecgenError as exc:
        raise _fail(str(exc), "messages") from None
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    common = _common(body, "chat", name, parse_chat_logprobs(body, _fail))
    history = ChatHistory(use_template, messages)
    options = common["options"]
    common["options"] = replace(options, stop=history.stop_strings(options.stop), chat=use_template)
    return GenRequest(prompt=history.prompt(), prompt_ids=None, **common)


def finish_reason(reason: str) -> str:
    """specgen's finish reason as OpenAI's ("stop" or "length")."""
    return _FINISH.get(reason, "stop")


def specgen_field(gen: Generation, seed: int) -> dict:
    """The run's guarantee and acceptance numbers, sent as the response's ``specgen`` field."""
    stats = gen.stats
    return {"guarantee": str(gen.guarantee), "accepted": stats.accepted, "drafted": stats.drafted,
            "acceptance": stats.acceptance_rate, "tokens_per_target_call": stats.tokens_per_target_call,
            "finish_reason": gen.finish_reason, "seed": seed}


def usage(gen: Generation) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache gave."""
    prompt, completion = len(gen.prompt_ids), len(gen.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": gen.stats.prefill_reused}}


def _envelope(req: GenRequest, model: str, chunk: bool) -> dict:
    if req.kind == "chat":
        return {"id": f"chatcmpl-{req.id}", "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": req.created, "model": model}
    return {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created, "model": model}


def response(req: GenRequest, model: str, gen: Generation, decode: Decode) -> dict:
    """The whole (non-streaming) response for a finished generation (``decode``: the tokenizer's,
    for echo and the logprobs' token strings)."""
    choice = {"index": 0, "finish_reason": finish_reason(gen.finish_reason), "logprobs": None}
    if req.kind == "chat":
        choice["message"] = {"role": "assistant", "content": gen.text}
        if req.logprobs.top is not None:
            choice["logprobs"] = chat_logprobs(decode, gen.logprobs)
    else:
        prompt = (req.prompt if req.prompt is not None else decode(gen.prompt_ids)) if req.logprobs.echo else ""
        choice["text"] = prompt + gen.text
        if req.logprobs.top is not None:
            choice["logprobs"] = completion_logprobs(decode, gen.logprobs, gen.token_ids, len(prompt))
            if req.logprobs.echo:
                echoed = completion_logprobs(decode, gen.prompt_logprobs, gen.prompt_ids)
                choice["logprobs"] = merge(echoed, choice["logprobs"])
    return {**_envelope(req, model, False), "choices": [choice], "usage": usage(gen),
            "specgen": specgen_field(gen, req.seed)}


def chunk(req: GenRequest, model: str, text: str | None, *, first: bool = False,
          gen: Generation | None = None, event: TokenEvent | None = None, decode: Decode | None = None,
          offset: int = 0) -> dict:
    """One streaming chunk: ``text`` (chat: the first chunk also carries the role), with ``event``'s
    logprob when it has one (``decode``: the tokenizer's; ``offset``: its token's text_offset); the
    last one (``gen`` given) carries the finish reason and the ``specgen`` field."""
    choice = {"index": 0, "finish_reason": None if gen is None else finish_reason(gen.finish_reason),
              "logprobs": None}
    if event is not None and event.logprob is not None and req.logprobs.top is not None:
        choice["logprobs"] = (chat_logprobs(decode, [event.logprob]) if req.kind == "chat"
                              else completion_logprobs(decode, [event.logprob], [event.token_id], offset))
    if req.kind == "chat":
        delta = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    out = {**_envelope(req, model, True), "choices": [choice]}
    if gen is not None:
        out["specgen"] = specgen_field(gen, req.seed)
    return out


def usage_chunk(req: GenRequest, model: str, gen: Generation) -> dict:
    """The extra last chunk ``stream_options.include_usage`` asks for (no choices, the usage)."""
    return {**_envelope(req, model, True), "choices": [], "usage": usage(gen)}
