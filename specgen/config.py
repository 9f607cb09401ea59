"""Finding and composing the Hydra config, outside of ``@hydra.main`` too."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specgen.errors import ConfigError, SpecgenError
from specgen import schema  # noqa: F401  (registers the structured-config schemas)

#: Keys whose values are free text; the CLI quotes them so Hydra's parser accepts any characters.
TEXT_KEYS = ("prompt", "system", "prompt_file", "grammar.schema", "grammar.pattern", "grammar.pattern_file",
             "grammar.whitespace")


def conf_dir() -> Path:
    """The conf/ directory: packaged as ``specgen/conf`` when installed, ``<repo>/conf`` in a checkout."""
    packaged = Path(__file__).resolve().parent / "conf"
    if (packaged / "config.yaml").is_file():
        return packaged
    checkout = Path(__file__).resolve().parent.parent / "conf"
    if (checkout / "config.yaml").is_file():
        return checkout
    raise ConfigError("specgen's conf/ directory is missing from this installation")


def quote_text_value(value: str) -> str:
    """Quote free text for Hydra's override grammar so it arrives unchanged.

    Hydra unescapes only backslashes that precede a quote (or end the string)
    and quotes themselves; OmegaConf would resolve ``${...}``, so that is escaped.
    """
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value
    out, i = [], 0
    while i < len(value):
        j = i
        while j < len(value) and value[j] == "\\":
            j += 1
        run = value[i:j]
        if run and (j == len(value) or value[j] == "'"):
            run *= 2
        out.append(run)
        if j < len(value):
            ch = value[j]
            if ch == "'":
                out.append("\\'")
            elif ch == "$" and value[j + 1 : j + 2] == "{":
                out.append("\\$")
            else:
                out.append(ch)
        i = j + 1
    return "'" + "".join(out) + "'"


def prepare_overrides(args: Sequence[str]) -> list[str]:
    """Quote the values of free-text keys (prompt=..., system=...) in CLI overrides."""
    prepared = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in TEXT_KEYS:
            prepared.append(f"{key}={quote_text_value(value)}")
        else:
            prepared.append(arg)
    return prepared


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose ``config_name`` (config, bench, train) like the commands do (same overrides, same quoting)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    prepared = prepare_overrides(list(overrides))
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=prepared)
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as exc:
        raise ConfigError(f"invalid override: {first_line(exc)}") from exc
    return cfg


def first_line(exc: BaseException) -> str:
    """The message of a Hydra/OmegaConf error on one line, without its key dump."""
    text = str(exc).strip()
    if exc.__cause__ is not None and str(exc.__cause__).strip() not in text:
        text += "\n" + str(exc.__cause__).strip()
    lines = [ln.strip() for ln in text.splitlines()]
    kept = [ln for ln in lines if ln and not ln.startswith(("full_key:", "object_type=", "reference_type="))]
    return ": ".join(kept) if kept else type(exc).__name__


def to_container(cfg) -> dict:
    """Resolve interpolations and convert to plain Python containers."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:
        raise ConfigError(f"invalid config: {first_line(exc)}") from exc


def physical_cores() -> int:
    """Physical cores available to this process (falls back to logical CPUs)."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:
        available = os.cpu_count() or 1
    try:
        siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text()
        per_core = len([s for s in siblings.replace("-", ",").split(",") if s.strip()])
        return max(1, available // max(per_core, 1))
    except OSError:
        return available


@contextmanager
def exits_on_error(command: str) -> Iterator[None]:
    """A specgen error inside becomes one ``<command>: error: ...`` line on stderr and exit status 2."""
    try:
        yield
    except SpecgenError as exc:
        sys.stderr.write(f"{command}: error: {exc}\n")
        raise SystemExit(2) from None


def run_console(hydra_main: Callable[[], None]) -> None:
    """Console entry of a Hydra command: quiet transformers' logging, quote free-text overrides, hand over."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    sys.argv = [sys.argv[0], *prepare_overrides(sys.argv[1:])]
    hydra_main()
