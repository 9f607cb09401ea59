"""Validation and normalisation of user-supplied options.

Every function here either returns a value of the documented type or raises a
:class:`~specgen.errors.SpecgenError` subclass whose message names the offending
argument; nothing is silently coerced (no truncation of floats, no truthiness of
strings).
"""

from __future__ import annotations

import difflib
import itertools
import operator
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Literal

from specgen.errors import ConfigError, PromptError, SpecgenError, shorten
from specgen.sampling.logprobs import MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from specgen.stats import Stats

#: The largest seed a torch.Generator accepts.
SEED_MAX = 2**64 - 1

_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def parse_bool(value: object, name: str) -> bool:
    """``value`` as a bool, or :class:`ConfigError` naming ``name``.

    Accepts ``True``/``False``, the integers ``1``/``0`` and the strings
    ``true/false/yes/no/on/off/1/0`` (case-insensitive, surrounding whitespace
    ignored). Anything else (``"maybe"``, ``2``, ``None``, ``0.5``) is rejected.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ConfigError(
        f"{name} must be a boolean (true/false, yes/no, on/off, 1/0), got {value!r}"
    )


def parse_chat(value: object, name: str = "chat") -> bool | Literal["auto"]:
    """``"auto"`` (apply the chat template when the tokenizer has one) or a bool via :func:`parse_bool`."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    try:
        return parse_bool(value, name)
    except ConfigError:
        raise ConfigError(f"{name} must be auto or a boolean (true/false, yes/no, on/off, 1/0), "
                          f"got {value!r}") from None


