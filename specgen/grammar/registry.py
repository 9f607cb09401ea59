"""The grammar backends by name: :data:`BACKENDS`, ``auto``'s :data:`AUTO_ORDER` and one
instance of each backend, made on first use.

``auto`` tries the backends fastest first (docs/grammar.md compares them). The
implementations import :mod:`specgen.grammar.backend`, never this module.
"""

from __future__ import annotations

import threading

from specgen.errors import ConfigError
from specgen.grammar.backend import GrammarBackend
from specgen.grammar.schema_check import Unsupported


def _outlines():
    from specgen.grammar.outlines_backend import OutlinesBackend

    return OutlinesBackend()


def _llguidance():
    from specgen.grammar.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend()


BACKENDS = {"llguidance": _llguidance, "outlines_core": _outlines}
#: ``outlines`` was the only backend's name before there were several.
ALIASES = {"outlines": "outlines_core"}
#: What ``auto`` tries, in order: the first backend that takes the spec compiles it.
AUTO_ORDER = ("llguidance", "outlines_core")
_instances: dict[str, GrammarBackend] = {}
_instances_lock = threading.Lock()


def get_backend(name: str) -> GrammarBackend:
    """The backend registered as ``name`` (instantiated once); ConfigError if unknown or not installed."""
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ConfigError(f"unknown grammar.backend {name!r}; available: auto, {', '.join(sorted(BACKENDS))}")
    with _instances_lock:
        if name not in _instances:
            try:
                _instances[name] = BACKENDS[name]()
            except ImportError as exc:
                raise Unsupported(f"grammar.backend={name} needs a package that is not installed: {exc}") from exc
        return _instances[name]


def candidates(name: str) -> list[str]:
    """The backend names to try for ``grammar.backend=name`` (several for ``auto``)."""
    return list(AUTO_ORDER) if name == "auto" else [ALIASES.get(name, name)]
