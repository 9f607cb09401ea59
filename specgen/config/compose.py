"""Finding and composing the Hydra config, outside of ``@hydra.main`` too."""

from __future__ import annotations

import copy
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specgen.errors import ConfigError, OutputError, SpecgenError
from specgen.config import schema  # noqa: F401  (registers the structured-config schemas)

#: Keys whose values are free text; the CLI quotes them so Hydra's parser accepts any characters.
TEXT_KEYS = ("prompt", "system", "prompt_file", "output", "grammar.schema", "grammar.pattern",
             "grammar.pattern_file", "grammar.whitespace")

#: Entries a model source (``target.source``, ``drafter.source``) may carry; see specgen.models.loading.
SOURCE_KEYS = ("kind", "tokenizer", "trust_remote_code", "revision", "cache_dtype", "pip", "version", "sha256",
               "filename", "packages", "package_prefix", "num_parts", "repo", "path", "package", "file")
_ABSENT = object()
#: Composed configs kept per process, by overrides, config name and the conf files' state
#: (:func:`_conf_state`): composing reads and merges a dozen YAML files, a pipeline built again
#: with the same overrides takes a copy. The oldest goes beyond this many.
COMPOSED_KEPT = 64
_composed: OrderedDict[tuple, DictConfig] = OrderedDict()
_composed_lock = threading.Lock()


def conf_dir() -> Path:
    """The conf/ directory: packaged as ``specgen/conf`` when installed, ``<repo>/conf`` in a checkout."""
    package = Path(__file__).resolve().parent.parent  # specgen/
    packaged = package / "conf"
    if (packaged / "config.yaml").is_file():
        return packaged
    checkout = package.parent / "conf"
    if (checkout / "config.yaml").is_file():
        return checkout
    raise ConfigError("specgen's conf/ directory is missing from this installation")


def quote_text_value(value: str) -> str:
    """Quote free text for Hydra's override grammar so it arrives unchanged.

    The value is always quoted, even when it already starts and ends with a
    quote: ``prompt='"To be"'`` keeps its quotes and ``prompt='Hi' and 'bye'``
    parses. Hydra unescapes only backslashes that precede a quote (or end the
    string) and quotes themselves; OmegaConf would resolve ``${...}``, so that
    is escaped. Apply it once per override (it is not idempotent).
    """
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
    """Quote the values of free-text keys (prompt=..., system=...) in CLI overrides, and values that
    start with ``~`` (a home-relative path: Hydra's grammar has no unquoted value of that form)."""
    prepared = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and (key.lstrip("+~") in TEXT_KEYS or value.startswith("~")):
            prepared.append(f"{key}={quote_text_value(value)}")
        else:
            prepared.append(arg)
    return prepared


def refuse_owned(overrides: Sequence[str], owned: Mapping[str, str]) -> None:
    """ConfigError for the first of ``overrides`` whose key (``+``/``~`` aside) is in ``owned``: a key the
    caller sets on every request itself, so the override would be ignored. ``owned``: key -> what to
    use instead (e.g. ``{"max_new_tokens": "use --max-new-tokens"}``)."""
    for override in overrides:
        key = str(override).partition("=")[0].lstrip("+~")
        if key in owned:
            raise ConfigError(f"--override {override}: this script sets {key} itself; {owned[key]}")


def compose(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose ``config_name`` (config, bench, train) like the commands do (same overrides, same quoting).

    Raises :class:`ConfigError` with one readable line for a bad override,
    including a key that specgen's config does not have, even when added with
    ``+`` (``+sampling.temprature=0.5``).
    """
    return compose_prepared(prepare_overrides(list(overrides)), config_name)


def compose_prepared(prepared: Sequence[str], config_name: str = "config") -> DictConfig:
    """:func:`compose` for overrides already quoted by :func:`prepare_overrides`."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = _hydra_compose(list(prepared), config_name)
        added = _added_value_keys(prepared)
        if added:
            _check_added_keys(added, _hydra_compose(_without(prepared, added), config_name))
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as exc:
        raise ConfigError(describe_override_error(exc)) from exc
    return cfg


def _hydra_compose(prepared: list[str], config_name: str) -> DictConfig:
    """Hydra's compose of ``prepared`` on :func:`conf_dir`; a copy of the kept result where the same
    overrides were composed on the same conf files before (not for ``hydra.*`` overrides, which may
    point Hydra at files outside conf/)."""
    if any(p.lstrip("+~").startswith("hydra") for p in prepared):
        return _hydra_compose_fresh(prepared, config_name)
    key = (tuple(prepared), config_name, _conf_state())
    with _composed_lock:
        kept = _composed.get(key)
        if kept is not None:
            _composed.move_to_end(key)
    if kept is None:
        kept = _hydra_compose_fresh(prepared, config_name)
        with _composed_lock:
            _composed[key] = kept
            while len(_composed) > COMPOSED_KEPT:
                _composed.popitem(last=False)
    return copy.deepcopy(kept)


def _conf_state() -> tuple:
    """The conf files' paths, sizes and modification times: a kept compose is reused only while they hold."""
    root = conf_dir()
    return tuple(sorted((str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns)
                        for f in root.rglob("*.yaml")))


def _hydra_compose_fresh(prepared: list[str], config_name: str) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=prepared)


