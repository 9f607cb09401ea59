"""The output file of the JSONL mode (:mod:`specgen.jsonl`): resuming it, appending records in input
order, and putting a resumed file back in input order.

A record is one JSON object per line with a non-negative integer ``index`` (the row's position in
the input) and a ``text`` or an ``error``; every write is one whole line in one ``write`` call.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from specgen.errors import ConfigError


def scan_output(path: Path, rows: Sequence) -> tuple[dict[int, dict], int]:
    """The records already in ``path`` by index (in file order), and the byte length of the valid part
    to keep. ``rows``: the input rows (each with its ``id``).

    A last line without its newline (a crash mid-write) and trailing blank lines are left out
    of the kept part. ConfigError for anything else that does not fit ``rows``: a complete line
    that is not a record (the last one too: the file may be the user's own, not a torn output),
    a repeated index, an index past the input's rows, an id that differs from its row's.
    """
    data = path.read_bytes() if path.is_file() else b""
    records: dict[int, dict] = {}
    kept, number = 0, 0
    while kept < len(data):
        end = data.find(b"\n", kept)
        number += 1
        record = _parse_record(data[kept:end]) if end >= 0 else None
        if record is None:  # kept only when torn (no newline: a crash mid-write) or blank to the end
            if end >= 0 and (data[kept:end].strip() or data[end + 1:].strip()):
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
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
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


def sort_records(path: Path, position: Callable[[dict], object]) -> None:
    """Rewrite the JSONL file ``path`` with its lines ordered by ``position`` of their record (stable).

    The new file is written next to ``path`` and replaces it in one rename (mode kept), so an
    interruption leaves either the old file or the sorted one; a file already in order is left alone.
    """
    lines = path.read_bytes().splitlines(keepends=True)
    ordered = sorted(lines, key=lambda line: position(json.loads(line)))
    if ordered == lines:
        return
    partial = path.with_name(f".{path.name}.sorting")
    with open(partial, "wb") as file:
        file.writelines(ordered)
        file.flush()
        os.fsync(file.fileno())
    shutil.copymode(path, partial)
    os.replace(partial, path)
