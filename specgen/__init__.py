"""specgen: config-driven local text generation with exact speculative decoding.

>>> import specgen
>>> pipe = specgen.pipeline("target=tiny", "drafter=tiny", "sampling.temperature=0.8")
>>> gen = pipe.generate(prompt_ids=[1, 2, 3], options=specgen.RequestOptions(max_new_tokens=8, seed=0))
>>> str(gen.guarantee), gen.guarantee.speculative
('exact', True)
"""

from __future__ import annotations

import importlib

from specgen.errors import ConfigError, ModelLoadError, NumericalError, PromptError, SpecgenError

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "FinishEvent",
    "Generation",
    "Guarantee",
    "ModelLoadError",
    "NumericalError",
    "PromptError",
    "RequestOptions",
    "SpecgenError",
    "TokenEvent",
    "TokenLogprob",
    "pipeline",
]

#: Where the public names that need torch live. They load on first use, so that ``import specgen`` (and
#: the console scripts' :mod:`specgen.cli.entry`) stays light until torch is needed.
_EXPORTS = {
    **dict.fromkeys(("FinishEvent", "Generation", "TokenEvent"), "specgen.events"),
    "Guarantee": "specgen.guarantee",
    "RequestOptions": "specgen.config.options",
    "TokenLogprob": "specgen.sampling.logprobs",
}


def __getattr__(name: str):
    """The public name ``name`` from its module (imported on first use)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specgen' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def pipeline(*overrides: str, progress: bool = True):
    """Compose the config with CLI-style ``overrides`` and build a Pipeline.

    overrides: strings like ``"target=tiny"``; anything else raises ConfigError
    naming the argument. progress: show load progress (a bool or its usual spellings).
    """
    from specgen.engine.assemble import build_pipeline
    from specgen.config.compose import compose
    from specgen.config.options import parse_bool

    for index, override in enumerate(overrides):
        if not isinstance(override, str):
            raise ConfigError(f"pipeline() overrides must be strings like 'target=tiny'; "
                              f"argument {index + 1} is {type(override).__name__} {override!r}")
    return build_pipeline(compose(overrides), progress=parse_bool(progress, "progress"))
