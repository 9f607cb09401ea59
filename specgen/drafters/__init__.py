"""Drafters: one module each, behind the small interface in :mod:`specgen.drafters.base`."""

from specgen.drafters.base import (
    DraftContext,
    Drafter,
    DrafterRuntime,
    DraftSession,
    DraftShape,
    HFAssistant,
    Proposal,
    batch_refusal,
)
from specgen.drafters.ngram import NgramDrafter
from specgen.drafters.small_model import SmallModelDrafter


def drafter_class(kind: str) -> type[Drafter] | None:
    """The built-in drafter class of a config's ``drafter.kind`` (its ``name``), or None for
    ``none`` and kinds specgen does not ship; its class attributes state what it is and needs."""
    from specgen.drafters.dspark import DsparkDrafter
    from specgen.drafters.eagle import EagleDrafter
    from specgen.drafters.medusa import MedusaDrafter
    from specgen.drafters.mtp import MtpDrafter

    classes = (NgramDrafter, SmallModelDrafter, EagleDrafter, MedusaDrafter, MtpDrafter, DsparkDrafter)
    return next((cls for cls in classes if cls.name == kind), None)


__all__ = ["DraftContext", "DraftSession", "DraftShape", "Drafter", "DrafterRuntime", "HFAssistant", "NgramDrafter",
           "Proposal", "SmallModelDrafter", "batch_refusal", "drafter_class"]
