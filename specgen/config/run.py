"""One frozen, validated :class:`RunConfig`: Hydra's composed config as a run reads it.

An entry point (``specgen``, ``specgen-serve``, ``specgen-chat``, ``specgen-bench``, the
``specgen.pipeline(...)`` API) builds it once, at the edge, with :meth:`RunConfig.from_cfg`,
and hands it down: :func:`specgen.engine.assemble.build_pipeline` takes it, the pipeline keeps
it as ``Pipeline.config`` and its request defaults as ``Pipeline.defaults``. Nothing below the
edge checks a run value again or reads one with a default: every default is written once, in
conf/config.yaml (``from_cfg`` takes each run key as given there; a key the composed config
lacks is a ConfigError), and every bound once, in :mod:`specgen.config.checks` /
:mod:`specgen.config.options`.

Typed here: the run-level switches, the request defaults (:class:`RequestDefaults`) and the
``llama_cpp`` and ``prefix_cache`` sections. The components Hydra instantiates (``target``,
``drafter``, ``sampling``, ``processors``, ``grammar``) and the entry points' own sections
(``ui``; ``bench``, ``train``, serve's ``host`` ... in :attr:`RunConfig.extra`) stay checked
mappings, read-only at the top.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import ClassVar, Literal

from specgen.config.checks import check_run_config, required


@dataclass(frozen=True)
class RequestDefaults:
    """What a request takes where it sets nothing (:func:`specgen.config.options.request_options`):
    max_new_tokens >= 1; seed in [0, 2**64); stop: the stop strings; chat: True, False or "auto";
    system: a system message or None; logprobs: None (off) or k in [0, 20]."""

    max_new_tokens: int
    seed: int
    stop: tuple[str, ...]
    chat: bool | Literal["auto"]
    system: str | None
    logprobs: int | None


@dataclass(frozen=True)
class LlamaCppSettings:
    """The ``llama_cpp`` section (:func:`specgen.config.checks.check_llama_cpp`): KV handles a model
    holds at once, the KV cells of each context ("auto", None or tokens), a batched row's tokens, and
    the flash-attention, tiny-model GGUF type and repack choices, and the prefill split ("auto" or tokens)."""

    sequences: int
    context: int | str | None
    batch_row_context: int
    tiny_type: str
    flash_attention: str
    repack: str
    prefill_split: int | str


@dataclass(frozen=True)
class PrefixCacheSettings:
    """The ``prefix_cache`` section: finished requests' KV handles kept (0 = off), the KV bytes they may
    hold, and whether a chat's parked handle is fed its next turn's template ids in the background."""

    entries: int
    bytes: int
    anticipate: bool


#: Top-level keys a RunConfig types (or keeps as a checked component mapping); any other key is ``extra``.
_RUN_KEYS = frozenset({
    "target", "drafter", "sampling", "processors", "grammar", "ui", "prompt", "prompt_file", "output", "resume",
    "batch_size", "system", "chat", "max_new_tokens", "seed", "logprobs", "stop", "speculative", "observe_costs",
    "compile", "packed_weights", "invariant_verify", "device", "dtype", "threads", "backend", "llama_cpp",
    "prefix_cache",
})


@dataclass(frozen=True)
class RunConfig:
    """A run's settings, checked once (:meth:`from_cfg`). Frozen: a run that needs other settings
    builds another (``dataclasses.replace`` for the typed fields).

    target / drafter / sampling / grammar / ui: the checked group mappings; processors: the stack's
    entries (tuple of mappings); requests: :class:`RequestDefaults`; prompt / prompt_file / output /
    resume / batch_size: the one-shot CLI's input and JSONL settings (batch_size None where the entry
    point sizes batches itself, as specgen-serve does); threads: "auto" or a positive int; device /
    dtype / backend: as given (resolved when the pipeline is built); checked: the whole checked config
    as a mapping (what fingerprints and cost-table keys hash, and what Hydra instantiates from);
    extra: the top-level keys a run does not read (an entry point's own sections).
    """

    target: Mapping
    drafter: Mapping
    sampling: Mapping
    processors: tuple[Mapping, ...]
    grammar: Mapping | None
    ui: Mapping
    requests: RequestDefaults
    prompt: str | None
    prompt_file: str | None
    output: str | None
    resume: bool
    batch_size: int | None
    speculative: bool
    observe_costs: bool
    compile: bool
    packed_weights: bool
    invariant_verify: bool
    device: str
    dtype: str
    threads: int | Literal["auto"]
    backend: str
    llama_cpp: LlamaCppSettings
    prefix_cache: PrefixCacheSettings
    checked: Mapping = field(repr=False, compare=False)
    extra: Mapping = field(repr=False, compare=False)

    #: RunConfigs built in this process (a test counts one per run).
    constructions: ClassVar[int] = 0

    def __post_init__(self) -> None:
        type(self).constructions += 1

    @classmethod
    def from_cfg(cls, cfg) -> RunConfig:
        """``cfg`` (a DictConfig, or a plain dict of it) checked by :func:`check_run_config` and typed.

        ConfigError naming the first bad key (or a run key the config lacks: conf/config.yaml holds
        them all, so a composed config has every one). A RunConfig is returned as it is.
        """
        if isinstance(cfg, RunConfig):
            return cfg
        if not isinstance(cfg, dict):  # a DictConfig (a Mapping too): resolved into plain dicts and lists
            from specgen.config.compose import to_container

            cfg = to_container(cfg)
        checked = check_run_config(cfg)  # sets every request, switch and section key it reads
        llama, prefix = checked["llama_cpp"], checked["prefix_cache"]
        return cls(
            target=MappingProxyType(checked["target"]), drafter=MappingProxyType(required(checked, "drafter") or {}),
            sampling=MappingProxyType(required(checked, "sampling")), processors=tuple(required(checked, "processors")),
            grammar=required(checked, "grammar"), ui=MappingProxyType(required(checked, "ui")),
            requests=RequestDefaults(max_new_tokens=checked["max_new_tokens"], seed=checked["seed"],
                                     stop=tuple(checked["stop"]), chat=checked["chat"], system=checked["system"],
                                     logprobs=checked["logprobs"]),
            prompt=checked["prompt"], prompt_file=checked["prompt_file"], output=required(checked, "output"),
            resume=required(checked, "resume"), batch_size=checked.get("batch_size"),  # None: serve sizes its own
            speculative=checked["speculative"], observe_costs=checked["observe_costs"], compile=checked["compile"],
            packed_weights=checked["packed_weights"], invariant_verify=checked["invariant_verify"],
            device=str(required(checked, "device")), dtype=str(required(checked, "dtype")), threads=checked["threads"],
            backend=str(required(checked, "backend")),
            llama_cpp=LlamaCppSettings(**{f.name: llama[f.name] for f in fields(LlamaCppSettings)}),
            prefix_cache=PrefixCacheSettings(**{f.name: prefix[f.name] for f in fields(PrefixCacheSettings)}),
            checked=MappingProxyType(checked),
            extra=MappingProxyType({key: value for key, value in checked.items() if key not in _RUN_KEYS}),
        )
