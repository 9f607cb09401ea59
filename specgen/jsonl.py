"""Many prompts from a JSONL file, one JSON result line per prompt (the CLI's ``output=`` mode).

Input (``prompt_file=prompts.jsonl``): one row per non-blank line, either a JSON
string (the prompt) or an object with ``prompt`` (text or chat messages) and,
optionally, ``id`` (a string or an integer, copied to the result) and the
request options ``max_new_tokens``, ``seed``, ``stop``, ``schema`` (a JSON
object), ``regex``, ``speculative``, ``system`` and ``chat``. An option a row
leaves out (or sets to null) takes the command line's value, so a row's output
depends neither on its position in the file nor on a resume.

Output (``output=out.jsonl``): one line per row, in input order; ``index`` is the
row's 0-based position among the input's non-blank lines::

    {"index": 0, "id": "a", "text": "...", "finish_reason": "eos", "guarantee": "exact", "stats": {...}}
    {"index": 1, "id": null, "error": "line 2: ..."}

A row that cannot run (not JSON, an unknown key, a bad option, a refused schema,
a prompt longer than the context) gets an error record and the other rows go on.
Each record is one ``write`` of a whole line to an unbuffered file as soon as its
row and every row before it have finished, so an interrupted run leaves valid
JSONL up to the last finished row; a resume keeps those records, drops a torn
last line and runs only the rows that have none (a resumed file with gaps is put
back in input order when the run ends; see :mod:`specgen.jsonl_output`).

Rows are read one line at a time, after the model is loaded: a line or prompt too
big for its context (:func:`specgen.options.prompt_size_bound`) is an error row,
refused by its size without being tokenised (or, for a line, held in memory).

With ``batch_size`` above 1 the rows run together on the batched engine
(:func:`specgen.batch.stream_batch`): each row is first checked alone by
:func:`specgen.batch.prepare` (a row it refuses gets its error record and stays
out of the batch), rows finish out of order and :class:`RecordWriter` keeps the
file in input order. A row's output law (greedy: its text) is the same either way.

Consumers see rows only through :class:`JsonlJob`.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from specgen.errors import ConfigError, PromptError, SpecgenError, first_line, not_utf8
from specgen.events import FinishEvent, Generation
from specgen.jsonl_output import RecordWriter, scan_output, sort_records
from specgen.options import RequestOptions, check_prompt, check_prompt_size, prompt_size_bound, request_options

#: The keys a row object may have: the prompt, an id, and the request options.
ROW_KEYS = ("prompt", "id", "max_new_tokens", "seed", "stop", "schema", "regex", "speculative", "system", "chat")
_OPTION_KEYS = ROW_KEYS[2:]


@dataclass(frozen=True)
class Row:
    """One input row. index: 0-based among non-blank lines; line: 1-based line number in the file;
    options: the ``Pipeline.stream`` options the row sets (None where the command line's apply);
    error: why it cannot run, or None."""

    index: int
    line: int
    id: str | int | None = None
    prompt: str | list[dict] | None = None
    options: RequestOptions = field(default_factory=RequestOptions)
    error: str | None = None


def parse_row(text: str, index: int, line: int, defaults, *, context_length: int | None = None) -> Row:
    """One input line as a :class:`Row`; every problem becomes ``Row.error`` (one line naming the line).

    defaults: the pipeline's Defaults (the command line's values) that the row's options override;
    context_length: the model's, when given a prompt too big to fit it is an error (by its length,
    see :func:`~specgen.options.check_prompt_size`).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return Row(index, line, error=f"line {line}: not valid JSON ({exc.msg} at column {exc.colno})")
    except RecursionError:
        return Row(index, line, error=f"line {line}: the row nests JSON arrays or objects too deeply to parse")
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict):
        return Row(index, line, error=f'line {line}: a row must be a JSON string (the prompt) or an object with '
                                      f'"prompt", got {_json_type(value)}')
    row_id = value.get("id")
    if row_id is not None and (isinstance(row_id, bool) or not isinstance(row_id, (str, int))):
        return Row(index, line, error=f"line {line}: id must be a string or an integer, got {_json_type(row_id)}")
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
        return Row(index, line, row_id, error=f"line {line}: {first_line(exc)}")
    return Row(index, line, row_id, prompt, options)


