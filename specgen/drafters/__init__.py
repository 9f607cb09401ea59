"""Drafters: one module each, behind the small interface in :mod:`specgen.drafters.base`."""

from specgen.drafters.base import DraftContext, Drafter, DrafterRuntime, DraftSession, Proposal
from specgen.drafters.ngram import NgramDrafter
from specgen.drafters.small_model import SmallModelDrafter

__all__ = ["DraftContext", "DraftSession", "Drafter", "DrafterRuntime", "NgramDrafter", "Proposal", "SmallModelDrafter"]
