"""Learned draft heads (EAGLE, MTP, Medusa) and their files."""

from specgen.heads.modules import (
           DraftHead,
           EagleHead,
           HeadConfig,
           MedusaHead,
           MtpHead,
           build_head,
           select_features,
)
from specgen.heads.store import load_head, read_metadata, save_head, target_fingerprint

__all__ = ["DraftHead", "EagleHead", "HeadConfig", "MedusaHead", "MtpHead", "build_head", "load_head",
           "read_metadata", "save_head", "select_features", "target_fingerprint"]
