"""Console scripts: Ctrl-C at any point, also while the command's heavy imports load, exits 130 with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from specgen.cli import entry

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_console_script_imports_its_command_inside_the_guard():
    """Each [project.scripts] entry is specgen.cli.entry's function for it, which runs the command's main()."""
    assert set(SCRIPTS) == set(entry.COMMANDS)
    for name, target in SCRIPTS.items():
        assert target == f"specgen.cli.entry:{name.replace('-', '_')}", name
        assert callable(__import__(entry.COMMANDS[name], fromlist=["main"]).main)


def _interrupt_when(cmd: list[str], marker: str, env: dict, tmp_path: Path) -> tuple[int, list[str]]:
    """Start ``cmd``, wait until a stderr line holds ``marker``, send SIGINT; -> (status, stderr lines).

    The child starts with SIGINT at its default, as a terminal's foreground command does: a test run
    started in the background (``cmd &`` in a script) ignores SIGINT, and children inherit that."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if marker in line:
                proc.send_signal(signal.SIGINT)
                break
        lines += proc.stderr.read().splitlines()
        return proc.wait(timeout=120), lines
    finally:
        proc.kill()
        proc.stderr.close()


def _slow_module(tmp_path: Path) -> None:
    (tmp_path / "slow_import.py").write_text(
        "import sys, time\nsys.stderr.write('importing\\n'); sys.stderr.flush()\ntime.sleep(600)\nmain = print\n")


def test_ctrl_c_inside_an_import_exits_130_with_one_line(tmp_path):
    _slow_module(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    code = "import sys\nfrom specgen.cli.entry import run\nsys.exit(run('specgen', 'slow_import'))"
    status, lines = _interrupt_when([sys.executable, "-c", code], "importing", env, tmp_path)
    assert (status, lines) == (130, ["importing", "specgen: cancelled"])


def test_negative_control_an_unguarded_import_prints_a_traceback(tmp_path):
    """The same interrupt without the guard: the traceback the guard prevents (so the test above can fail)."""
    _slow_module(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    status, lines = _interrupt_when([sys.executable, "-c", "import slow_import"], "importing", env, tmp_path)
    assert status != 130 and "KeyboardInterrupt" in "\n".join(lines)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_ctrl_c_while_torch_loads_exits_130_with_one_line(script, tmp_path):
    """Each script as pip's wrapper runs its pyproject entry (``from module import func; sys.exit(func())``),
    interrupted after torch._C loaded and before torch (and the command) finished importing."""
    module, _, func = SCRIPTS[script].partition(":")
    wrapper = f"import sys\nfrom {module} import {func}\nsys.argv[0] = {script!r}\nsys.exit({func}())"
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    status, lines = _interrupt_when([sys.executable, "-c", wrapper], "torch._C", env, tmp_path)
    said = [line for line in lines if not line.startswith("import time:")]
    assert (status, said) == (130, [f"{script}: cancelled"])
