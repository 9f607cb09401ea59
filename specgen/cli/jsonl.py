"""Many prompts from a JSONL file, one JSON result line per prompt (the CLI's ``output=`` mode).

Input (``prompt_file=prompts.jsonl``): one row per non-blank line, either a JSON
string (the prompt) or an object with ``prompt`` (text or chat messages) and,
optionally, ``id`` (a string or an integer, copied to the result) and the
request options ``max_new_tokens``, ``seed``, ``stop``, ``schema`` (a JSON
object), ``regex``, ``speculative``, ``system``, ``chat`` and ``logprobs`` (k: the record
gets ``logprobs``, see :func:`~specgen.cli.jsonl_output.logprob_records`). An option a row
leaves out (or sets to null) takes the command line's value, so a row's output
depends neither on its position in the file nor on a resume.

Output (``output=out.jsonl``): one line per row, in input order; ``index`` is the
row's 0-based position among the input's non-blank lines::

    {"index": 0, "id": "a", "text": "...", "finish_reason": "eos", "guarantee": "exact", "stats": {...},
     "fingerprint": "3f9c0a1b2c3d4e5f"}
    {"index": 1, "id": null, "error": "line 2: ...", "fingerprint": "..."}

A row that cannot run (not UTF-8, not JSON, an unknown key, a bad option, a refused
schema, a prompt longer than the context) gets an error record and the other rows go on.
``fingerprint`` hashes the row's line and the run's generation settings
(:mod:`specgen.cli.jsonl_input`): a resume keeps a record only when its row and settings are
unchanged and reruns the others (their new record replaces the old one).
Each record is one ``write`` of a whole line to an unbuffered file as soon as its
row and every row before it have finished, so an interrupted run leaves valid
JSONL up to the last finished row; a resume keeps those records, drops a torn
last line and runs only the rows that have none (a resumed file with gaps is put
back in input order when the run ends; see :mod:`specgen.cli.jsonl_output`).

Rows are read one line at a time, after the model is loaded, and run as they are
read: memory holds the rows in flight, not the file (one pass first counts the rows
and matches a resumed output's fingerprints). A line or prompt too big for its
context (:func:`specgen.config.options.prompt_size_bound`) is an error row, refused by its
size without being tokenised (or, for a line, held in memory). A write that fails
(a full disk) stops the run with an OutputError; the file keeps every whole record.

With ``batch_size`` above 1 the rows run together on the batched engine
(:func:`specgen.batch.stream_batch`), :data:`WINDOW_PER_BATCH_ROW` times ``batch_size``
rows read at a time (a window's last rows drain before the next window starts): each row is first checked alone by
:func:`specgen.batch.prepare` (a row it refuses gets its error record and stays
out of the batch), rows finish out of order and :class:`RecordWriter` keeps the
file in input order. A row's output law (greedy: its text) is the same either way.

Consumers see rows only through :class:`JsonlJob`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from specgen.errors import OutputError, PromptError, SpecgenError, first_line
from specgen.events import FinishEvent, Generation
from specgen.config.run import RunConfig
from specgen.cli.jsonl_input import ROW_KEYS, Row, read_rows, row_lines, row_limit, settings_digest
from specgen.cli.jsonl_output import RecordWriter, Resumed, logprob_records, scan_output, tidy_records
from specgen.outputs import write_failure

__all__ = ["ROW_KEYS", "JsonlJob", "RecordWriter", "Row", "Summary", "job_from_config"]

#: With batch_size N, rows are read N times this many at a time.
WINDOW_PER_BATCH_ROW = 16


def result_record(row: Row, gen: Generation) -> dict:
    """The output line of a row that ran: text, finish reason, guarantee and its stats."""
    s = gen.stats
    stats = {"prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens, "rounds": s.rounds,
             "target_calls": s.target_calls, "drafted": s.drafted, "accepted": s.accepted,
             "acceptance_rate": round(s.acceptance_rate, 4),
             "acceptance_per_position": [round(a, 4) for a in s.acceptance_per_position],
             "tokens_per_target_call": round(s.tokens_per_target_call, 4), "wall_s": round(s.wall, 6),
             "ttft_s": None if s.ttft is None else round(s.ttft, 6), "tokens_per_s": round(s.tokens_per_s, 2)}
    record = {"index": row.index, "id": row.id, "text": gen.text, "finish_reason": gen.finish_reason,
              "guarantee": str(gen.guarantee), "stats": stats, "fingerprint": row.fingerprint}
    if gen.logprobs is not None:
        record["logprobs"] = logprob_records(gen.logprobs)
    return record


def error_record(row: Row, message: str) -> dict:
    """The output line of a row that could not run."""
    return {"index": row.index, "id": row.id, "error": message, "fingerprint": row.fingerprint}


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
    """Counts over every record in the output (``resumed``: how many were kept from before this run;
    ``rerun``: records there were but made from another row or other settings, run again)."""

    rows: int
    output: str
    ok: int = 0
    errors: int = 0
    resumed: int = 0
    rerun: int = 0

    @property
    def finished(self) -> int:
        return self.ok + self.errors

    def count(self, record: Mapping) -> None:
        if "error" in record:
            self.errors += 1
        else:
            self.ok += 1

    def line(self) -> str:
        """e.g. ``5 rows: 4 ok, 1 errors -> out.jsonl (2 resumed, 1 rerun: its row or settings changed)``."""
        notes = [f"{self.resumed} resumed"] if self.resumed else []
        if self.rerun:
            notes.append(f"{self.rerun} rerun: {'its' if self.rerun == 1 else 'their'} row or settings changed")
        return f"{self.rows} rows: {self.ok} ok, {self.errors} errors -> {self.output}" + \
            (f" ({', '.join(notes)})" if notes else "")


class _Kept:
    """The row indices a resumed output keeps: one byte per row its file holds."""

    def __init__(self, rows: int):
        self.flags = bytearray(rows)

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and 0 <= index < len(self.flags) and self.flags[index] == 1


class JsonlJob:
    """One ``output=`` run: the input counted and the output checked up front (nothing written), then run.

    ``prompt_file``/``output``: paths; ``resume``: keep the records already in ``output`` whose
    fingerprint matches their row's; ``defaults``: the run's RequestDefaults; ``context_length``: the
    model's, bounding each row's size; ``settings``: the run config, whose generation settings go into
    each row's fingerprint. Raises a SpecgenError (one line) for an unreadable input, one without rows,
    or an output that cannot be resumed, before any row runs. Memory: the rows in flight, and for a
    resume 10 bytes per record the output holds.
    """

    def __init__(self, prompt_file: Path, output: Path, *, resume: bool, defaults, context_length: int | None = None,
                 settings: Mapping | None = None):
        self.prompt_file, self.output, self.defaults = prompt_file, output, defaults
        self.context_length, self.digest = context_length, settings_digest(settings or {})
        resumed = scan_output(output) if resume else Resumed()
        self._kept, self._cut = _Kept(len(resumed.state)), resumed.kept
        self.summary = Summary(0, str(output))
        self.summary.rows = self._count(resumed)
        self.summary.resumed = sum(self._kept.flags)
        self.summary.ok = self.summary.resumed - self.summary.errors
        self._tidy = resumed.tidy and resumed.records == self.summary.resumed

    def _count(self, resumed: Resumed) -> int:
        """The input's rows (one pass, a line at a time), marking those whose record ``resumed`` keeps."""
        rows = 0
        try:
            with open(self.prompt_file, "rb") as file:
                for index, _, _, fingerprint in row_lines(file, row_limit(self.context_length), self.digest):
                    rows += 1
                    if resumed.matches(index, fingerprint):
                        self._kept.flags[index] = 1
                        self.summary.errors += resumed.is_error(index)
                    elif resumed.holds(index):
                        self.summary.rerun += 1
        except OSError as exc:
            raise PromptError(f"cannot read prompt_file {self.prompt_file}: {exc.strerror or exc}") from None
        if not rows:
            raise PromptError(f"prompt_file {self.prompt_file} has no rows; give one JSON prompt per line")
        return rows

    def rows(self) -> Iterator[Row]:
        """The rows still to run, read from the file one at a time."""
        return read_rows(self.prompt_file, self.defaults, context_length=self.context_length, digest=self.digest,
                         skip=self._kept)

    def run(self, pipe, on_row: Callable[[], None] | None = None, *, batch_size: int = 1) -> Summary:
        """Run every row the output does not keep on ``pipe``, appending records in input order.

        on_row: called after each row finished (a progress bar). batch_size: rows generated
        together (1 = one after another on ``pipe.stream``). KeyboardInterrupt propagates with
        the file valid up to the last record whose earlier rows had all finished (``summary``
        counts what is in it); OutputError (a full disk) likewise, naming the file. A resumed output
        that was not rows 0..k-1 in order, once each, is rewritten so when the run ends, however it ends.
        """
        try:
            self._run(pipe, on_row, batch_size)
        finally:
            if not self._tidy:
                tidy_records(self.output, self.summary.rows)
        return self.summary

    def _run(self, pipe, on_row, batch_size: int) -> None:
        try:
            file = open(self.output, "ab", buffering=0)
            file.truncate(self._cut)
        except OSError as exc:
            raise write_failure(self.output, exc, f"{self.summary.finished} of {self.summary.rows} rows are in it"
                                ) from None
        with file:
            writer = RecordWriter(file, self._kept)

            def put(row: Row, record: dict) -> None:
                try:
                    written = writer.put(row.index, record)
                except OSError as exc:
                    raise write_failure(self.output, exc, f"{self.summary.finished} of {self.summary.rows} rows "
                                        "are in it, each whole (free space, then resume=true continues)") from None
                for record in written:
                    self.summary.count(record)
                if on_row is not None:
                    on_row()

            if batch_size > 1:
                for window in _windows(self.rows(), WINDOW_PER_BATCH_ROW * batch_size):
                    for row in _run_batched(pipe, window, batch_size, put):
                        put(row, generate_record(pipe, row))
                return
            for row in self.rows():
                put(row, generate_record(pipe, row))


def _windows(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    """``rows`` in lists of ``size`` (the last may be shorter)."""
    rows = iter(rows)
    while window := list(islice(rows, size)):
        yield window


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
    except OutputError:
        raise
    except SpecgenError:
        return list(left.values())
    return []


def _batch_prompt(row: Row) -> dict:
    """The row as one prompt of :func:`specgen.batch.stream_batch` (its options ride along)."""
    return {"prompt": row.prompt, "options": row.options}


def job_from_config(cfg: RunConfig, context_length: int | None = None) -> JsonlJob:
    """The :class:`JsonlJob` a run config describes (``output``, ``prompt_file``, ``resume``, its
    request defaults) for a model with ``context_length`` tokens of context (None: rows are not bounded by size)."""
    return JsonlJob(Path(cfg.prompt_file), Path(cfg.output), resume=cfg.resume, defaults=cfg.requests,
                    context_length=context_length, settings=cfg.checked)

