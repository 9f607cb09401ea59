"""Grammar specs: validate the ``grammar`` config into a :class:`GrammarSpec`.

A spec is the ``grammar`` config group (or what ``generate(schema=..., regex=...)``
builds)::

    {"kind": "none"}
    {"kind": "regex", "pattern": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}   (or "pattern_file": path)
    {"kind": "json_schema", "schema": <dict | JSON text | file path | pydantic model class>,
     "whitespace": "[ ]?"}

A schema's numbers and sizes are checked here, whichever backend runs
(:mod:`specgen.grammar.schema_limits`). Both kinds may set ``backend`` (``auto`` by default, see :mod:`specgen.grammar.backend`)
and ``compile_timeout_s`` (the compile budget). Nothing here compiles: which
schema keywords can be enforced depends on the backend, which checks them.
Regexes use ASCII classes: ``\\d`` is ``[0-9]``, ``\\w`` is ``[0-9A-Za-z_]`` and
``\\s`` is ``[ \\t\\n\\r\\f\\v]`` (:func:`ascii_classes`), whichever backend runs.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from specgen.errors import ConfigError, first_line, not_utf8, shorten
from specgen.grammar.schema_limits import check_limits

#: Whitespace allowed between JSON tokens: at most one space keeps small models on track
#: ("" gives compact JSON, whose longer forced runs suit speculation).
DEFAULT_WHITESPACE = r"[ ]?"
#: Seconds a backend may spend compiling one grammar before it is refused.
DEFAULT_COMPILE_TIMEOUT_S = 60.0

_MISSING = (None, "", "???")
_COMMON_KEYS = {"kind", "backend", "compile_timeout_s"}
_SPEC_KEYS = {"json_schema": _COMMON_KEYS | {"schema", "whitespace"},
              "regex": _COMMON_KEYS | {"pattern", "pattern_file"}, "none": {"kind"}}
_ASCII = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v",
          "D": "\\x00-\\x2F\\x3A-\\x{10FFFF}", "W": "\\x00-\\x2F\\x3A-\\x40\\x5B-\\x5E\\x60\\x7B-\\x{10FFFF}",
          "S": "\\x00-\\x08\\x0E-\\x1F\\x21-\\x{10FFFF}"}


@dataclass(frozen=True)
class GrammarSpec:
    """kind: "json_schema" | "regex"; source: the regex (ASCII classes applied) or the schema
    as JSON text; whitespace: the JSON whitespace regex; description: a short name for
    messages; backend: a registered backend name or "auto"; compile_timeout_s: the budget."""

    kind: str
    source: str
    description: str
    backend: str = "auto"
    whitespace: str = DEFAULT_WHITESPACE
    compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S

    @property
    def schema(self) -> dict:
        """The JSON schema (json_schema specs only)."""
        return json.loads(self.source)


def parse_spec(spec: Mapping | None) -> GrammarSpec | None:
    """Validate a grammar spec; None for ``kind: none``. Raises ConfigError with one clear line."""
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise ConfigError(f"grammar must be a mapping with a 'kind', got {type(spec).__name__}")
    kind = spec.get("kind", "none")
    if kind not in _SPEC_KEYS:
        raise ConfigError(f"grammar.kind must be one of json_schema, regex, none; got {kind!r}")
    unknown = sorted(set(spec) - _SPEC_KEYS[kind])
    if unknown:
        raise ConfigError(f"unknown grammar keys for kind={kind}: {', '.join(unknown)}")
    if kind == "none":
        return None
    backend = str(spec.get("backend") or "auto")
    timeout = _timeout(spec.get("compile_timeout_s"))
    if kind == "regex":
        pattern = _pattern(spec.get("pattern"), spec.get("pattern_file"))
        return GrammarSpec("regex", check_regex(pattern), f"regex {shorten(pattern)}", backend,
                           compile_timeout_s=timeout)
    schema, source = load_schema(spec.get("schema"))
    check_limits(schema)
    whitespace = spec.get("whitespace")
    whitespace = DEFAULT_WHITESPACE if whitespace is None else str(whitespace)
    _check_whitespace(whitespace)
    return GrammarSpec("json_schema", json.dumps(schema), f"json_schema {source}", backend, whitespace, timeout)


def _timeout(value) -> float:
    if value in _MISSING:
        return DEFAULT_COMPILE_TIMEOUT_S
    try:
        timeout = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"grammar.compile_timeout_s must be a number of seconds, got {value!r}") from None
    if not timeout > 0:
        raise ConfigError(f"grammar.compile_timeout_s must be positive, got {value!r}")
    return timeout


def _check_whitespace(whitespace: str) -> None:
    try:
        re.compile(whitespace)
    except re.error as exc:
        raise ConfigError(f"grammar.whitespace {whitespace!r} is not a valid regex: {exc}") from None
    if re.fullmatch(whitespace, "x") or re.fullmatch(whitespace, '"'):
        raise ConfigError(f"grammar.whitespace {whitespace!r} must match only whitespace")


def check_regex(pattern: str) -> str:
    """``pattern`` with ASCII classes, after a syntax check that names the problem."""
    if re.search(r"\(\?<?[=!]", pattern):
        raise ConfigError(f"lookaround ((?=, (?!, (?<=, (?<!) is not supported in grammar regexes: {shorten(pattern)!r}")
    if re.search(r"(?<!\\)(?:\\\\)*\\[1-9]|\(\?P=", pattern):
        raise ConfigError(f"backreferences are not supported in grammar regexes: {shorten(pattern)!r}")
    try:
        re.compile(pattern)
    except re.error as exc:
        if "bad escape" not in str(exc):  # \p{L}, \x{41}: valid for the backends' Rust syntax
            raise ConfigError(f"invalid regex ({exc}): {shorten(pattern)!r}") from None
    return ascii_classes(pattern)


def ascii_classes(pattern: str) -> str:
    r"""``pattern`` with ``\d \w \s`` (and ``\D \W \S``) spelt as ASCII character classes.

    The result uses Rust regex syntax (``\x{10FFFF}``), which both backends read.
    """
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in _ASCII:
                out.append(_ASCII[nxt] if in_class else f"[{_ASCII[nxt]}]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
            out.append(ch)
            i += 1
            if pattern[i : i + 1] == "^":
                out.append("^")
                i += 1
            if pattern[i : i + 1] == "]":
                out.append("]")
                i += 1
            continue
        if ch == "]" and in_class:
            in_class = False
        out.append(ch)
        i += 1
    return "".join(out)


def _pattern(pattern, pattern_file) -> str:
    """The regex from ``pattern`` or from the first line of ``pattern_file``."""
    if pattern in (None, "???"):
        pattern = None
    if pattern is not None and pattern_file not in _MISSING:
        raise ConfigError("give grammar.pattern or grammar.pattern_file, not both")
    if pattern_file not in _MISSING:
        lines = [line for line in _read_file(str(pattern_file), "regex file").splitlines() if line.strip()]
        if len(lines) != 1:
            raise ConfigError(f"regex file {str(pattern_file)!r} must hold exactly one non-empty line")
        return lines[0]
    if not isinstance(pattern, str):
        raise ConfigError("grammar=regex needs grammar.pattern (a regular expression string) or grammar.pattern_file")
    return pattern


def load_schema(value) -> tuple[dict, str]:
    """(schema dict, short description) from a dict, JSON text, file path or pydantic model class."""
    if value in _MISSING:
        raise ConfigError("grammar=json_schema needs grammar.schema (a file path, JSON text or a dict)")
    if isinstance(value, type):
        dump = getattr(value, "model_json_schema", None)
        if dump is None:
            raise ConfigError(f"schema class {value.__name__} is not a pydantic model (no model_json_schema)")
        return dump(), value.__name__
    if isinstance(value, Mapping):
        schema = _shallow(value, "grammar.schema")
        return schema, shorten(json.dumps(schema, sort_keys=True))
    if isinstance(value, bool):
        raise ConfigError("boolean schemas (true/false) are not supported; give an object schema")
    if not isinstance(value, (str, pathlib.Path)):
        raise ConfigError(f"grammar.schema must be a dict, JSON text, a file path or a pydantic model "
                          f"class; got {type(value).__name__}")
    text = str(value).strip()
    if text.startswith(("{", "[")):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"grammar.schema is not valid JSON: {exc}") from exc
        except RecursionError:
            raise _too_deep("grammar.schema") from None
        if not isinstance(parsed, Mapping):
            raise ConfigError(f"grammar.schema must be a JSON object (a JSON schema), not {type(parsed).__name__}")
        return _shallow(parsed, "grammar.schema"), shorten(text)
    try:
        parsed = json.loads(_read_file(text, "schema file", " (give a path to a .json file or inline JSON)"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"schema file {text!r} is not valid JSON: {first_line(exc)}") from exc
    except RecursionError:
        raise _too_deep(f"schema file {text!r}") from None
    if not isinstance(parsed, Mapping):
        raise ConfigError(f"schema file {text!r} must contain a JSON object, not {type(parsed).__name__}")
    return _shallow(parsed, f"schema file {text!r}"), pathlib.Path(text).name


#: The deepest nesting of objects and arrays a schema may have. A deeper one is refused before any walk
#: over it (``_plain``, the schema checks) runs out of Python's stack: a 500-level schema was a
#: RecursionError. llguidance's JSON parser stops at 128 levels of its own input, which wraps the schema;
#: real schemas stay far below either.
MAX_SCHEMA_DEPTH = 100


def _shallow(schema: Mapping, what: str) -> dict:
    """``schema`` as plain dicts and lists, ConfigError (naming it as ``what``) when its objects and arrays
    nest more than :data:`MAX_SCHEMA_DEPTH` levels deep; measured without recursion."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, Mapping) else value if _is_list(value) else None
        if children is None:
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise _too_deep(what)
        stack.extend((child, depth + 1) for child in children)
    return _plain(schema)