def _added_value_keys(prepared: Sequence[str]) -> dict[str, str]:
    """``{key: override}`` for every ``+key=`` / ``++key=`` that adds a value (not a config group)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    added = {}
    for override in OverridesParser.create().parse_overrides(list(prepared)):
        key = override.key_or_group
        if not (override.is_add() or override.is_force_add()) or key.split(".")[0].startswith("hydra"):
            continue
        if "/" in key or (conf_dir() / key.replace(".", "/")).is_dir():
            continue
        added[key] = override.input_line
    return added


def _without(prepared: Sequence[str], added: dict[str, str]) -> list[str]:
    dropped = set(added.values())
    return [line for line in prepared if line not in dropped]


def _check_added_keys(added: dict[str, str], baseline: DictConfig) -> None:
    """ConfigError for an added key that specgen's config (composed without the additions) lacks."""
    import difflib

    for key, line in added.items():
        if _optional_source_key(key) or OmegaConf.select(baseline, key, default=_ABSENT) is not _ABSENT:
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(baseline, parent) if parent else baseline
        siblings = list(node.keys()) if isinstance(node, DictConfig) else []
        close = difflib.get_close_matches(leaf, [str(k) for k in siblings], n=1)
        hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
        raise ConfigError(f"unknown key '{key}' in {line}: specgen's config has no such setting{hint}")


def _optional_source_key(key: str) -> bool:
    """Whether ``key`` is a model-source entry a source may carry although its config file does not list it."""
    parts = key.split(".")
    return len(parts) >= 3 and parts[0] in ("target", "drafter") and parts[1] == "source" and parts[2] in SOURCE_KEYS


def describe_override_error(exc: BaseException) -> str:
    """A Hydra/OmegaConf composition error as one readable line naming the override or key."""
    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(exc).strip()
    cause = exc.__cause__
    if isinstance(exc, MissingConfigException) and "Could not find '" in text:
        wanted = text.split("Could not find '", 1)[1].split("'", 1)[0]
        group, _, option = wanted.rpartition("/")
        options = [opt.strip() for opt in text.split("Available options in", 1)[-1].splitlines()[1:]
                   if opt.startswith("\t") and "=" not in opt and opt.strip() != "schema"]
        listed = f"; choose from {', '.join(options)}" if options else ""
        return f"invalid override {group}={option}: there is no config {wanted}{listed}"
    if isinstance(exc, OverrideParseException) or text.startswith("Error parsing override"):
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("See https://")]
        if "missing EQUAL" in text and lines[0].startswith("Error parsing override '"):
            word = lines[0][len("Error parsing override '"):-1]
            return f"'{word}' is not an override: write key=value, e.g. prompt=\"{word}\""
        return "invalid override: " + ": ".join(ln.strip() for ln in lines)
    full_key = getattr(cause, "full_key", None)
    if full_key and "not in" in str(cause) and text.startswith("Could not override"):
        return f"unknown key '{full_key}': specgen's config has no such setting"
    if full_key and text.startswith("Error merging override "):
        override = text[len("Error merging override "):].splitlines()[0]
        return f"invalid value in {override}: {first_line(cause)}"
    return f"invalid override: {first_line(exc)}"


def first_line(exc: BaseException) -> str:
    """The message of a Hydra/OmegaConf error on one line, without its key dump or help links."""
    text = str(exc).strip()
    if exc.__cause__ is not None and str(exc.__cause__).strip() not in text:
        text += "\n" + str(exc.__cause__).strip()
    lines = [ln.strip() for ln in text.splitlines()]
    dropped = ("full_key:", "object_type=", "reference_type=", "See https://", "Set the environment variable")
    kept = [ln for ln in lines if ln and not ln.startswith(dropped)]
    return ": ".join(kept) if kept else type(exc).__name__


