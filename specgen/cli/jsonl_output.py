"""The output file of the JSONL mode (:mod:`specgen.cli.jsonl`): resuming it, appending records in input
order, and putting a resumed file back in input order.

A record is one JSON object per line with a non-negative integer ``index`` (the row's position in
the input), a ``text`` or an ``error``, and the ``fingerprint`` of the row that made it
(:mod:`specgen.cli.jsonl_input`); every write is one whole line in one ``write`` call. A rerun row's new
record is appended after its old one, and the later record of an index is the one that counts.
Rewrites (:func:`tidy_records`, :func:`sort_records`) go to a temporary file that replaces the
output in one rename, so a failure (a full disk) leaves the old file whole and no temporary behind.
"""

from __future__ import annotations

import json
import os
import shutil
from array import array
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specgen.errors import ConfigError
from specgen.sampling.logprobs import TokenLogprob
from specgen.outputs import replace_atomically, write_failure

_ABSENT, _OK, _ERROR, _UNCHECKED = 0, 1, 2, 3  # _UNCHECKED: a record without a fingerprint


@dataclass
class Resumed:
    """What an output file holds, per row index up to its largest: whether the index's last record is
    a result or an error (``state``) and that record's fingerprint; ``kept``: the byte length of the
    file's valid part; ``records``: records in it; ``tidy``: whether they are rows 0..k-1, once each,
    in order. Memory: 9 bytes per row the file holds, nothing for a new output."""

    state: bytearray = field(default_factory=bytearray)
    fingerprints: array = field(default_factory=lambda: array("Q"))
    kept: int = 0
    records: int = 0
    tidy: bool = True

    def matches(self, index: int, fingerprint: str) -> bool:
        """Whether row ``index``'s record was made from a row with ``fingerprint``."""
        return index < len(self.state) and self.state[index] in (_OK, _ERROR) \
            and self.fingerprints[index] == int(fingerprint, 16)

    def is_error(self, index: int) -> bool:
        return self.state[index] == _ERROR

    def holds(self, index: int) -> bool:
        """Whether the file has a record for row ``index`` (matching or not)."""
        return index < len(self.state) and self.state[index] != _ABSENT


def scan_output(path: Path) -> Resumed:
    """The records already in ``path``, read one line at a time.

    A last line without its newline (a crash mid-write) and trailing blank lines are left out of the
    kept part; a record without a fingerprint (or with a malformed one) matches no row, so its row
    is rerun. ConfigError for a complete line that is not a record (the last one too: the file may
    be the user's own, not a torn output).
    """
    resumed = Resumed()
    if not path.is_file():
        return resumed
    with open(path, "rb") as file:
        number, blank = 0, None
        for line in file:
            number += 1
            record = _parse_record(line) if line.endswith(b"\n") else None
            if record is None and (not line.endswith(b"\n") or not line.strip()):
                blank = number if blank is None else blank  # torn or blank: left out, if nothing follows
                continue
            if record is None or blank is not None:
                raise ConfigError(f"output={path} line {blank or number} is not a specgen result record; "
                                  "it cannot be resumed (choose another output file)")
            _note(resumed, record)
            resumed.kept += len(line)
    return resumed


def _note(resumed: Resumed, record: dict) -> None:
    index, fingerprint = record["index"], record.get("fingerprint")
    resumed.tidy = resumed.tidy and index == resumed.records
    resumed.records += 1
    if index >= len(resumed.state):
        grow = index + 1 - len(resumed.state)
        resumed.state.extend(bytes(grow))
        resumed.fingerprints.extend(array("Q", bytes(8 * grow)))
    if isinstance(fingerprint, str) and len(fingerprint) == 16 and all(c in "0123456789abcdef" for c in fingerprint):
        resumed.state[index] = _ERROR if "error" in record else _OK
        resumed.fingerprints[index] = int(fingerprint, 16)
    else:
        resumed.state[index] = _UNCHECKED


