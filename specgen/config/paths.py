"""Checks of output paths before anything is written: each failure is one
:class:`ConfigError` line naming the config key. A probe file shows that a
directory takes new files; it is removed at once, so nothing is left behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from specgen.errors import ConfigError


def check_output_file(path: Path, name: str, *, create_parents: bool = False, example: str = "out.jsonl") -> None:
    """ConfigError (one line naming ``name``) unless ``path`` can be written as a regular file.

    Refused: a directory or another non-regular file (a device, a FIFO), an existing file that
    cannot be opened for writing, a directory that does not exist (unless ``create_parents``: then
    its nearest existing ancestor must let a directory be made in it), and a directory in which no
    file can be created (read-only or pseudo file systems such as /proc and /sys, where even root
    cannot write). Checked before any work by creating and removing a probe file, so nothing is left
    behind and an existing file's content is untouched. ``example``: the file name a hint suggests.
    """
    if path.is_dir():
        raise ConfigError(f"{name}={path} is a directory; give a file path such as {path / example}")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{name}={path} is not a regular file; give the path of a file to write")
    parent = path.absolute().parent
    if not create_parents and not parent.is_dir():
        what = "is a file, not a directory" if parent.exists() else "does not exist; create it first"
        raise ConfigError(f"{name}={path} cannot be created: {parent} {what}")
    _check_creatable(parent, name, path)
    if path.exists():
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise ConfigError(f"{name}={path} cannot be written: {exc.strerror or exc}") from None


def check_output_dir(path: Path, name: str) -> None:
    """ConfigError unless ``path`` is, or can be created as, a writable directory (nothing is created)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name}={path} is a file, not a directory; give a directory for the results")
    _check_creatable(path, name, path)


def _check_creatable(directory: Path, name: str, value: Path) -> None:
    """The nearest existing ancestor of ``directory`` must be a directory a file can be created in
    (probed with a temporary file, removed at once)."""
    existing = directory.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{name}={value} cannot be created: {existing} is a file, not a directory")
    try:
        handle, probe = tempfile.mkstemp(prefix=".specgen-probe-", dir=existing)
    except OSError as exc:
        raise ConfigError(f"{name}={value} cannot be written: no file can be created in {existing} "
                          f"({exc.strerror or exc})") from None
    os.close(handle)
    os.unlink(probe)
