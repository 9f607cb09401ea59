"""Heads by kind: :func:`build_head` makes an untrained head of a :class:`HeadConfig`'s kind
and :func:`fill_head` loads stored tensors into it.

Kinds: ``eagle``, ``mtp``, ``medusa`` (:mod:`specgen.heads.modules`), ``eagle3``
(:mod:`specgen.heads.eagle3`) and ``dspark`` (:mod:`specgen.heads.dspark`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specgen.errors import ModelLoadError, first_line
from specgen.heads.dspark import DsparkHead
from specgen.heads.eagle3 import Eagle3Head
from specgen.heads.modules import MAX_MEDUSA_HEADS, DraftHead, EagleHead, HeadConfig, MedusaHead, MtpHead

#: The kinds built from their config alone; ``eagle3`` is built apart (its config has attention).
HEADS: dict[str, type[DraftHead]] = {"eagle": EagleHead, "mtp": MtpHead, "medusa": MedusaHead,
                                     "dspark": DsparkHead}


def build_head(cfg: HeadConfig, vocab_ids: torch.Tensor) -> DraftHead:
    """An untrained head of ``cfg.kind`` over the draft vocabulary ``vocab_ids`` [draft_vocab_size]
    (ValueError for an unknown kind)."""
    if cfg.kind == "eagle3":
        return Eagle3Head(cfg, vocab_ids)
    if cfg.kind not in HEADS:
        raise ValueError(f"unknown head kind {cfg.kind!r}; expected one of eagle3, {', '.join(HEADS)}")
    return HEADS[cfg.kind](cfg, vocab_ids)


def meta_head(cfg: HeadConfig) -> DraftHead:
    """A head of ``cfg`` on the meta device: its tensors' shapes without their memory (ValueError for
    more than MAX_MEDUSA_HEADS Medusa heads, whose modules alone would take that long to make)."""
    if cfg.kind == "medusa" and not 1 <= int(cfg.num_heads) <= MAX_MEDUSA_HEADS:
        raise ValueError(f"num_heads must be 1..{MAX_MEDUSA_HEADS}, got {cfg.num_heads}")
    with torch.device("meta"):
        return build_head(cfg, torch.empty(int(cfg.draft_vocab_size), dtype=torch.long))


def check_shapes(path, cfg: HeadConfig, shapes: Mapping[str, tuple[int, ...]], config: str) -> None:
    """ModelLoadError (one line) unless a head of ``cfg`` holds exactly the tensors ``shapes`` names, each
    of that shape: checked on a head built on the meta device (nothing allocated), so metadata that
    does not describe the file's tensors is refused before a head of its sizes exists."""
    try:
        expected = {name: tuple(value.shape) for name, value in meta_head(cfg).state_dict().items()}
    except Exception as exc:  # a size the modules refuse (negative, not an int, an unknown kind)
        raise ModelLoadError(f"{path}: {config} does not describe a head ({first_line(exc)}); "
                             "the file is damaged") from None
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    wrong = sorted(name for name in expected.keys() & shapes.keys() if expected[name] != shapes[name])
    if wrong:
        name = wrong[0]
        raise ModelLoadError(f"{path}: tensor {name} is {list(shapes[name])} but {config} makes it "
                             f"{list(expected[name])}; the file is damaged")
    missing, unexpected = sorted(expected.keys() - shapes.keys()), sorted(shapes.keys() - expected.keys())
    if missing or unexpected:
        raise ModelLoadError(f"{path}: tensors do not fit {config} "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")


def fill_head(path, head: DraftHead, state: Mapping[str, torch.Tensor], config: str, kind: str) -> DraftHead:
    """``head`` with ``state`` loaded; ModelLoadError (one line) when a tensor's shape does not fit
    ``config`` or a name is missing or unexpected for ``kind``."""
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape that does not fit the config
        raise ModelLoadError(f"{path}: tensors do not fit {config}: "
                             f"{str(exc).strip().splitlines()[-1].strip()}") from exc
    if missing or unexpected:
        raise ModelLoadError(f"{path}: tensors do not fit {kind} (missing {missing}, unexpected {unexpected})")
    return head
