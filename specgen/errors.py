"""Errors that specgen raises for bad input.

Every error a user can cause derives from :class:`SpecgenError`; the CLI prints
its message on one line and exits with status 2 instead of dumping a traceback.
"""


def first_line(exc: BaseException, default: str | None = None) -> str:
    """The first line of an exception's message (``default`` or the type name if empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else (default or type(exc).__name__)


def shorten(text: object, limit: int = 60) -> str:
    """``text`` (str() of it) on one line, whitespace runs as one space, cut to ``limit`` characters with "..."."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def not_utf8(what: str, exc: UnicodeDecodeError, offset: int = 0) -> str:
    """``'<what> is not UTF-8 text (byte 0xe9 at offset 3)'``: where decoding bytes that start at byte
    ``offset`` of ``what`` failed with ``exc``."""
    return f"{what} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {offset + exc.start})"


class SpecgenError(Exception):
    """Base class for user-facing errors with a clear, specific message."""


class ConfigError(SpecgenError):
    """An override or config value is invalid."""


class ModelLoadError(SpecgenError):
    """Weights are missing, corrupt, or cannot be converted."""


class PromptError(SpecgenError):
    """The prompt cannot be generated from (too long, empty, ...)."""


class NumericalError(SpecgenError):
    """A model produced NaN/Inf logits or a distribution with no mass."""


class DeadEndError(SpecgenError):
    """No token is allowed at a committed position (e.g. a grammar with no way on).

    Raised only where the history holds no draft candidate; at a draft position
    the grammar empties the row and the verifier decides (a "dead_end" verdict,
    see :mod:`specgen.sampling.rejection`).

    The engine ends the generation with ``finish_reason="dead_end"`` instead of
    sampling a garbage token.
    """


class CacheExhausted(SpecgenError):
    """A model cannot open another KV handle now (every one it may hold is live); releasing one makes room."""


class OutputError(SpecgenError):
    """An output could not be written (a full disk, a closed stdout); the message names the file and
    what was kept. The commands exit with status 74 (sysexits' EX_IOERR), not 2: the input was fine."""
