"""The outcome of verifying a draft, one type for chains and trees (:class:`Verdict`).

A chain is a tree with one child per node (``parents == [-1, 0, 1, ...]``), so a chain's
verdict is a tree verdict whose ``path`` is its accepted prefix and whose ``checked`` holds
the positions tested, in order; those two are filled in when left out. The terms accepted / resampled / bonus / dead_end are
defined in :mod:`specgen.sampling.rejection` (chains) and :mod:`specgen.sampling.tree` (trees).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: How a round's last token came about; "dead_end" adds no token.
VerdictKind = Literal["resampled", "bonus", "dead_end"]


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft (a chain or a tree).

    num_accepted: how many draft nodes were kept (the depth of the accepted path).
    next_token: the one token the target adds after the path (resampled or bonus);
        None for "dead_end".
    kind: "dead_end" if the row after the last accepted node allows nothing, else
        "resampled" if a child of the last accepted node (or of the root) was
        rejected, else "bonus" (that node is a leaf of the draft).
    accept_probs: ``min(1, r/q)`` for each node in ``checked`` (aligned with it);
        ``r`` is the row in force at that moment (a residual after a rejected
        sibling). For a chain, position ``i``'s value is ``accept_probs[i]``.
    path: accepted node indices, root -> leaf (None: a chain's, ``0 .. num_accepted - 1``).
    checked: every node whose acceptance was tested, in test order, accepted nodes and
        rejected siblings alike (None: a chain's, ``0 .. len(accept_probs) - 1``).
    tokens: the accepted nodes' tokens, same order as ``path`` (every verifier fills it;
        not compared: it follows from ``path`` and the draft).
    """

    num_accepted: int
    next_token: int | None
    kind: VerdictKind
    accept_probs: tuple[float, ...] = ()
    path: list[int] | None = None
    checked: tuple[int, ...] | None = None
    tokens: list[int] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.path is None:
            object.__setattr__(self, "path", list(range(self.num_accepted)))
        if self.checked is None:
            object.__setattr__(self, "checked", tuple(range(len(self.accept_probs))))
        if len(self.path) != self.num_accepted or len(self.checked) != len(self.accept_probs):
            raise ValueError(f"a verdict of {self.num_accepted} accepted nodes has path {self.path} and "
                             f"{len(self.accept_probs)} accept_probs for checked {self.checked}")

    @classmethod
    def chain(cls, draft_tokens: list[int], num_accepted: int, next_token: int | None, kind: VerdictKind,
              accept_probs: tuple[float, ...]) -> Verdict:
        """A chain's verdict: the first ``num_accepted`` draft tokens kept, ``accept_probs`` one per
        position tested (positions ``0 .. len(accept_probs) - 1``)."""
        return cls(num_accepted, next_token, kind, tuple(accept_probs), tokens=list(draft_tokens[:num_accepted]))

    @classmethod
    def tree(cls, path: list[int], tokens: list[int], next_token: int | None, kind: VerdictKind,
             checked: tuple[int, ...] = (), accept_probs: tuple[float, ...] = ()) -> Verdict:
        """A tree's verdict: the accepted ``path`` (node indices) and its ``tokens``, and the nodes
        ``checked`` with their ``accept_probs``."""
        return cls(len(path), next_token, kind, tuple(accept_probs), list(path), tuple(checked), list(tokens))

    @property
    def emitted(self) -> list[int]:
        """All tokens this round commits: accepted tokens, then ``next_token`` (if any)."""
        return [*self.tokens] if self.next_token is None else [*self.tokens, self.next_token]

    @property
    def emitted_probs(self) -> tuple[float, ...]:
        """The emitted tokens' acceptance probabilities: each path node's (1.0 for a node never
        tested), then, after a rejection, the last rejected sibling's. For a chain this is
        ``accept_probs``."""
        tested = dict(zip(self.checked, self.accept_probs, strict=True))
        probs = [tested.get(node, 1.0) for node in self.path]
        if self.kind == "resampled" and self.checked:
            probs.append(self.accept_probs[-1])
        return tuple(probs)