def _check_keys(value: Mapping) -> None:
    for key in value:
        if key not in ROW_KEYS:
            close = difflib.get_close_matches(key, ROW_KEYS, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; known: {', '.join(ROW_KEYS)}"
            raise ConfigError(f"unknown key {key!r}{hint}")


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


#: A row's JSON line may be this many times the prompt bound: a JSON escape takes at most six bytes
#: for each UTF-8 byte it stands for, and the row's other fields need room too.
ROW_BYTES_PER_PROMPT_BYTE = 8


def read_rows(path: Path, defaults, *, context_length: int | None = None) -> list[Row]:
    """Every non-blank line of ``path`` parsed by :func:`parse_row`, read one line at a time.

    Given the model's ``context_length``, a line longer than :data:`ROW_BYTES_PER_PROMPT_BYTE` times
    :func:`~specgen.options.prompt_size_bound` becomes an error row without being held in memory
    or parsed. PromptError (the whole file is unusable) when it cannot be read, is not UTF-8 or has
    no rows.
    """
    limit = None if context_length is None else ROW_BYTES_PER_PROMPT_BYTE * prompt_size_bound(context_length)
    rows: list[Row] = []
    try:
        with open(path, "rb") as file:
            for number, offset, line in _lines(file, limit):
                if isinstance(line, int):
                    rows.append(Row(len(rows), number, error=f"line {number}: the row is {line:,} bytes; a row "
                                    f"for this model's {context_length:,}-token context has at most {limit:,}"))
                    continue
                text = _decode_line(line, path, offset)
                if text.strip():
                    rows.append(parse_row(text, len(rows), number, defaults, context_length=context_length))
    except OSError as exc:
        raise PromptError(f"cannot read prompt_file {path}: {exc.strerror or exc}") from None
    if not rows:
        raise PromptError(f"prompt_file {path} has no rows; give one JSON prompt per line")
    return rows


def _lines(file, limit: int | None):
    """(line number, byte offset, line) per line of a binary file; ``line`` is the byte length
    instead when it is over ``limit`` bytes (the line is skipped, not kept)."""
    number, offset = 0, 0
    while True:
        line = file.readline() if limit is None else file.readline(limit + 1)
        if not line:
            return
        number += 1
        if limit is not None and len(line) > limit and not line.endswith(b"\n"):
            size = len(line)
            while not line.endswith(b"\n") and (line := file.readline(1 << 20)):
                size += len(line)
            yield number, offset, size
            offset += size
            continue
        yield number, offset, line
        offset += len(line)


def _decode_line(line: bytes, path: Path, offset: int) -> str:
    """A line as text without its newline (and, on the first line, without a UTF-8 byte-order mark)."""
    try:
        return line.decode("utf-8-sig" if offset == 0 else "utf-8").rstrip("\n")
    except UnicodeDecodeError as exc:
        raise PromptError(not_utf8(f"prompt_file {path}", exc, offset)) from None


def result_record(row: Row, gen: Generation) -> dict:
    """The output line of a row that ran: text, finish reason, guarantee and its stats."""
    s = gen.stats
    stats = {"prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens, "rounds": s.rounds,
             "target_calls": s.target_calls, "drafted": s.drafted, "accepted": s.accepted,
             "acceptance_rate": round(s.acceptance_rate, 4),
             "acceptance_per_position": [round(a, 4) for a in s.acceptance_per_position],
             "tokens_per_target_call": round(s.tokens_per_target_call, 4), "wall_s": round(s.wall, 6),
             "ttft_s": None if s.ttft is None else round(s.ttft, 6), "tokens_per_s": round(s.tokens_per_s, 2)}
    return {"index": row.index, "id": row.id, "text": gen.text, "finish_reason": gen.finish_reason,
            "guarantee": str(gen.guarantee), "stats": stats}


def error_record(row: Row, message: str) -> dict:
    """The output line of a row that could not run."""
    return {"index": row.index, "id": row.id, "error": message}


def generate_record(pipe, row: Row) -> dict:
    """Run one row on ``pipe`` (a Pipeline) and return its record; a SpecgenError becomes an error record.

    KeyboardInterrupt closes the stream (the engine rolls the round back) and propagates.
    """
    if row.error is not None:
        return error_record(row, row.error)
    try:
        with closing(pipe.stream(row.prompt, row.options)) as stream:
            for event in stream:
                if isinstance(event, FinishEvent):
                    return result_record(row, event.generation)
    except SpecgenError as exc:
        return error_record(row, f"line {row.line}: {first_line(exc)}")
    raise RuntimeError("stream ended without a finish event")


@dataclass
class Summary:
    """Counts over every record in the output (``resumed``: how many were there before this run)."""

    rows: int
    output: str
    ok: int = 0
    errors: int = 0
    resumed: int = 0

    @property
    def finished(self) -> int:
        return self.ok + self.errors

    def count(self, record: Mapping) -> None:
        if "error" in record:
            self.errors += 1
        else:
            self.ok += 1

    def line(self) -> str:
        """e.g. ``5 rows: 4 ok, 1 errors -> out.jsonl (2 resumed)``."""
        resumed = f" ({self.resumed} resumed)" if self.resumed else ""
        return f"{self.rows} rows: {self.ok} ok, {self.errors} errors -> {self.output}{resumed}"


class JsonlJob:
    """One ``output=`` run: rows read and the output checked up front (nothing written), then run.

    ``prompt_file``/``output``: paths; ``resume``: keep the records already in ``output``;
    ``defaults``: the pipeline's Defaults; ``context_length``: the model's, bounding each row's
    size (:func:`read_rows`). Raises a SpecgenError (one line) for an unreadable input or an output
    that cannot be resumed, before any row runs.
    """

    def __init__(self, prompt_file: Path, output: Path, *, resume: bool, defaults, context_length: int | None = None):
        self.rows = read_rows(prompt_file, defaults, context_length=context_length)
        self.output = output
        records, self._kept = scan_output(output, self.rows) if resume else ({}, 0)
        self.summary = Summary(len(self.rows), str(output), resumed=len(records))
        for record in records.values():
            self.summary.count(record)
        self._done = set(records)
        self._in_order = list(records) == list(range(len(records)))  # the kept records are rows 0..k-1

    def run(self, pipe, on_row: Callable[[], None] | None = None, *, batch_size: int = 1) -> Summary:
        """Run every row not yet in the output on ``pipe``, appending records in input order.

        on_row: called after each row finished (a progress bar). batch_size: rows generated
        together (1 = one after another on ``pipe.stream``). KeyboardInterrupt propagates with
        the file valid up to the last record whose earlier rows had all finished (``summary``
        counts what is in it). A resumed output whose kept records were not rows 0..k-1 in order
        (a gap, rows moved) is rewritten in input order when the run ends, however it ends.
        """
        todo = [row for row in self.rows if row.index not in self._done]
        try:
            with open(self.output, "ab", buffering=0) as file:
                file.truncate(self._kept)
                writer = RecordWriter(file, self._done)

                def put(row: Row, record: dict) -> None:
                    for written in writer.put(row.index, record):
                        self.summary.count(written)
                    if on_row is not None:
                        on_row()

                if batch_size > 1:
                    todo = _run_batched(pipe, todo, batch_size, put)
                for row in todo:
                    put(row, generate_record(pipe, row))
        finally:
            if not self._in_order:
                sort_records(self.output, lambda record: record["index"])
        return self.summary


def _run_batched(pipe, rows: list[Row], batch_size: int, put: Callable[[Row, dict], None]) -> list[Row]:
    """Give every row in ``rows`` its record via ``put`` as it finishes, ``batch_size`` rows at a time.

    A row that fails its own check (:func:`specgen.batch.prepare`) gets its error record
    first. Returns the rows left without a record when the batch itself stopped on a
    SpecgenError (the caller runs those one at a time, so one bad row cannot sink the rest).
    """
    from specgen.batch import prepare, stream_batch

    runnable: list[Row] = []
    for row in rows:
        if row.error is not None:
            put(row, error_record(row, row.error))
            continue
        try:
            prepare(pipe, _batch_prompt(row), None, None)  # None: the message names no batch index
        except SpecgenError as exc:
            put(row, error_record(row, f"line {row.line}: {first_line(exc)}"))
            continue
        runnable.append(row)
    left = {row.index: row for row in runnable}
    if not runnable:
        return []
    events = stream_batch(pipe, [_batch_prompt(row) for row in runnable], batch_size=batch_size)
    try:
        with closing(events):
            for position, event in events:
                if isinstance(event, FinishEvent):
                    row = left.pop(runnable[position].index)
                    put(row, result_record(row, event.generation))
    except SpecgenError:
        return list(left.values())
    return []


def _batch_prompt(row: Row) -> dict:
    """The row as one prompt of :func:`specgen.batch.stream_batch` (its options ride along)."""
    return {"prompt": row.prompt, "options": row.options}


def job_from_config(cfg: Mapping, context_length: int | None = None) -> JsonlJob:
    """The :class:`JsonlJob` a checked run config describes (``output``, ``prompt_file``, ``resume``)
    for a model with ``context_length`` tokens of context (None: rows are not bounded by size)."""
    from specgen.engine import Defaults

    return JsonlJob(Path(cfg["prompt_file"]), Path(cfg["output"]), resume=cfg["resume"],
                    defaults=Defaults.from_config(cfg), context_length=context_length)

