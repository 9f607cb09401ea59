"""Logit processors: pure functions of (logits, history), composed in a stack."""

from specgen.processors.build import build_stack
from specgen.processors.hf_adapter import HFProcessorAdapter
from specgen.processors.history import CommittedCounts, DeviceHistory, History, PathHistory
from specgen.processors.stack import GrammarSlot, ProcessorStack
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

__all__ = [
    "BadWords",
    "CommittedCounts",
    "DeviceHistory",
    "FrequencyPresencePenalty",
    "GrammarSlot",
    "HFProcessorAdapter",
    "History",
    "PathHistory",
    "MinNewTokens",
    "MinP",
    "Processor",
    "ProcessorStack",
    "RepetitionPenalty",
    "Temperature",
    "TopK",
    "TopP",
    "build_stack",
]
