"""The input file of the JSONL mode (:mod:`specgen.cli.jsonl`): rows read one line at a time, each with
a fingerprint of what decides its output.

A row is a non-blank line (a line of ASCII whitespace is blank; a UTF-8 byte-order mark before the
first line is not part of it): a JSON string (the prompt) or an object with ``prompt`` and the keys
of :data:`ROW_KEYS`. Every problem of one row (not UTF-8, not JSON, an unknown key, a bad option, a
prompt too big for the context) becomes that row's ``error``; only an unreadable file is refused
whole. :func:`row_lines` holds one line at a time, so reading a file takes memory for its longest
row, not for the file.

A row's fingerprint hashes its line's bytes with :func:`settings_digest` of the run's generation
settings: a resumed output keeps a record only when both are what made it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Container, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from specgen.errors import ConfigError, PromptError, SpecgenError, first_line, not_utf8
from specgen.config.options import RequestOptions, check_prompt, check_prompt_size, prompt_size_bound, request_options

#: The keys a row object may have: the prompt, an id, and the request options.
ROW_KEYS = ("prompt", "id", "max_new_tokens", "seed", "stop", "schema", "regex", "speculative", "system", "chat",
            "logprobs")
_OPTION_KEYS = ROW_KEYS[2:]

#: A row's JSON line may be this many times the prompt bound: a JSON escape takes at most six bytes
#: for each UTF-8 byte it stands for, and the row's other fields need room too.
ROW_BYTES_PER_PROMPT_BYTE = 8

#: Config keys that do not change what a row generates, left out of :func:`settings_digest`: where the
#: rows come from and go, the display, and how many rows share a step.
_NOT_GENERATION = ("prompt", "prompt_file", "output", "resume", "batch_size", "ui", "hydra")
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Row:
    """One input row. index: 0-based among non-blank lines; line: 1-based line number in the file;
    options: the ``Pipeline.stream`` options the row sets (None where the command line's apply);
    error: why it cannot run, or None; fingerprint: 16 hex digits (:func:`row_lines`)."""

    index: int
    line: int
    id: str | int | None = None
    prompt: str | list[dict] | None = None
    options: RequestOptions = field(default_factory=RequestOptions)
    error: str | None = None
    fingerprint: str = ""


def settings_digest(cfg: Mapping) -> bytes:
    """A digest of a run config's settings that change what a row generates (every key but
    :data:`_NOT_GENERATION`: the models, drafter, sampling, processors, grammar, defaults, threads)."""
    settings = {key: value for key, value in cfg.items() if key not in _NOT_GENERATION}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).digest()


def row_limit(context_length: int | None) -> int | None:
    """The most bytes a row's line may have for a model with ``context_length`` tokens (None: no bound)."""
    return None if context_length is None else ROW_BYTES_PER_PROMPT_BYTE * prompt_size_bound(context_length)


def row_lines(file, limit: int | None, digest: bytes) -> Iterator[tuple[int, int, bytes | int, str]]:
    """(row index, line number, line, fingerprint) per non-blank line of a binary file.

    ``line``: the bytes without the newline (and, first, the byte-order mark), or the line's byte
    length when it is over ``limit`` bytes (read in pieces and dropped, never held whole).
    ``fingerprint``: 16 hex digits of sha256(``digest`` + the line's bytes).
    """
    index, number = 0, 0
    while True:
        line = file.readline() if limit is None else file.readline(limit + 1)
        if not line:
            return
        number += 1
        if number == 1 and line.startswith(_BOM):
            line = line[len(_BOM):]
        hasher = hashlib.sha256(digest)
        if limit is not None and len(line) > limit and not line.endswith(b"\n"):
            size = len(line)
            while line:
                hasher.update(line.rstrip(b"\n"))
                if line.endswith(b"\n"):
                    break
                line = file.readline(1 << 20)
                size += len(line)
            yield index, number, size, hasher.hexdigest()[:16]
            index += 1
            continue
        line = line.rstrip(b"\n")
        if line.strip():
            hasher.update(line)
            yield index, number, line, hasher.hexdigest()[:16]
            index += 1