def to_container(cfg) -> dict:
    """Resolve interpolations and convert to plain Python containers."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception as exc:
        raise ConfigError(f"invalid config: {first_line(exc)}") from exc


@contextmanager
def exits_on_error(command: str) -> Iterator[None]:
    """A specgen error inside becomes one ``<command>: error: ...`` line on stderr and exit status 2;
    an :class:`~specgen.errors.OutputError` (an output that could not be written) status 74 with its
    line; stdout's reader gone (EPIPE) a quiet exit with status 141 (:mod:`specgen.outputs`)."""
    from specgen.outputs import OUTPUT_FAILED, STDOUT_CLOSED, StdoutClosed

    try:
        yield
    except StdoutClosed:
        raise SystemExit(STDOUT_CLOSED) from None
    except OutputError as exc:
        sys.stderr.write(f"{command}: error: {exc}\n")
        raise SystemExit(OUTPUT_FAILED) from None
    except SpecgenError as exc:
        sys.stderr.write(f"{command}: error: {exc}\n")
        raise SystemExit(2) from None


def check_command_line(args: Sequence[str], config_name: str) -> None:
    """Compose every job a console command line describes; ConfigError (one line) if one cannot be.

    Runs before Hydra sees the arguments, so a bad override is reported like
    every other user error instead of as Hydra's multi-line text. A multirun
    (``-m seed=1,2``) is expanded into its jobs and each is composed and its
    values checked (:func:`specgen.config.checks.check_run_config`). Command lines
    that do not run a job (``--help``, ``--info``, an unparsable flag, another
    config directory) are left to Hydra; a malformed flag is a ConfigError too.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from specgen.config.checks import check_run_config

    parser = get_args_parser()
    parser.error = lambda message: _argument_error(message, args)
    ns = parser.parse_args(list(args))
    if ns.help or ns.hydra_help or ns.info or ns.shell_completion or ns.experimental_rerun or ns.config_path \
            or ns.config_dir:
        return
    prepared = prepare_overrides(ns.overrides)
    jobs = [prepared]
    if ns.multirun:
        try:
            batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(prepared), None)
        except HydraException as exc:
            raise ConfigError(describe_override_error(exc)) from exc
        jobs = [job for batch in batches for job in batch]
    for job in jobs:
        cfg = compose_prepared(job, ns.config_name or config_name)
        if ns.cfg is None:
            check_run_config(to_container(cfg))


def _argument_error(message: str, args: Sequence[str] = ()) -> None:
    """argparse's error hook: one ConfigError line instead of the usage text and exit status 2.

    An unrecognized ``--name value`` (or ``--name=value``) is answered with the override to write
    instead, ``name=value`` (dashes in the name read as underscores)."""
    hint = ""
    if message.startswith("unrecognized arguments:"):
        flags = [arg for arg in message.split(":", 1)[1].split() if arg.startswith("--")]
        hint = " (give the overrides after the flags, e.g. --cfg job prompt=hi)"
        if flags:
            name, _, value = flags[0].lstrip("-").partition("=")
            if not value:
                after = list(args)[list(args).index(flags[0]) + 1:] if flags[0] in args else []
                value = after[0] if after and not after[0].startswith("-") and "=" not in after[0] else "..."
            hint = f" (overrides are key=value without dashes: write {name.replace('-', '_')}={value})"
    raise ConfigError(f"{message}{hint}; see --help")


def run_console(hydra_main: Callable[[], None], command: str, config_name: str) -> None:
    """Console entry of a Hydra command: check the command line, quote free-text overrides, hand over.

    A bad override exits with status 2 and one ``<command>: error: ...`` line;
    Ctrl-C anywhere (loading, converting, running) exits with status 130 and
    one ``<command>: cancelled`` line.
    """
    from transformers.utils import logging as hf_logging

    from specgen.outputs import tolerate_stderr

    tolerate_stderr()
    hf_logging.set_verbosity_error()
    args = sys.argv[1:]
    try:
        with exits_on_error(command):
            check_command_line(args, config_name)
        sys.argv = [sys.argv[0], *prepare_overrides(args)]
        hydra_main()
    except KeyboardInterrupt:
        sys.stderr.write(f"{command}: cancelled\n")
        raise SystemExit(130) from None