def _parse_record(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    ok = isinstance(record, dict) and isinstance(record.get("index"), int) and not isinstance(record["index"], bool)
    ok = ok and record["index"] >= 0 and (isinstance(record.get("text"), str) or isinstance(record.get("error"), str))
    return record if ok else None


def logprob_records(entries: Sequence[TokenLogprob]) -> list[dict]:
    """A record's ``logprobs``: per generated token ``{"token_id", "logprob", "top_logprobs": [[id, logprob], ...]}``."""
    return [{"token_id": e.token_id, "logprob": e.logprob, "top_logprobs": [list(pair) for pair in e.top]}
            for e in entries]


class RecordWriter:
    """Appends records to an open unbuffered binary file in input order.

    ``done``: indices whose records are already in the file (skipped). A record whose earlier rows
    are not all written waits in memory; each written record is one whole line in one ``write`` call.
    A failed write (OSError: a full disk) cuts the file back to its last whole line and propagates.
    """

    def __init__(self, file, done: Container[int] = ()):
        self._file = file
        self._done = done
        self._pending: dict[int, dict] = {}
        self._next = 0
        self._advance()

    def put(self, index: int, record: dict) -> list[dict]:
        """Queue ``record`` for row ``index``; returns the records this call wrote (in order)."""
        self._pending[index] = record
        written = []
        while self._next in self._pending:
            record = self._pending.pop(self._next)
            self._write((json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8"))
            written.append(record)
            self._next += 1
            self._advance()
        return written

    def _write(self, line: bytes) -> None:
        start = self._file.seek(0, os.SEEK_END)
        data = memoryview(line)
        try:
            while data:
                data = data[self._file.write(data):]
        except OSError:
            self._file.truncate(start)  # no torn line: the file stays valid up to the last record
            raise

    def _advance(self) -> None:
        while self._next in self._done:
            self._next += 1


def tidy_records(path: Path, rows: int) -> None:
    """Rewrite the JSONL output ``path`` as one record per row index below ``rows`` (the later of two
    records of an index), in index order; records past ``rows`` are dropped. Reads the file twice
    line by line (memory: 12 bytes per row). OutputError when the rewrite cannot be written."""
    offsets, lengths = array("q", [-1]) * rows, array("l", [0]) * rows
    with open(path, "rb") as file:
        offset = 0
        for line in file:
            record = _parse_record(line) if line.endswith(b"\n") else None
            if record is not None and record["index"] < rows:
                offsets[record["index"]], lengths[record["index"]] = offset, len(line)
            offset += len(line)

    def write(source, target) -> None:
        for start, length in zip(offsets, lengths):
            if start >= 0:
                source.seek(start)
                target.write(source.read(length))

    _replace(path, write, "its records are out of order (resume=true puts them in order)")


def sort_records(path: Path, position: Callable[[dict], object]) -> None:
    """Rewrite the JSONL file ``path`` with its lines ordered by ``position`` of their record (stable).

    The new file replaces ``path`` in one rename (mode kept), so an interruption leaves either the old
    file or the sorted one; a file already in order is left alone. OutputError when it cannot be written.
    """
    lines = path.read_bytes().splitlines(keepends=True)
    ordered = sorted(lines, key=lambda line: position(json.loads(line)))
    if ordered != lines:
        _replace(path, lambda source, target: target.writelines(ordered), "its records are out of order")


def _replace(path: Path, write: Callable, left: str) -> None:
    """``write(source, target)`` a new ``path`` from the old one (:func:`replace_atomically`, mode kept,
    synced); OutputError when it cannot be written, saying the old file is whole."""

    def rewrite(tmp: Path) -> None:
        with open(path, "rb") as source, open(tmp, "wb") as target:
            write(source, target)
            target.flush()
            os.fsync(target.fileno())
        shutil.copymode(path, tmp)

    try:
        replace_atomically(path, rewrite)
    except OSError as exc:
        raise write_failure(path, exc, f"the file is unchanged and every record in it is kept, but {left}") from None
