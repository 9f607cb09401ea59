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
last line and runs only the rows that have none.

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

from specgen.errors import ConfigError, PromptError, SpecgenError, first_line
from specgen.events import FinishEvent, Generation
from specgen.options import check_prompt, request_options

#: The keys a row object may have: the prompt, an id, and the request options.
ROW_KEYS = ("prompt", "id", "max_new_tokens", "seed", "stop", "schema", "regex", "speculative", "system", "chat")
_OPTION_KEYS = ROW_KEYS[2:]


@dataclass(frozen=True)
class Row:
    """One input row. index: 0-based among non-blank lines; line: 1-based line number in the file;
    options: ``Pipeline.stream`` keyword arguments the row sets; error: why it cannot run, or None."""

    index: int
    line: int
    id: str | int | None = None
    prompt: str | list[dict] | None = None
    options: dict = field(default_factory=dict)
    error: str | None = None


def parse_row(text: str, index: int, line: int, defaults) -> Row:
    """One input line as a :class:`Row`; every problem becomes ``Row.error`` (one line naming the line).

    defaults: the pipeline's Defaults (the command line's values) that the row's options override.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return Row(index, line, error=f"line {line}: not valid JSON ({exc.msg} at column {exc.colno})")
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
        options = {key: value[key] for key in _OPTION_KEYS if value.get(key) is not None}
        if "schema" in options and not isinstance(options["schema"], dict):
            raise ConfigError(f"schema must be a JSON object (the JSON schema), got {_json_type(options['schema'])}")
        request_options(defaults, **options)
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


def read_rows(path: Path, defaults) -> list[Row]:
    """Every non-blank line of ``path`` parsed by :func:`parse_row`.

    PromptError (the whole file is unusable) when it cannot be read, is not UTF-8 or has no rows.
    """
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(f"prompt_file {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                          f"at offset {exc.start})") from None
    except OSError as exc:
        raise PromptError(f"cannot read prompt_file {path}: {exc.strerror or exc}") from None
    lines = [(number, line) for number, line in enumerate(text.split("\n"), start=1) if line.strip()]
    if not lines:
        raise PromptError(f"prompt_file {path} has no rows; give one JSON prompt per line")
    return [parse_row(line, index, number, defaults) for index, (number, line) in enumerate(lines)]


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
            "guarantee": gen.guarantee, "stats": stats}


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
        with closing(pipe.stream(row.prompt, **row.options)) as stream:
            for event in stream:
                if isinstance(event, FinishEvent):
                    return result_record(row, event.generation)
    except SpecgenError as exc:
        return error_record(row, f"line {row.line}: {first_line(exc)}")
    raise RuntimeError("stream ended without a finish event")


def scan_output(path: Path, rows: list[Row]) -> tuple[dict[int, dict], int]:
    """The records already in ``path`` by index, and the byte length of the valid part to keep.

    A last line that is not a complete record (no newline, not JSON: a crash mid-write) is
    left out of the kept part. ConfigError for anything else that does not fit ``rows``: a
    bad line before the last, a repeated index, an index past the input's rows, an id that
    differs from its row's.
    """
    data = path.read_bytes() if path.is_file() else b""
    records: dict[int, dict] = {}
    kept, number = 0, 0
    while kept < len(data):
        end = data.find(b"\n", kept)
        number += 1
        record = _parse_record(data[kept:end]) if end >= 0 else None
        if record is None:
            if end >= 0 and data[end + 1:].strip():
                raise ConfigError(f"output={path} line {number} is not a specgen result record; "
                                  "it cannot be resumed (choose another output file)")
            break
        index = record["index"]
        if index in records:
            raise ConfigError(f"output={path} holds row {index} twice; it cannot be resumed")
        if index >= len(rows) or record.get("id") != rows[index].id:
            raise ConfigError(f"output={path} line {number} (row {index}, id {record.get('id')!r}) does not "
                              "match prompt_file; it holds results of another input (choose another output file)")
        records[index] = record
        kept = end + 1
    return records, kept


def _parse_record(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("index"), int) and not isinstance(record["index"], bool)
    ok = ok and record["index"] >= 0 and (isinstance(record.get("text"), str) or isinstance(record.get("error"), str))
    return record if ok else None


class RecordWriter:
    """Appends records to an open unbuffered binary file in input order.

    ``done``: indices already in the file (skipped). A record whose earlier rows are not all
    written waits in memory; each written record is one whole line in one ``write`` call.
    """

    def __init__(self, file, done: set[int]):
        self._file = file
        self._done = set(done)
        self._pending: dict[int, dict] = {}
        self._next = 0
        self._advance()

    def put(self, index: int, record: dict) -> list[dict]:
        """Queue ``record`` for row ``index``; returns the records this call wrote (in order)."""
        self._pending[index] = record
        written = []
        while self._next in self._pending:
            record = self._pending.pop(self._next)
            data = memoryview((json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8"))
            while data:
                data = data[self._file.write(data):]
            written.append(record)
            self._done.add(self._next)
            self._advance()
        return written

    def _advance(self) -> None:
        while self._next in self._done:
            self._next += 1


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
    ``defaults``: the pipeline's Defaults. Raises a SpecgenError (one line) for an unreadable
    input or an output that cannot be resumed, before any model is loaded.
    """

    def __init__(self, prompt_file: Path, output: Path, *, resume: bool, defaults):
        self.rows = read_rows(prompt_file, defaults)
        self.output = output
        records, self._kept = scan_output(output, self.rows) if resume else ({}, 0)
        self.summary = Summary(len(self.rows), str(output), resumed=len(records))
        for record in records.values():
            self.summary.count(record)
        self._done = set(records)

    def run(self, pipe, on_row: Callable[[], None] | None = None, *, batch_size: int = 1) -> Summary:
        """Run every row not yet in the output on ``pipe``, appending records in input order.

        on_row: called after each row finished (a progress bar). batch_size: rows generated
        together (1 = one after another on ``pipe.stream``). KeyboardInterrupt propagates with
        the file valid up to the last record whose earlier rows had all finished (``summary``
        counts what is in it).
        """
        todo = [row for row in self.rows if row.index not in self._done]
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
            prepare(pipe, _batch_prompt(row), {}, None)  # None: the message names no batch index
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
    return {"prompt": row.prompt, **row.options}


def job_from_config(cfg: Mapping) -> JsonlJob:
    """The :class:`JsonlJob` a checked run config describes (``output``, ``prompt_file``, ``resume``)."""
    from specgen.engine import Defaults

    return JsonlJob(Path(cfg["prompt_file"]), Path(cfg["output"]), resume=cfg["resume"],
                    defaults=Defaults.from_config(cfg))