def _too_deep(what: str) -> ConfigError:
    return ConfigError(f"{what} nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep; flatten it")


#: The most bytes a schema or regex file may have: a bigger one is refused before it is read.
GRAMMAR_FILE_BYTES = 4 * 2**20


def _read_file(name: str, what: str, hint: str = "") -> str:
    """The UTF-8 text of the file ``name`` (``what``: "regex file" or "schema file", for messages).

    ConfigError when it does not exist (+ ``hint``), is a directory or not a regular file, holds more than
    :data:`GRAMMAR_FILE_BYTES`, cannot be read or is not UTF-8."""
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        raise ConfigError(f"{what} {name!r} is a directory; give the path of a file")
    if not path.exists():
        raise ConfigError(f"{what} {name!r} does not exist{hint}")
    if not path.is_file():
        raise ConfigError(f"{what} {name!r} is not a regular file")
    try:
        with open(path, "rb") as file:
            data = file.read(GRAMMAR_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {name!r}: {exc.strerror or exc}") from None
    if len(data) > GRAMMAR_FILE_BYTES:
        raise ConfigError(f"{what} {name!r} holds more than {GRAMMAR_FILE_BYTES:,} bytes; a grammar that big "
                          "cannot compile in time")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(not_utf8(f"{what} {name!r}", exc)) from None


def _plain(value):
    """Deep copy into plain dict/list (OmegaConf containers included)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if _is_list(value):
        return [_plain(v) for v in value]
    return value


def _is_list(value) -> bool:
    """A list, tuple or OmegaConf ListConfig."""
    return isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and type(value).__name__ == "ListConfig")


def shorten(text: str, limit: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
