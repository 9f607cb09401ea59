"""Build a :class:`ProcessorStack` from the config's ordered ``processors`` list.

Each entry is either ``{name: <builtin>, ...args}`` or ``{_target_: dotted.path,
...}`` for a user processor (a specgen ``Processor`` or an HF ``LogitsProcessor``).
Entries whose arguments make them a no-op (top_k: 0, top_p: 1.0, penalty 1.0 ...)
are dropped, so they cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from specgen.errors import ConfigError
from specgen.processors.hf_adapter import HFProcessorAdapter
from specgen.processors.stack import ProcessorStack
from specgen.processors.standard import (
    BadWords,
    FrequencyPresencePenalty,
    MinNewTokens,
    MinP,
    Processor,
    RepetitionPenalty,
    Temperature,
    TopK,
    TopP,
)


def _builtin(name: str, args: Mapping, *, eos_ids: Sequence[int], vocab_size: int) -> Processor | None:
    def arg(key, default=None):
        return args.get(key, default)

    if name == "temperature":
        return None if arg("temperature") in (None, 0, 0.0, 1, 1.0) else Temperature(arg("temperature"))
    if name == "top_k":
        return None if not arg("top_k") else TopK(arg("top_k"))
    if name == "top_p":
        return None if arg("top_p") in (None, 1, 1.0) else TopP(arg("top_p"))
    if name == "min_p":
        return None if not arg("min_p") else MinP(arg("min_p"))
    if name == "repetition_penalty":
        return None if arg("penalty") in (None, 1, 1.0) else RepetitionPenalty(arg("penalty"))
    if name == "frequency_presence_penalty":
        freq, pres = arg("frequency_penalty", 0.0) or 0.0, arg("presence_penalty", 0.0) or 0.0
        return None if freq == 0 and pres == 0 else FrequencyPresencePenalty(freq, pres)
    if name == "min_new_tokens":
        return None if not arg("min_new_tokens") else MinNewTokens(arg("min_new_tokens"), eos_ids)
    if name == "bad_words":
        return None if not arg("bad_words") else BadWords(arg("bad_words"), vocab_size)
    raise ConfigError(
        f"unknown processor '{name}'; built-ins are temperature, top_k, top_p, min_p, "
        "repetition_penalty, frequency_presence_penalty, min_new_tokens, bad_words"
    )


def _custom(entry: Mapping, index: int) -> Processor:
    """The user processor of ``processors[index]``; ConfigError naming the entry when it cannot be
    built or builds something that is neither a Processor nor a callable."""
    from hydra.utils import instantiate

    spec = {k: v for k, v in entry.items() if k != "pure"}
    where = f"processors[{index}] (_target_: {entry.get('_target_')})"
    try:
        obj = instantiate(spec)
    except Exception as exc:  # hydra wraps import and argument errors
        raise ConfigError(f"cannot instantiate {where}: {exc}") from exc
    if isinstance(obj, Processor):
        return obj
    if callable(obj):
        return HFProcessorAdapter(obj, pure=bool(entry.get("pure", False)))
    shown = repr(obj)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ConfigError(f"{where} returned {type(obj).__name__} {shown}, not a processor: _target_ must build "
                      "a specgen Processor or a callable HF LogitsProcessor (input_ids, scores) -> scores")


def build_stack(
    entries: Sequence[Mapping], *, greedy: bool, eos_ids: Sequence[int], vocab_size: int
) -> ProcessorStack:
    """entries: the ordered config list; returns the stack with no-ops removed.

    ConfigError for an unknown built-in, an entry without name or _target_, or a
    non-finite number (``temperature: inf``).
    """
    processors: list[Processor] = []
    for index, entry in enumerate(entries):
        entry = dict(entry)
        if "_target_" in entry:
            processors.append(_custom(entry, index))
            continue
        name = entry.pop("name", None)
        if name is None:
            raise ConfigError(f"processor entry {entry} needs a 'name' or a '_target_'")
        if greedy and name == "temperature":
            continue
        for key, value in entry.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"processor {name}: {key} must be a finite number, got {value}")
        processor = _builtin(name, entry, eos_ids=eos_ids, vocab_size=vocab_size)
        if processor is not None:
            processors.append(processor)
    return ProcessorStack(processors, greedy=greedy)
