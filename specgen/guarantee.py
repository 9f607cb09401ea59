"""What a run promises about its output: a typed value, decided once by the build.

A :class:`Guarantee` is one of four kinds:

* ``exact`` -- sampling: every output sequence has exactly the target's distribution;
* ``greedy`` -- temperature 0: the output equals plain greedy decoding token for token;
* ``approximate`` -- speculation runs, but the reason names why near-ties can flip;
* ``off`` -- speculation does not run; the reason says why (plain decoding is the target's own law).

An ``exact`` or ``greedy`` claim may carry a reason too: the condition it holds under
(e.g. on CUDA float32 with TF32 off). Consumers read :attr:`Guarantee.kind`,
:attr:`Guarantee.reason` and the helpers; ``str(g)`` is the printed and serialised form
(``"exact"``, ``"off: speculative=false"``, ``"greedy: on CUDA float32 ..."``).

An ``exact``/``greedy`` claim is exact against one numerical path: the target's logits as its
backend and weights compute them (llama.cpp on the GGUF's blocks, torch float32, torch int4 ...).
:attr:`Guarantee.against` names that path and :meth:`Guarantee.label` shows it
(``"greedy vs llama_cpp (llama 135M Q4_1 ...)"``); it is not part of ``str(g)`` or of equality.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

GuaranteeKind = Literal["exact", "greedy", "approximate", "off"]

#: Every guarantee kind, in the order of the module docstring.
GUARANTEE_KINDS: tuple[str, ...] = get_args(GuaranteeKind)


@dataclass(frozen=True)
class Guarantee:
    """A run's claim: ``kind`` and the ``reason`` it is qualified by ("" when none).

    Invariant: ``kind`` is one of :data:`GUARANTEE_KINDS` (ValueError otherwise).
    """

    kind: GuaranteeKind
    reason: str = ""
    against: str = field(default="", compare=False)  # the numerical path of an exact/greedy claim

    def __post_init__(self):
        if self.kind not in GUARANTEE_KINDS:
            raise ValueError(f"a guarantee kind is one of {', '.join(GUARANTEE_KINDS)}, got {self.kind!r}")

    @classmethod
    def off(cls, reason: str) -> Guarantee:
        """Speculation does not run, for ``reason``."""
        return cls("off", reason)

    @property
    def speculative(self) -> bool:
        """Whether speculation runs under this guarantee (every kind but ``off``)."""
        return self.kind != "off"

    @property
    def exact(self) -> bool:
        """Whether the claim is that the output law is the target's (``exact`` or ``greedy``),
        under the condition the reason names, if any."""
        return self.kind in ("exact", "greedy")

    @property
    def unconditional(self) -> bool:
        """An ``exact``/``greedy`` claim with no condition attached yet."""
        return self.exact and not self.reason

    def with_kind(self, kind: GuaranteeKind) -> Guarantee:
        """The same reason and path under another kind (e.g. ``greedy`` at temperature 0 for an
        ``exact`` claim)."""
        return replace(self, kind=kind)

    def label(self) -> str:
        """``str(self)``, followed for an ``exact``/``greedy`` claim by the path it is exact against."""
        return f"{self} vs {self.against}" if self.exact and self.against else str(self)

    def __str__(self) -> str:
        return f"{self.kind}: {self.reason}" if self.reason else self.kind
