"""Grammar backends: a :class:`GrammarSpec` + byte-exact vocabulary -> token automaton.

The rest of specgen sees only :class:`CompiledAutomaton`, a deterministic
automaton over token ids whose states are hashable values:

* ``initial_state``;
* ``next_state(state, token)`` -> the state after ``token`` or None when the
  grammar forbids it;
* ``allowed_mask(state, vocab_size)`` -> [vocab_size] bool, the (non-EOS) tokens
  allowed in ``state`` (``allowed_ids`` lists them);
* ``is_final(state)`` -> whether the text so far is a complete match;
* ``final_states()`` -> every final state, if the backend can list them.

A state must be a function of the token path that reached it (equal paths give
equal states, or states with equal answers), which is what keeps the grammar a
pure processor. EOS never reaches a backend:
:class:`~specgen.grammar.automaton.TokenAutomaton` allows it exactly in final states.

A backend refuses what it cannot enforce with :class:`Unsupported` (another
backend may take it; ``auto`` tries the next) and bad input with ConfigError.
Compiling is bounded by ``spec.compile_timeout_s`` (and a size budget), and a
line on stderr reports progress when it takes more than a few seconds.

Backends are registered by name in :mod:`specgen.grammar.registry`, which
imports the implementations; they import this module, never the registry.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Hashable
from contextlib import contextmanager

import torch

from specgen.grammar.spec import GrammarSpec
from specgen.grammar.vocabulary import TokenBytes

#: Seconds of compiling before the first progress line on stderr.
PROGRESS_AFTER_S = 3.0


class CompiledAutomaton(ABC):
    """A token-level automaton for one grammar and one vocabulary (see module docstring)."""

    initial_state: Hashable

    @abstractmethod
    def next_state(self, state, token: int): ...

    @abstractmethod
    def allowed_ids(self, state) -> torch.Tensor:
        """[num_allowed] int64 ids of the non-EOS tokens allowed in ``state``."""

    @abstractmethod
    def is_final(self, state) -> bool: ...

    def allowed_mask(self, state, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool, True for the non-EOS tokens allowed in ``state``."""
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        ids = self.allowed_ids(state)
        mask[ids[ids < vocab_size]] = True
        return mask

    def forced_bytes(self, state, limit: int) -> bytes | None:
        """The bytes every continuation of ``state`` starts with, or None to let the caller derive them."""
        return None

    def final_states(self) -> list | None:
        """Every final state, or None when the backend cannot enumerate them."""
        return None


class GrammarBackend(ABC):
    """Compiles a :class:`GrammarSpec` for a vocabulary; see the module docstring."""

    name = "backend"
    version = "0"

    def check(self, spec: GrammarSpec) -> None:
        """Raise :class:`Unsupported` (or ConfigError) before compiling, if this backend cannot take ``spec``."""

    @abstractmethod
    def compile(self, spec: GrammarSpec, vocab: TokenBytes) -> CompiledAutomaton: ...


@contextmanager
def compile_progress(description: str, after_s: float | None = None):
    """Report on stderr every few seconds while the body runs longer than ``after_s`` (default PROGRESS_AFTER_S)."""
    after_s = PROGRESS_AFTER_S if after_s is None else after_s
    done = threading.Event()
    start = time.monotonic()

    def report() -> None:
        wait = after_s
        while not done.wait(wait):
            sys.stderr.write(f"specgen: compiling grammar {description} ({time.monotonic() - start:.0f} s so far)\n")
            sys.stderr.flush()
            wait = 10.0

    thread = threading.Thread(target=report, name="grammar-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def cache_dir() -> pathlib.Path:
    """Where compiled grammars are stored: ``<specgen cache root>/grammars``."""
    from specgen.models.loading import cache_root

    return cache_root() / "grammars"


def cache_key(backend: GrammarBackend, text: str, vocab: TokenBytes) -> str:
    payload = "\0".join([backend.name, backend.version, vocab.fingerprint, text])
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]


def read_cached(key: str) -> bytes | None:
    path = cache_dir() / f"{key}.bin"
    try:
        return path.read_bytes()
    except OSError:
        return None


def write_cached(key: str, blob: bytes) -> None:
    """Write atomically (temporary file + rename); a failed write only loses the cache."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(blob)
        os.replace(tmp, directory / f"{key}.bin")
    except OSError:
        pass


def strip_anchors(regex: str) -> str:
    """Drop a leading ``^`` and a trailing unescaped ``$``: matches are always whole-output."""
    regex = regex.removeprefix("^")
    if regex.endswith("$"):
        body = regex[:-1]
        backslashes = len(body) - len(body.rstrip("\\"))
        if backslashes % 2 == 0:
            regex = body
    return regex


def dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