def parse_int(value: object, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int in [minimum, maximum], or :class:`ConfigError` naming ``name``.

    Integers (and integer-like objects such as numpy or 0-d torch integers) are
    accepted; bools, floats (``2.9`` or ``3.0``) and strings are rejected rather
    than converted.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{name} must be at most {maximum}, got {number}")
    return number


#: The most rows one batch runs at once (generate_batch, JSONL mode, specgen-serve).
MAX_BATCH_SIZE = 256


def parse_batch_size(value: object, name: str = "batch_size") -> int:
    """A batch size: an integer in [1, MAX_BATCH_SIZE]."""
    return parse_int(value, name, minimum=1, maximum=MAX_BATCH_SIZE)


def parse_seed(value: object, name: str = "seed") -> int:
    """A seed torch can use: an integer in [0, 2**64 - 1]."""
    return parse_int(value, name, minimum=0, maximum=SEED_MAX)


#: The smallest positive temperature. Logits are divided by it in float32: below about 1e-37 the largest one
#: becomes inf and the distribution NaN, long before that the draws are greedy but for exact ties.
MIN_TEMPERATURE = 1e-6


def check_temperature(value: float, name: str = "temperature") -> float:
    """``value`` (a number already checked to be finite and >= 0), or ConfigError naming ``name`` when it
    is positive but below :data:`MIN_TEMPERATURE`."""
    if 0 < value < MIN_TEMPERATURE:
        raise ConfigError(f"{name} must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {value!r} (a smaller one "
                          "only nears greedy, and near 1e-37 the logits divided by it overflow float32)")
    return value


#: The most stop strings a request may give, and the longest one: every committed token's text is
#: checked against each (:mod:`specgen.text`), so they bound that work per token.
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 1024


def parse_stop(value: object, name: str = "stop") -> tuple[str, ...]:
    """Stop strings: one string is one stop string; otherwise a sequence of non-empty strings,
    at most MAX_STOP_STRINGS of at most MAX_STOP_CHARS characters each."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    elif isinstance(value, bytes) or not isinstance(value, Iterable):
        raise ConfigError(f"{name} must be a string or a list of strings, got {shorten(repr(value))}")
    stops = tuple(itertools.islice(value, MAX_STOP_STRINGS + 1))
    if len(stops) > MAX_STOP_STRINGS:
        raise ConfigError(f"{name} takes at most {MAX_STOP_STRINGS} strings")
    for stop in stops:
        if not isinstance(stop, str):
            raise ConfigError(f"{name} must be a string or a list of strings, got an item {shorten(repr(stop))}")
        if not stop:
            raise ConfigError(f"{name} strings must not be empty")
        if len(stop) > MAX_STOP_CHARS:
            raise ConfigError(f"{name} strings take at most {MAX_STOP_CHARS} characters, got one of {len(stop)}")
    return stops


#: The most draft tokens a round may verify: a round's verify forward holds logits for each of them.
MAX_NUM_TOKENS = 64


def parse_num_tokens(value: object, name: str = "num_tokens") -> int | Literal["auto"]:
    """Draft tokens per round, the one parser and bound of them (a request's ``num_tokens``, the
    config's ``drafter.num_tokens``, every drafter's): ``"auto"`` (the planner chooses) or an integer
    (an int, an integral float, or an integer type such as numpy's) from 1 to MAX_NUM_TOKENS;
    ConfigError naming ``name`` otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    number = int(value) if isinstance(value, float) and value.is_integer() else value  # a YAML 4.0
    try:
        return parse_int(number, name, minimum=1, maximum=MAX_NUM_TOKENS)
    except ConfigError:
        raise ConfigError(f"{name} must be a positive integer up to {MAX_NUM_TOKENS} or auto, got {value!r}") from None


def parse_optional_text(value: object, name: str) -> str | None:
    """None or a string; anything else is a :class:`ConfigError` naming ``name``."""
    if value is None or isinstance(value, str):
        return value
    raise ConfigError(f"{name} must be a string, got {type(value).__name__} {value!r}")


def parse_stats(value: object, name: str = "stats") -> Stats | None:
    """None or a fresh :class:`Stats` for the engine to fill.

    A Stats that already holds numbers (reused from an earlier request) is
    rejected: the engine adds to it, so its counts would double.
    """
    from specgen.stats import Stats  # lazily: the CLI imports this module before torch is needed

    if value is None:
        return None
    if not isinstance(value, Stats):
        raise ConfigError(f"{name} must be a specgen.stats.Stats, got {type(value).__name__}")
    if value != Stats():
        raise ConfigError(f"{name} already holds numbers from another request; pass a fresh Stats() per request")
    return value


#: The chat roles a message may have (what the chat templates of the supported models render).
CHAT_ROLES = ("system", "user", "assistant")

#: UTF-8 bytes per token of context that a prompt may have: more than any token of a supported
#: vocabulary spans (SmolLM2's longest is 81 bytes), so a longer prompt cannot fit the context
#: and is refused by its size alone, before anything is tokenised.
PROMPT_BYTES_PER_TOKEN = 256
#: More tokens of context than any model specgen runs holds: a prompt file over its byte bound is
#: refused before a model loads (a model's own bound is checked once it has loaded).
MAX_CONTEXT_TOKENS = 1 << 20


def check_unicode(text: str | None, name: str, error: type[SpecgenError] = PromptError) -> str | None:
    """``text`` unchanged (None too), or ``error`` naming ``name`` when it holds a lone surrogate (U+D800 to
    U+DFFF): what an unpaired ``\\ud800`` JSON escape, or a command-line argument that is not UTF-8, decodes
    to. Such a string has no UTF-8 form, so no tokenizer could take it."""
    if text is None or text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{name} is not valid Unicode text: a lone surrogate U+{ord(text[exc.start]):04X} at "
                    f"character {exc.start} (from an unpaired \\ud800-style escape, or bytes that are not UTF-8)") from None
    return text


def check_prompt(prompt: object, name: str = "prompt") -> str | list[dict]:
    """A prompt string, or chat messages (a list of mappings with string ``role`` and ``content``).

    PromptError for an empty or whitespace-only string, text with a lone surrogate
    (:func:`check_unicode`), a role outside :data:`CHAT_ROLES`, and messages without a user message
    that holds text (nothing to answer), before any chat template could turn them into a non-empty prompt.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            what = "is empty" if not prompt else "holds only whitespace"
            raise PromptError(f"{name} {what}; give some text to generate from")
        return check_unicode(prompt, name)
    if isinstance(prompt, (bytes, bytearray)):
        raise PromptError(f"{name} must be text, got bytes; decode it first (e.g. {name}.decode('utf-8'))")
    if isinstance(prompt, Mapping) or not isinstance(prompt, Iterable):
        raise PromptError(f"{name} must be a string or a list of chat messages, got {type(prompt).__name__}")
    messages = list(prompt)
    if not messages:
        raise PromptError(f"{name} is an empty list of messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptError(f"{name}[{index}] must be a message dict with 'role' and 'content', "
                              f"got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise PromptError(f"{name}[{index}] needs a string {key!r}, got {message.get(key)!r}")
        if message["role"] not in CHAT_ROLES:
            raise PromptError(f"{name}[{index}] has the role {message['role']!r}; a role is one of "
                              f"{', '.join(CHAT_ROLES)}")
        check_unicode(message["content"], f"{name}[{index}].content")
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise PromptError(f"{name} has no user message with text; give the user's message to answer")
    return [dict(message) for message in messages]


def prompt_size_bound(context_length: int) -> int:
    """The most UTF-8 bytes a prompt for a ``context_length``-token context can have and still fit
    (:data:`PROMPT_BYTES_PER_TOKEN` per token)."""
    return PROMPT_BYTES_PER_TOKEN * context_length


def size_error(what: str, size: int, unit: str, context_length: int) -> PromptError:
    """The one-line refusal of ``what`` (``size`` ``unit``, e.g. bytes) as too big for the context."""
    return PromptError(f"{what} is {size:,} {unit}; a prompt for this model's {context_length:,}-token context "
                       f"has at most {prompt_size_bound(context_length):,} bytes ({PROMPT_BYTES_PER_TOKEN} a token), "
                       "so it cannot fit; shorten it")


def check_prompt_size(prompt: str | list[dict], context_length: int, name: str = "prompt") -> None:
    """PromptError when ``prompt`` (text, or chat messages checked by :func:`check_prompt`) has more
    characters than :func:`prompt_size_bound` allows bytes. A character is at least one UTF-8 byte, so
    a refused prompt cannot fit; only lengths are read (nothing is encoded or tokenised)."""
    size = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
    if size > prompt_size_bound(context_length):
        raise size_error(name, size, "characters", context_length)


def check_prompt_ids(prompt_ids: object, vocab_size: int, name: str = "prompt_ids") -> list[int]:
    """Token ids as a list of ints in [0, vocab_size); floats and strings are rejected, not converted,
    and so are unordered containers (sets, dicts)."""
    if isinstance(prompt_ids, (str, bytes, bytearray, Mapping, Set)) or not isinstance(prompt_ids, Iterable):
        raise PromptError(f"{name} must be a sequence of integer token ids, got {type(prompt_ids).__name__}")
    if callable(getattr(prompt_ids, "tolist", None)):  # a tensor or array: one transfer, not one per element
        prompt_ids = prompt_ids.tolist()
        if not isinstance(prompt_ids, list):
            raise PromptError(f"{name} must be a 1-D sequence of token ids, got a 0-d {type(prompt_ids).__name__}")
    ids = []
    for index, token in enumerate(prompt_ids):
        if isinstance(token, bool):
            raise PromptError(f"{name}[{index}] must be an integer token id, got {token!r}")
        try:
            ids.append(operator.index(token))
        except TypeError:
            raise PromptError(f"{name}[{index}] must be an integer token id, got {token!r}") from None
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise PromptError(f"{name} {bad[:5]} are outside the vocabulary (size {vocab_size})")
    return ids


@dataclass(frozen=True)
class RequestOptions:
    """One request's settings: what ``Pipeline.stream(prompt, options)`` runs with.

    A field left None takes the pipeline's default when the request is planned
    (:func:`request_options` validates every field and fills them in; the options a
    :class:`~specgen.engine.request.RequestPlan` holds are resolved so). Resolved:
    max_new_tokens >= 1; seed in [0, 2**64); stop: the stop strings; speculative:
    False forces plain decoding, True uses the pipeline's setting; chat: True, False
    or "auto"; system: a system message or None; schema / regex: an output
    constraint (at most one); num_tokens: draft tokens per round, None for the
    drafter's own setting; stats: a fresh Stats to fill, or None. logprobs: None (off) or
    k in [0, 20]: each generated token's logprob and its k most likely alternatives;
    logprobs_of: "processed" (the distribution the token was drawn from) or "raw" (the
    target's unprocessed logits); echo: also score the prompt (Generation.prompt_logprobs;
    with echo, max_new_tokens may be 0: score only). See README "Logprobs".
    """

    max_new_tokens: int | None = None
    seed: int | None = None
    stop: str | tuple[str, ...] | None = None
    speculative: bool | None = None
    chat: bool | Literal["auto"] | None = None
    system: str | None = None
    schema: object = None
    regex: str | None = None
    num_tokens: int | Literal["auto"] | None = None
    stats: Stats | None = field(default=None, compare=False)
    logprobs: int | None = None
    logprobs_of: Literal["processed", "raw"] | None = None
    echo: bool | None = None


#: The fields of :class:`RequestOptions`: the override names of ``Pipeline.stream`` besides prompt and prompt_ids.
OPTION_NAMES = tuple(f.name for f in fields(RequestOptions))


def check_option_names(names: Iterable[str], where: str, extra: Iterable[str] = ()) -> None:
    """ConfigError naming the first of ``names`` that is not an option (with the closest one, if any)."""
    known = (*OPTION_NAMES, *extra)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(known)}"
            raise ConfigError(f"{where} got an unknown argument {name!r}{hint}")


def with_overrides(options: RequestOptions | None, overrides: Mapping[str, object],
                   where: str) -> RequestOptions:
    """``options`` (None: all defaults) with each non-None override (a RequestOptions field name) set.

    ConfigError naming an unknown override (see :func:`check_option_names`); ``options``
    of another type is a ConfigError too. Nothing is validated here (see :func:`request_options`)."""
    if options is not None and not isinstance(options, RequestOptions):
        raise ConfigError(f"{where} options must be a specgen.RequestOptions, got {type(options).__name__}")
    check_option_names(overrides, where)
    given = {name: value for name, value in overrides.items() if value is not None}
    base = RequestOptions() if options is None else options
    return replace(base, **given) if given else base


def set_fields(options: RequestOptions) -> dict[str, object]:
    """The fields of ``options`` that are set (not None), by name: what it overrides when laid over others."""
    return {f.name: getattr(options, f.name) for f in fields(options) if getattr(options, f.name) is not None}


def request_options(defaults, options: RequestOptions | None = None, **overrides) -> RequestOptions:
    """``options`` with ``overrides`` (:func:`with_overrides`), validated and resolved: a field that
    is None takes the value from ``defaults`` (a pipeline's :class:`~specgen.config.run.RequestDefaults`).

    Raises a :class:`~specgen.errors.SpecgenError` subclass naming the first bad
    argument; never converts a wrong type silently.
    """
    o = with_overrides(options, overrides, "request_options()")
    if o.schema is not None and o.regex is not None:
        raise ConfigError("give schema= or regex=, not both")
    echo = False if o.echo is None else parse_bool(o.echo, "echo")
    return RequestOptions(
        max_new_tokens=parse_int(defaults.max_new_tokens if o.max_new_tokens is None else o.max_new_tokens,
                                 "max_new_tokens", minimum=0 if echo else 1),
        seed=parse_seed(defaults.seed if o.seed is None else o.seed),
        stop=parse_stop(defaults.stop if o.stop is None else o.stop),
        speculative=True if o.speculative is None else parse_bool(o.speculative, "speculative"),
        chat=parse_chat(defaults.chat if o.chat is None else o.chat),
        system=check_unicode(parse_optional_text(defaults.system if o.system is None else o.system, "system"),
                             "system", ConfigError),
        schema=o.schema,
        regex=check_unicode(parse_optional_text(o.regex, "regex"), "regex", ConfigError),
        num_tokens=None if o.num_tokens is None else parse_num_tokens(o.num_tokens),
        stats=parse_stats(o.stats),
        logprobs=_parse_logprobs(defaults.logprobs if o.logprobs is None else o.logprobs),
        logprobs_of=parse_logprobs_of(o.logprobs_of),
        echo=echo,
    )


def _parse_logprobs(value: object) -> int | None:
    return None if value is None else parse_int(value, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)


#: What ``logprobs_of`` may name: the processed distribution a token was drawn from, or the raw logits.
LOGPROB_LAWS = ("processed", "raw")


def parse_logprobs_of(value: object, name: str = "logprobs_of") -> str:
    """``value`` (None: "processed") as one of :data:`LOGPROB_LAWS`, or ConfigError naming ``name``."""
    if value is None:
        return "processed"
    if value not in LOGPROB_LAWS:
        raise ConfigError(f"{name} must be one of {', '.join(LOGPROB_LAWS)}, got {shorten(repr(value))}")
    return value
