"""Learned draft heads (EAGLE, EAGLE-3, MTP, Medusa, DSpark) and their files."""

from specgen.heads.dspark import DsparkHead
from specgen.heads.fingerprint import target_fingerprint
from specgen.heads.kinds import build_head
from specgen.heads.modules import (
           DraftHead,
           EagleHead,
           HeadConfig,
           MedusaHead,
           MtpHead,
           select_features,
)
from specgen.heads.store import load_head, read_metadata, save_head

__all__ = ["DraftHead", "DsparkHead", "EagleHead", "HeadConfig", "MedusaHead", "MtpHead", "build_head", "load_head",
           "read_metadata", "save_head", "select_features", "target_fingerprint"]
