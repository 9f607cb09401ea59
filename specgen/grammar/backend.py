"""Grammar backends: regex + byte-exact vocabulary -> token-level automaton.

The rest of specgen sees only :class:`CompiledAutomaton`, a deterministic
automaton over token ids with integer states:

* ``initial_state``;
* ``next_state(state, token)`` -> the state after ``token`` or None when the
  grammar forbids it;
* ``allowed_ids(state)`` -> [num_allowed] int64 ids of the (non-EOS) tokens
  allowed in ``state``;
* ``is_final(state)`` -> whether the text so far is a complete match;
* ``final_states()`` -> every final state, if the backend can list them.

A backend must refuse (ConfigError) a grammar with a reachable non-final state
that allows no token, so that generation never meets a dead end except at a
complete match when the tokenizer has no EOS (checked in
:func:`specgen.grammar.compile_grammar`).

EOS never reaches a backend: :class:`~specgen.grammar.automaton.TokenAutomaton`
allows it exactly in final states. Backends are registered by name in
:data:`BACKENDS` (``grammar.backend=outlines`` is the default and the only one
built in). Compiled automata are cached on disk under
``cache_root()/grammars`` keyed by grammar, tokenizer fingerprint and backend
version, so a schema is compiled once per tokenizer.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from abc import ABC, abstractmethod

import numpy as np
import torch

from specgen.errors import ConfigError
from specgen.grammar.vocabulary import TokenBytes


class CompiledAutomaton(ABC):
    """A token-level automaton for one grammar and one vocabulary (see module docstring)."""

    initial_state: int

    @abstractmethod
    def next_state(self, state: int, token: int) -> int | None: ...

    @abstractmethod
    def allowed_ids(self, state: int) -> torch.Tensor: ...

    @abstractmethod
    def is_final(self, state: int) -> bool: ...

    def final_states(self) -> list[int] | None:
        """Every final state, or None when the backend cannot enumerate them."""
        return None


class GrammarBackend(ABC):
    """Compiles a regex (full-match semantics) for a vocabulary; raises ConfigError on bad input."""

    name = "backend"
    version = "0"

    @abstractmethod
    def compile(self, regex: str, vocab: TokenBytes) -> CompiledAutomaton: ...


def cache_dir() -> pathlib.Path:
    """Where compiled grammars are stored: ``<specgen cache root>/grammars``."""
    from specgen.models.loading import cache_root

    return cache_root() / "grammars"


def cache_key(backend: GrammarBackend, regex: str, vocab: TokenBytes) -> str:
    payload = "\0".join([backend.name, backend.version, vocab.fingerprint, regex])
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


class OutlinesAutomaton(CompiledAutomaton):
    """An ``outlines_core.Index`` of ``\\x01(?:regex)\\x00``; see :class:`OutlinesBackend`.

    The virtual start token is consumed once to reach ``initial_state``; the
    virtual end token marks completion (a state is final when it may follow).
    Neither, nor outlines' own EOS id, is ever returned as an allowed id.
    """

    def __init__(self, index, markers: tuple[int, int, int]):
        self.index = index
        start_id, self._end_id, self._outlines_eos = markers
        self._hidden = {start_id, self._end_id, self._outlines_eos}
        self.initial_state = int(index.get_next_state(index.get_initial_state(), start_id))

    def next_state(self, state: int, token: int) -> int | None:
        if token in self._hidden:
            return None
        nxt = self.index.get_next_state(state, token)
        return None if nxt is None else int(nxt)

    def allowed_ids(self, state: int) -> torch.Tensor:
        ids = self.index.get_allowed_tokens(state) or []
        array = np.fromiter(ids, dtype=np.int64, count=len(ids))
        keep = ~np.isin(array, list(self._hidden))
        return torch.from_numpy(array[keep])  # [num_allowed]

    def is_final(self, state: int) -> bool:
        return self.index.get_next_state(state, self._end_id) is not None


class OutlinesBackend(GrammarBackend):
    """outlines-core: a DFA over bytes walked by every token, computed offline.

    Two workarounds for outlines-core 0.2.14, both invisible to callers:

    * it drops a token whose bytes minus the last one complete a match while the
      whole token does not (regex-automata reports matches one byte late), so
      ``(at)*`` would refuse a second "at" and ``[0-9]+(\\.[0-9]+)?`` any decimals;
    * its DFA also allows a match to start anywhere, which makes bounded
      repetitions such as JSON ``maxLength: 20`` take minutes to compile.

    So we compile ``\\x01(?:regex)\\x00`` with virtual tokens for the two control
    bytes and leave every real token containing them out of the vocabulary: no
    real token walk can start or complete a match, nothing is dropped, the
    start marker pins the match start, and a state is final exactly when the
    virtual end token may follow it.
    """

    name = "outlines"
    recipe = "markers-v1"

    def __init__(self):
        import outlines_core

        self._oc = outlines_core
        version = getattr(outlines_core, "__version__", None) or _dist_version("outlines_core")
        self.version = f"{version}-{self.recipe}"
        self._vocabularies: dict[str, tuple] = {}

    def _vocabulary(self, vocab: TokenBytes):
        """(outlines Vocabulary, (start id, end id, outlines EOS id)) for ``vocab``; memoised."""
        if vocab.fingerprint not in self._vocabularies:
            if len(self._vocabularies) >= 4:
                self._vocabularies.clear()
            self._vocabularies[vocab.fingerprint] = self._build_vocabulary(vocab)
        return self._vocabularies[vocab.fingerprint]

    def _build_vocabulary(self, vocab: TokenBytes):
        groups = {data: ids for data, ids in vocab.grouped().items() if b"\x00" not in data and b"\x01" not in data}
        start_id, end_id = vocab.vocab_size, vocab.vocab_size + 1
        eos = next((i for i in vocab.eos_ids if not vocab.by_id[i]), vocab.vocab_size + 2)
        groups.update({b"\x01": [start_id], b"\x00": [end_id]})
        return self._oc.Vocabulary(eos, groups), (start_id, end_id, eos)

    def compile(self, regex: str, vocab: TokenBytes) -> CompiledAutomaton:
        oc_vocab, markers = self._vocabulary(vocab)
        marked = f"\\x01(?:{strip_anchors(regex)})\\x00"
        key = cache_key(self, marked, vocab)
        blob = read_cached(key)
        if blob is not None:
            try:
                return OutlinesAutomaton(self._oc.Index.from_binary(blob), markers)
            except Exception:  # a corrupt or foreign cache entry: rebuild it
                pass
        try:
            index = self._oc.Index(marked, oc_vocab)
        except ValueError as exc:
            raise self._explain(regex, marked, str(exc)) from exc
        write_cached(key, index.__reduce__()[1][0])
        return OutlinesAutomaton(index, markers)

    def _explain(self, regex: str, marked: str, message: str) -> ConfigError:
        short = regex if len(regex) <= 120 else regex[:117] + "..."
        if "incompatible" in message or "no transitions" in message:
            if not self._language_nonempty(marked):
                return ConfigError(f"the grammar matches no string at all (empty language): {short!r}")
            detail = message.split("missing tokens corresponding to", 1)[-1].strip(" .")
            return ConfigError(f"the tokenizer cannot express this grammar: no token sequence spells "
                               f"some required text ({detail}); grammar: {short!r}")
        return ConfigError(f"invalid or unsupported regex ({message.strip()}); lookaround and "
                           f"backreferences are not supported: {short!r}")

    def _language_nonempty(self, marked: str) -> bool:
        """True if some string matches: every string is spelt by single bytes."""
        singles = {bytes([b]): [b] for b in range(256)}
        try:
            self._oc.Index(marked, self._oc.Vocabulary(256, singles))
        except ValueError:
            return False
        return True


def strip_anchors(regex: str) -> str:
    """Drop a leading ``^`` and a trailing unescaped ``$``: matches are always whole-output."""
    regex = regex.removeprefix("^")
    if regex.endswith("$"):
        body = regex[:-1]
        backslashes = len(body) - len(body.rstrip("\\"))
        if backslashes % 2 == 0:
            regex = body
    return regex


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


BACKENDS = {"outlines": OutlinesBackend}
_instances: dict[str, GrammarBackend] = {}


def get_backend(name: str) -> GrammarBackend:
    """The backend registered as ``name`` (instantiated once)."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown grammar.backend {name!r}; available: {', '.join(sorted(BACKENDS))}")
    if name not in _instances:
        try:
            _instances[name] = BACKENDS[name]()
        except ImportError as exc:
            raise ConfigError(f"grammar.backend={name} needs a package that is not installed: {exc}") from exc
    return _instances[name]
