"""Structured-config schemas registered in Hydra's ConfigStore.

Group files list the schema in their defaults, so a mistyped value
(``sampling.temperature=hot``) fails at composition with Hydra's message
naming the key, before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class SamplingSchema:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_new_tokens: int = 0
    bad_words: list[Any] = field(default_factory=list)


def register() -> None:
    """Idempotent: store the schemas under the names the group files reference."""
    ConfigStore.instance().store(group="sampling", name="schema", node=SamplingSchema)


register()