def read_rows(path: Path, defaults, *, context_length: int | None = None, digest: bytes = b"",
              skip: Container[int] = ()) -> Iterator[Row]:
    """The rows of ``path`` (:func:`row_lines`) parsed by :func:`parse_row`, one at a time; rows whose
    index is in ``skip`` are passed over unparsed. Given the model's ``context_length``, a line longer
    than :func:`row_limit` is an error row. PromptError when the file cannot be read."""
    limit = row_limit(context_length)
    try:
        with open(path, "rb") as file:
            for index, number, line, fingerprint in row_lines(file, limit, digest):
                if index in skip:
                    continue
                if isinstance(line, int):
                    yield Row(index, number, error=f"line {number}: the row is {line:,} bytes; a row for this "
                                                   f"model's {context_length:,}-token context has at most {limit:,}",
                              fingerprint=fingerprint)
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield Row(index, number, error=f"line {number}: {not_utf8('the row', exc)}", fingerprint=fingerprint)
                    continue
                yield parse_row(text, index, number, defaults, context_length=context_length, fingerprint=fingerprint)
    except OSError as exc:
        raise PromptError(f"cannot read prompt_file {path}: {exc.strerror or exc}") from None


def check_has_rows(path: Path) -> None:
    """PromptError when ``path`` cannot be read or has no non-blank line (read until the first one,
    1 MiB at a time): found before any model loads."""
    try:
        with open(path, "rb") as file:
            first = True
            while piece := file.read(1 << 20):
                if first and piece.startswith(_BOM):
                    piece = piece[len(_BOM):]
                first = False
                if piece.strip():
                    return
    except OSError as exc:
        raise PromptError(f"cannot read prompt_file {path}: {exc.strerror or exc}") from None
    raise PromptError(f"prompt_file {path} has no rows; give one JSON prompt per line")


def parse_row(text: str, index: int, line: int, defaults, *, context_length: int | None = None,
              fingerprint: str = "") -> Row:
    """One input line as a :class:`Row`; every problem becomes ``Row.error`` (one line naming the line).

    defaults: the run's RequestDefaults (the command line's values) that the row's options override;
    context_length: the model's, when given a prompt too big to fit it is an error (by its length,
    see :func:`~specgen.config.options.check_prompt_size`).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return Row(index, line, error=f"line {line}: not valid JSON ({exc.msg} at column {exc.colno})",
                   fingerprint=fingerprint)
    except RecursionError:
        return Row(index, line, error=f"line {line}: the row nests JSON arrays or objects too deeply to parse",
                   fingerprint=fingerprint)
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict):
        return Row(index, line, error=f'line {line}: a row must be a JSON string (the prompt) or an object with '
                                      f'"prompt", got {_json_type(value)}', fingerprint=fingerprint)
    row_id = value.get("id")
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, (str, int))):
        return Row(index, line, error=f"line {line}: id must be a string or an integer, got {_json_type(row_id)}",
                   fingerprint=fingerprint)
    try:
        _check_keys(value)
        if "prompt" not in value:
            raise PromptError('a row object needs a "prompt" (text or chat messages)')
        prompt = check_prompt(value["prompt"])
        if context_length is not None:
            check_prompt_size(prompt, context_length)
        options = RequestOptions(**{key: value.get(key) for key in _OPTION_KEYS})
        if options.schema is not None and not isinstance(options.schema, dict):
            raise ConfigError(f"schema must be a JSON object (the JSON schema), got {_json_type(options.schema)}")
        request_options(defaults, options)
    except SpecgenError as exc:
        return Row(index, line, row_id, error=f"line {line}: {first_line(exc)}", fingerprint=fingerprint)
    return Row(index, line, row_id, prompt, options, fingerprint=fingerprint)


def _check_keys(value: Mapping) -> None:
    for key in value:
        if key not in ROW_KEYS:
            close = difflib.get_close_matches(key, ROW_KEYS, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(ROW_KEYS)}"
            raise ConfigError(f"unknown key {key!r}{hint}")


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")
