"""Logprobs on the wire: the request fields that ask for them and the OpenAI shapes that carry them.

Completions: ``logprobs`` (0..20 alternatives) and ``echo`` (the prompt, with its teacher-forced
logprobs, first null, in front of the completion) -> ``choices[i].logprobs = {tokens, token_logprobs,
top_logprobs, text_offset}``. Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs
``logprobs``) -> ``choices[i].logprobs.content[j] = {token, logprob, bytes, top_logprobs}``. A
token's string is the tokenizer's decoding of that token alone; ``text_offset`` counts characters
into the choice's ``text`` (with echo the prompt's tokens start at 0). The law of the numbers is
README "Logprobs": the generated tokens' come from the distribution each was drawn from, the
prompt's from the target's raw logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from specgen.errors import SpecgenError
from specgen.config.options import parse_int
from specgen.sampling.logprobs import MAX_TOP_LOGPROBS, TokenLogprob

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class LogprobRequest:
    """What a request asked: ``top`` alternatives per token (None: no logprobs) and ``echo``."""

    top: int | None = None
    echo: bool = False


def _count(body: Mapping, name: str, fail) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    try:
        return parse_int(value, name, minimum=0, maximum=MAX_TOP_LOGPROBS)
    except SpecgenError as exc:
        raise fail(str(exc), name) from None


def _flag(body: Mapping, name: str, fail) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise fail(f"{name} must be true or false, got {value!r}", name)
    return value


def parse_completion_logprobs(body: Mapping, fail) -> LogprobRequest:
    """``logprobs`` (0..20 or null) and ``echo`` of a completions body; ``fail(message, param)`` makes the 400."""
    echo = _flag(body, "echo", fail)
    if echo and body.get("stream"):
        raise fail("echo is not supported with stream=true by specgen-serve", "echo")
    return LogprobRequest(_count(body, "logprobs", fail), echo)


def parse_chat_logprobs(body: Mapping, fail) -> LogprobRequest:
    """``logprobs`` (bool) and ``top_logprobs`` (0..20, only with logprobs=true) of a chat body."""
    wanted = _flag(body, "logprobs", fail)
    top = _count(body, "top_logprobs", fail)
    if top is not None and not wanted:
        raise fail("top_logprobs needs logprobs=true", "top_logprobs")
    return LogprobRequest((top or 0) if wanted else None)


def completion_logprobs(decode: Decode, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int],
                        offset: int = 0) -> dict:
    """The completions ``logprobs`` object for ``token_ids`` (their ``entries``; None: a prompt's first
    token), offsets counted from ``offset``."""
    tokens = [decode([t]) for t in token_ids]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {decode([t]): v for t, v in e.top} for e in entries],
            "text_offset": offsets}


def merge(first: dict, second: dict) -> dict:
    """Two completions ``logprobs`` objects as one (the prompt's, then the completion's)."""
    return {key: first[key] + second[key] for key in first}


def _item(decode: Decode, token: int, logprob: float) -> dict:
    text = decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(decode: Decode, entries: Sequence[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``."""
    return {"content": [{**_item(decode, e.token_id, e.logprob),
                         "top_logprobs": [_item(decode, t, v) for t, v in e.top]} for e in entries]}
