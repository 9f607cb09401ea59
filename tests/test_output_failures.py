"""Outputs that cannot be written: a closed pipe, a closed stdout, /dev/full, a failing stderr
(specgen.outputs, config.exits_on_error)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from specgen.cli import main as cli
from specgen.config.compose import compose, exits_on_error, to_container
from specgen.errors import OutputError
from specgen.outputs import OUTPUT_FAILED, STDOUT_CLOSED, StdoutClosed, TolerantStream, write_stdout

TINY_ARGS = ["target=tiny", "drafter=tiny", "threads=1", "dtype=float32"]
SPECGEN = os.path.join(os.path.dirname(sys.executable), "specgen")  # the console script


def _shell(script: str) -> subprocess.CompletedProcess:
    """Run ``script`` in bash with $SPECGEN set to the command (tiny models, 200 tokens)."""
    command = " ".join([SPECGEN, *TINY_ARGS, "max_new_tokens=200", "prompt=hello"])
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SPECGEN": command})


@pytest.mark.skipif(not os.path.exists("/dev/full") or not os.path.exists(SPECGEN), reason="needs /dev/full")
def test_closed_pipe_full_device_closed_stdout_and_failing_stderr():
    """| head -c 5: quiet, status 141 (traceback before); /dev/full and >&-: one line, status 74
    (AttributeError / OSError tracebacks before); stderr on /dev/full: status 0 (was 1)."""
    piped = _shell('$SPECGEN | head -c 5 >/dev/null; echo "rc=${PIPESTATUS[0]}" >&2')
    assert piped.stderr.splitlines()[-1] == f"rc={STDOUT_CLOSED}", piped.stderr
    assert "Traceback" not in piped.stderr and "Error" not in piped.stderr
    for redirect, message in ((">/dev/full", "cannot write the text to stdout: No space left on device (ENOSPC)"),
                              (">&-", "stdout is closed (>&-)")):
        done = _shell(f"$SPECGEN {redirect}")
        assert done.returncode == OUTPUT_FAILED, done.stderr
        lines = [line for line in done.stderr.splitlines() if not line.startswith("specgen: measuring")]
        assert len(lines) == 1 and lines[0].startswith("specgen: error: ") and message in lines[0], done.stderr
    quiet = _shell("$SPECGEN 2>/dev/full")
    assert quiet.returncode == 0 and quiet.stdout.strip(), quiet


def test_a_closed_stdout_is_refused_before_the_model_loads(monkeypatch, capsys):
    import specgen.engine.assemble

    monkeypatch.setattr(specgen.engine.assemble, "build_pipeline", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(sys, "stdout", None)
    cfg = to_container(compose([*TINY_ARGS, "prompt=hi"]))
    with pytest.raises(SystemExit) as info, exits_on_error("specgen"):
        cli.run(cfg)
    assert info.value.code == OUTPUT_FAILED
    assert capsys.readouterr().err.startswith("specgen: error: stdout is closed")


class _Failing(io.StringIO):
    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def write(self, text):
        raise self.exc


def test_write_stdout_tells_a_closed_pipe_from_a_failed_write():
    with pytest.raises(StdoutClosed):
        write_stdout(_Failing(BrokenPipeError(32, "Broken pipe")), "x")
    with pytest.raises(OutputError, match=r"No space left on device \(ENOSPC\)"):
        write_stdout(_Failing(OSError(28, "No space left on device")), "x")
    write_stdout(io.StringIO(), "fine")  # negative control


def test_a_failing_stderr_drops_what_it_cannot_write():
    stream = TolerantStream(_Failing(OSError(28, "No space left on device")))
    assert stream.write("summary\n") == 8
    stream.flush()
    TolerantStream(None).write("stderr closed at start\n")
    with pytest.raises(OSError):  # negative control: the bare stream raises
        _Failing(OSError(28, "No space left on device")).write("x")
