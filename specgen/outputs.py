"""Writing what a command produces when stdout may be closed and the disk may fill up.

Exit statuses the commands share: :data:`OUTPUT_FAILED` (74, sysexits' ``EX_IOERR``) with one line
naming the output that could not be written; :data:`STDOUT_CLOSED` (141 = 128 + SIGPIPE, what a shell
reports for a tool stopped by a closed pipe, as in ``specgen ... | head -c 5``), with no message. A
failing stderr never changes the exit status: :class:`TolerantStream` drops what it cannot write.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from pathlib import Path

from specgen.errors import OutputError

OUTPUT_FAILED = 74
STDOUT_CLOSED = 141


class StdoutClosed(Exception):
    """stdout's reader went away (EPIPE): the command stops quietly with status :data:`STDOUT_CLOSED`."""


def describe(exc: OSError) -> str:
    """``'No space left on device (ENOSPC)'``: an OSError's reason with its errno name."""
    name = errno.errorcode.get(exc.errno or 0)
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{reason} ({name})" if name else reason


def write_stdout(out, text: str) -> None:
    """Write ``text`` to ``out`` (stdout) and flush it: StdoutClosed on EPIPE, OutputError (one line)
    on any other failure (``/dev/full``, a closed descriptor). Either way stdout is pointed at
    /dev/null first (:func:`silence_stdout`), so nothing it still buffers fails again at exit."""
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError:
        silence_stdout(out)
        raise StdoutClosed from None
    except (OSError, ValueError) as exc:
        silence_stdout(out)
        reason = describe(exc) if isinstance(exc, OSError) else "it is closed"
        raise OutputError(f"cannot write the text to stdout: {reason}") from None


def require_stdout(out) -> None:
    """OutputError when stdout is closed at start (``>&-``: Python has no sys.stdout at all)."""
    if out is None:
        raise OutputError("stdout is closed (>&-), so the text has nowhere to go; "
                          "redirect it to a file, or give output=PATH.jsonl for a JSONL prompt_file")


def silence_stdout(out) -> None:
    """When ``out`` writes to file descriptor 1, point that at /dev/null, so the interpreter's last flush
    of a stdout whose reader is gone (or whose disk is full) neither fails nor prints (Python's
    documented SIGPIPE recipe). Any other stream is left alone."""
    try:
        if out.fileno() != 1:
            return
    except (AttributeError, OSError, ValueError):
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    except OSError:
        pass


class TolerantStream:
    """A text stream (stderr) whose write and flush failures are dropped: a message that cannot be
    shown must not turn a finished run into a failed one. ``stream`` None: stderr was closed at start."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            if self._stream is not None:
                self._stream.write(text)
        except (OSError, ValueError):
            pass
        return len(text)

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except (OSError, ValueError):
            pass

    def isatty(self) -> bool:
        try:
            return self._stream is not None and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name):
        return getattr(self._stream, name)


def tolerate_stderr() -> None:
    """Make ``sys.stderr`` a :class:`TolerantStream` (once)."""
    if not isinstance(sys.stderr, TolerantStream):
        sys.stderr = TolerantStream(sys.stderr)


def write_failure(path: Path | str, exc: OSError, kept: str) -> OutputError:
    """The one line for a file that could not be written: ``cannot write PATH: REASON (ENOSPC); KEPT``."""
    return OutputError(f"cannot write {path}: {describe(exc)}; {kept}")


def replace_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` a new ``path`` into ``tmp`` (``path`` + ``.tmp``, next to it), then rename it over
    ``path`` in one step: a failure (a full disk, Ctrl-C) removes ``tmp`` and leaves ``path`` as it was."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
