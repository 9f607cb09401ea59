"""The console scripts of ``[project.scripts]``: each imports its command's module and runs its ``main``.

This module and ``specgen/__init__`` import nothing heavy, so the import of the
command (torch, transformers, Hydra: seconds) runs inside the guard: Ctrl-C at
any point, also while those load, exits with status 130 and one
``<command>: cancelled`` line on stderr, never a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import importlib
import sys

#: Console script -> the module whose ``main()`` it runs.
COMMANDS = {
    "specgen": "specgen.cli.main",
    "specgen-bench": "specgen.bench.cli",
    "specgen-chat": "specgen.tui.app",
    "specgen-train": "specgen.train.cli",
    "specgen-serve": "specgen.serve.cli",
}


def run(command: str, module: str | None = None) -> int | None:
    """Import ``module`` (default: ``command``'s in :data:`COMMANDS`) and return its ``main()``; Ctrl-C -> 130."""
    try:
        main = importlib.import_module(module or COMMANDS[command]).main
        return main()
    except KeyboardInterrupt:
        try:
            sys.stderr.write(f"{command}: cancelled\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed or gone: the status still says it
            pass
        return 130


def specgen() -> int | None:
    return run("specgen")


def specgen_bench() -> int | None:
    return run("specgen-bench")


def specgen_chat() -> int | None:
    return run("specgen-chat")


def specgen_train() -> int | None:
    return run("specgen-train")


def specgen_serve() -> int | None:
    return run("specgen-serve")
