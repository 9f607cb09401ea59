"""Structured-config schemas registered in Hydra's ConfigStore.

Group files list the schema in their defaults, so a mistyped value
(``sampling.temperature=hot``) fails at composition with Hydra's message
naming the key, before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class SamplingSchema:
    """The ``sampling`` group's types. Its values (every default) are written once, in each preset
    of conf/sampling/ (default.yaml, creative.yaml): a preset that leaves one out fails the checks."""

    temperature: float = MISSING
    top_k: int = MISSING
    top_p: float = MISSING
    min_p: float = MISSING
    repetition_penalty: float = MISSING
    presence_penalty: float = MISSING
    frequency_penalty: float = MISSING
    min_new_tokens: int = MISSING
    bad_words: list[Any] = MISSING


def register() -> None:
    """Idempotent: store the schemas under the names the group files reference."""
    ConfigStore.instance().store(group="sampling", name="schema", node=SamplingSchema)


register()
