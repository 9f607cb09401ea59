"""Checks of a composed run config's values, before anything is loaded.

Hydra's schemas catch wrong types for typed keys (``sampling.temperature=hot``);
these checks catch what types cannot: spellings (``speculative=no``), ranges
(``seed=99999999999999999999999``, ``sampling.temperature=inf``), text where a
number belongs in untyped keys (``max_new_tokens=abc``, ``threads=abc``) and
model sources that still hold Hydra's ``???`` placeholder (``target=gguf``
without a path). Every failure is a :class:`ConfigError` whose message names the
key, so the commands can print it as their one error line.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from specgen import machine
from specgen.errors import ConfigError
from specgen.sampling.logprobs import MAX_TOP_LOGPROBS
from specgen.config.options import (check_temperature, check_unicode, parse_batch_size, parse_bool, parse_chat, parse_int,
                             parse_num_tokens, parse_optional_text, parse_seed, parse_stop)
from specgen.config.paths import check_output_file

#: Hydra's marker for a value that must be given on the command line.
MISSING = "???"


class NumberRange(NamedTuple):
    """The finite numbers a setting takes (:func:`check_number`)."""

    low: float | None  # None = no lower bound
    low_allowed: bool  # whether ``low`` itself is allowed
    high: float | None  # inclusive; None = no upper bound
    wording: str  # the range as the error message states it


_SAMPLING_RANGES = {
    "temperature": NumberRange(0.0, True, None, ">= 0 (0 = greedy)"),
    "top_p": NumberRange(0.0, False, 1.0, "in (0, 1] (1 = off)"),
    "min_p": NumberRange(0.0, True, 1.0, "in [0, 1] (0 = off)"),
    "repetition_penalty": NumberRange(0.0, False, None, "> 0 (1 = off)"),
    "presence_penalty": NumberRange(None, True, None, "a finite number (0 = off)"),
    "frequency_penalty": NumberRange(None, True, None, "a finite number (0 = off)"),
}


def check_run_config(cfg: Mapping) -> dict:
    """A copy of the resolved config ``cfg`` with its run values checked and normalised.

    Every run key is read as given (:func:`required`: its default is written once, in conf/config.yaml).
    Normalised: ``speculative``, ``compile``, ``packed_weights``, ``invariant_verify``, ``observe_costs``
    (bools), ``chat`` ("auto" or bool), ``max_new_tokens``,
    ``seed`` (ints), ``stop`` (list of non-empty strings), ``threads`` ("auto" or a
    positive int), the ``sampling`` numbers and ``ui`` switches, and where the config
    has them ``output`` (None or a path) and ``resume`` (bool), whose files are checked
    by :func:`check_jsonl_paths`, and ``batch_size`` (a positive int, checked against the
    drafter and ``compile`` by :func:`check_batch_size`). The grammar and
    ``drafter.num_tokens`` are checked by :func:`check_components`, the ``llama_cpp`` section by
    :func:`check_llama_cpp`, the ``prefix_cache`` counts as ints >= 0 and its ``anticipate`` as a
    bool. Raises :class:`ConfigError` naming the first bad key.
    :meth:`specgen.config.run.RunConfig.from_cfg` calls this once per run.
    """
    cfg = dict(cfg)
    for key in ("speculative", "compile", "packed_weights", "invariant_verify", "observe_costs"):
        cfg[key] = parse_bool(required(cfg, key), key)
    cfg["chat"] = parse_chat(required(cfg, "chat"))
    cfg["max_new_tokens"] = parse_int(required(cfg, "max_new_tokens"), "max_new_tokens", minimum=1)
    cfg["seed"] = parse_seed(required(cfg, "seed"))
    if required(cfg, "logprobs") is not None:
        cfg["logprobs"] = parse_int(cfg["logprobs"], "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    cfg["stop"] = list(parse_stop(required(cfg, "stop")))
    cfg["threads"] = parse_threads(required(cfg, "threads"))
    for key in ("prompt", "prompt_file", "system"):
        cfg[key] = parse_optional_text(required(cfg, key), key)
    check_unicode(cfg["system"], "system", ConfigError)  # text for the tokenizer (a path may hold any bytes)
    if "sampling" in cfg:
        cfg["sampling"] = check_sampling(cfg["sampling"])
    if "ui" in cfg:
        cfg["ui"] = _check_ui(cfg["ui"] or {})
    for group in ("target", "drafter"):
        source = (cfg.get(group) or {}).get("source")
        if isinstance(source, str) and source != "???":
            cfg[group]["source"] = source = source_from_text(source, f"{group}.source")
        if isinstance(source, Mapping):
            check_source(source, f"{group}.source")
    if not isinstance((cfg.get("target") or {}).get("source"), Mapping):
        raise ConfigError("target.source must be a model source with a 'kind' key; choose a target with target=NAME")
    if "output" in cfg or "resume" in cfg:
        cfg["output"] = parse_optional_text(required(cfg, "output"), "output")
        cfg["resume"] = parse_bool(required(cfg, "resume"), "resume")
        check_jsonl_paths(cfg)
    if "batch_size" in cfg:
        cfg["batch_size"] = check_batch_size(cfg)
    check_components(cfg)
    cfg["llama_cpp"] = check_llama_cpp(required(cfg, "llama_cpp") or {})
    section = required(cfg, "prefix_cache") or {}
    cfg["prefix_cache"] = {key: parse_int(required(section, key, "prefix_cache."), f"prefix_cache.{key}", minimum=0)
                           for key in ("entries", "bytes")}
    cfg["prefix_cache"]["anticipate"] = parse_bool(required(section, "anticipate", "prefix_cache."),
                                                   "prefix_cache.anticipate")
    return cfg


def required(cfg: Mapping, key: str, where: str = ""):
    """``cfg[key]``, or ConfigError naming ``where + key`` when the config lacks it: every run key's
    default is written once, in conf/config.yaml, so a composed config holds each one."""
    if key not in cfg:
        raise ConfigError(f"{where}{key} is missing from the config; compose it from conf/config.yaml, which sets it")
    return cfg[key]


def check_components(cfg: Mapping) -> None:
    """ConfigError for a grammar or drafter setting that no model could run: ``grammar=json_schema``
    without a schema, ``grammar=regex`` without a pattern (or any grammar spec the grammar module
    refuses), a ``drafter.num_tokens`` that is neither auto nor 1..MAX_NUM_TOKENS."""
    if isinstance(cfg.get("grammar"), Mapping):
        from specgen.grammar.spec import parse_spec

        parse_spec(cfg["grammar"])
    drafter = cfg.get("drafter")
    if isinstance(drafter, Mapping) and drafter.get("kind", "none") != "none" and "num_tokens" in drafter:
        parse_num_tokens(drafter["num_tokens"], "drafter.num_tokens")


#: KV handles a run holds at once on a llama.cpp model (a context each): a request's, the cost
#: measurement's and the batch-invariance probe's.
LLAMA_MIN_SEQUENCES = 3
#: The fewest tokens a llama.cpp context (``llama_cpp.context``) or a batched row holds.
LLAMA_MIN_ROW_CONTEXT = 256
#: The most KV handles (contexts) a model may hold at once: llama.cpp's own limit on sequences per context.
LLAMA_MAX_SEQUENCES = 256
#: llama_cpp.prefill_split's bounds (tokens per decode): below, prompts would be split too fine for
#: llama.cpp's wide kernels; above, a batch step's prefill chunk would hold its other rows up for long.
LLAMA_MIN_PREFILL_SPLIT, LLAMA_MAX_PREFILL_SPLIT = 8, 512


def check_llama_cpp(section: Mapping) -> dict:
    """The ``llama_cpp`` group checked: ``sequences`` an int in [LLAMA_MIN_SEQUENCES,
    LLAMA_MAX_SEQUENCES], ``context`` auto, null or at least LLAMA_MIN_ROW_CONTEXT tokens, and the
    choices the llama.cpp backend takes (its FLASH_MODES and REPACK, gguf_write's QUANT_TYPES)."""
    from specgen.models.gguf_write import QUANT_TYPES
    from specgen.models.llama_cpp import FLASH_MODES, REPACK

    section = dict(section)
    for key in ("sequences", "context", "batch_row_context", "flash_attention", "tiny_type", "repack",
                "prefill_split"):
        required(section, key, "llama_cpp.")
    _llama_integer(section, "prefill_split", f"auto or an integer from {LLAMA_MIN_PREFILL_SPLIT} to "
                   f"{LLAMA_MAX_PREFILL_SPLIT} (tokens per decode)", LLAMA_MIN_PREFILL_SPLIT, LLAMA_MAX_PREFILL_SPLIT,
                   keep=("auto",))
    _llama_integer(section, "context", f"auto, null (the model's training context) or an integer of at least "
                   f"{LLAMA_MIN_ROW_CONTEXT} (tokens)", LLAMA_MIN_ROW_CONTEXT, keep=(None, "auto"))
    _llama_integer(section, "sequences", f"an integer from {LLAMA_MIN_SEQUENCES} (a run holds that many KV handles "
                   f"at once) to {LLAMA_MAX_SEQUENCES} (llama.cpp's limit)", LLAMA_MIN_SEQUENCES, LLAMA_MAX_SEQUENCES)
    _llama_integer(section, "batch_row_context", f"an integer of at least {LLAMA_MIN_ROW_CONTEXT} (tokens)",
                   LLAMA_MIN_ROW_CONTEXT)
    for key, choices in (("flash_attention", FLASH_MODES), ("tiny_type", QUANT_TYPES), ("repack", REPACK)):
        value = str(section[key])
        if value not in choices:
            raise ConfigError(f"llama_cpp.{key}={value!r} is not one of {', '.join(choices)}")
        section[key] = value
    return section


def _llama_integer(section: dict, key: str, allowed: str, minimum: int, maximum: int | None = None,
                   keep: tuple = ()) -> None:
    """``section[key]`` as an int in [minimum, maximum] unless it is one of ``keep``; else ConfigError
    "llama_cpp.<key> must be <allowed>, got <value>"."""
    if section[key] in keep:
        return
    try:
        section[key] = parse_int(section[key], f"llama_cpp.{key}", minimum=minimum, maximum=maximum)
    except ConfigError:
        raise ConfigError(f"llama_cpp.{key} must be {allowed}, got {section[key]!r}") from None


def check_batch_size(cfg: Mapping) -> int:
    """``batch_size`` as a positive int; ConfigError when it is above 1 with a setting the batched
    engine refuses (:func:`specgen.drafters.batch_refusal`: a built-in drafter that is not batchable
    while ``speculative`` is on, or ``compile=true``)."""
    size = parse_batch_size(cfg.get("batch_size"))
    if size > 1:
        from specgen.drafters import batch_refusal, drafter_class

        kind = (cfg.get("drafter") or {}).get("kind")
        drafter = drafter_class(kind) if required(cfg, "speculative") else None
        why = batch_refusal(drafter)
        if why:
            raise ConfigError(f"batch_size={size}: {why}; drafter={kind} needs batch_size=1 (or speculative=false)")
        why = batch_refusal(None, compiled=required(cfg, "compile"))
        if why:
            raise ConfigError(f"batch_size={size}: {why}; use compile=false or batch_size=1")
    return size


#: Suffixes ``prompt_file`` may have when ``output=`` asks for one result per JSONL row.
JSONL_SUFFIXES = (".jsonl", ".ndjson")


def check_jsonl_paths(cfg: Mapping) -> None:
    """ConfigError unless ``output=`` (JSONL mode) has a readable JSONL ``prompt_file`` and a writable
    output that holds no earlier results, or ``resume`` is on. Reads nothing but file metadata."""
    output, resume = cfg["output"], cfg["resume"]
    if output is None:
        if resume:
            raise ConfigError("resume=true continues an output file; add output=PATH.jsonl")
        return
    if not output:
        raise ConfigError("output is empty; give the path of a .jsonl file for the results")
    if cfg["prompt"] is not None:
        raise ConfigError("output= writes one result per row of prompt_file=PATH.jsonl; give that instead of prompt=")
    prompt_file = cfg["prompt_file"]
    if not prompt_file or prompt_file == "-":
        raise ConfigError("output= needs prompt_file=PATH.jsonl, a file with one JSON prompt per line")
    source, target = Path(prompt_file), Path(output)
    if source.suffix.lower() not in JSONL_SUFFIXES:
        raise ConfigError(f"prompt_file {prompt_file} must be a .jsonl file (one JSON prompt per line) "
                          "when output= is given")
    if not source.is_file():
        raise ConfigError(f"prompt_file {prompt_file} does not exist" if not source.exists()
                          else f"prompt_file {prompt_file} is not a file")
    if target.exists() and not target.is_dir() and target.samefile(source):
        raise ConfigError(f"output={output} is the prompt_file itself; write the results to another file")
    check_output_file(target, "output", example="results.jsonl")
    if not resume and target.is_file() and target.stat().st_size > 0:
        raise ConfigError(f"output={output} already holds results; add resume=true to continue it, "
                          "or choose another file")


def parse_threads(value: object, name: str = "threads") -> int | str:
    """``"auto"`` (physical cores) or a positive int up to the logical CPUs this process may use, else
    :class:`ConfigError` naming ``name``. More threads than CPUs only wait on each other, and a count
    like 100000 made the thread pool raise MemoryError."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    try:
        threads = parse_int(value, name, minimum=1)
    except ConfigError:
        raise ConfigError(f"{name} must be a positive integer or auto, got {value!r}") from None
    cpus = machine.logical_cpus()
    if threads > cpus:
        raise ConfigError(f"{name}={threads} is more than the {cpus} CPUs this process may run on; "
                          f"give at most {cpus}, or auto")
    return threads


def check_sampling(sampling: Mapping) -> dict:
    """The ``sampling`` group with finite numbers in range and usable ``bad_words`` entries."""
    sampling = dict(sampling)
    for key, limits in _SAMPLING_RANGES.items():
        if key in sampling:
            sampling[key] = check_number(sampling[key], f"sampling.{key}", limits)
    if "temperature" in sampling:
        check_temperature(sampling["temperature"], "sampling.temperature")
    for key in ("top_k", "min_new_tokens"):
        if key in sampling:
            sampling[key] = parse_int(sampling[key], f"sampling.{key}", minimum=0)
    sampling["bad_words"] = [_bad_word(entry, i) for i, entry in enumerate(sampling.get("bad_words") or [])]
    return sampling


def check_number(value: object, name: str, limits: NumberRange) -> float:
    """``value`` as a float: a finite number (an int or float, not a bool or text) within ``limits``, else
    ConfigError naming ``name`` with the range's wording."""
    number = _finite(value, name, limits.wording)
    low, high = limits.low, limits.high
    below = low is not None and (number < low or (number == low and not limits.low_allowed))
    if below or (high is not None and number > high):
        raise ConfigError(f"{name} must be {limits.wording}, got {value!r}")
    return number


def source_from_text(text: str, where: str) -> dict:
    """The model source a bare ``where=text`` names: a ``.gguf`` path, a directory, or a hub id
    (``owner/name``); ConfigError (one line) for text that is none of these."""
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf":
        return {"kind": "gguf", "path": text}
    if path.is_dir():
        return {"kind": "dir", "path": text}
    owner, slash, name = text.partition("/")
    if slash and owner and name and "/" not in name and not text.startswith((".", "~")) and not path.exists():
        return {"kind": "hub", "repo": text, "revision": None, "trust_remote_code": False}
    raise ConfigError(f"{where}={text!r} is not a .gguf file, a directory or a hub id (owner/name); "
                      f"or give a source with a kind, e.g. {where}='{{kind: dir, path: /models/m}}'")


def check_source(source: Mapping, where: str) -> None:
    """ConfigError when a model source still holds ``???`` (a required entry was not given) or a
    ``tiny`` source has an entry the tiny model builder does not take or a size below 1."""
    if source.get("kind") == "tiny":
        _check_tiny(source, where)
    for key, value in source.items():
        if value == MISSING:
            raise ConfigError(f"{where}.{key} is required for a '{source.get('kind')}' model source: "
                              f"add {where}.{key}=... to the command line")
        if isinstance(value, Mapping):
            check_source(value, f"{where}.{key}")


def _check_tiny(source: Mapping, where: str) -> None:
    import inspect

    from specgen.models.tiny import build_tiny_model

    known = set(inspect.signature(build_tiny_model).parameters)
    for key, value in source.items():
        if key == "kind":
            continue
        if key not in known:
            raise ConfigError(f"{where}.{key}: a 'tiny' model source takes only {', '.join(sorted(known))}")
        if key == "init_scale":
            _finite(value, f"{where}.{key}", "a finite number")
        else:
            parse_int(value, f"{where}.{key}", minimum=0 if key == "seed" else 1)


def _finite(value: object, name: str, meaning: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be {meaning}, got {value!r}")
    return float(value)


def _bad_word(entry: object, index: int):
    where = f"sampling.bad_words[{index}]"
    if isinstance(entry, str):
        if not entry:
            raise ConfigError(f"{where} is an empty string, which bans nothing; remove it or give a word")
        return entry
    if isinstance(entry, int) and not isinstance(entry, bool):
        return parse_int(entry, where, minimum=0)
    if isinstance(entry, (list, tuple)) and entry:
        return [parse_int(token, where, minimum=0) for token in entry]
    raise ConfigError(f"{where} must be a word, a token id or a non-empty list of token ids, got {entry!r}")


def _check_ui(ui: Mapping) -> dict:
    ui = dict(ui)
    for key in ("stream", "summary"):
        if key in ui:
            ui[key] = parse_bool(ui[key], f"ui.{key}")
    if "color" in ui:
        ui["color"] = parse_chat(ui["color"], "ui.color")
    return ui
