"""Cost tables: what verifying and drafting cost, in units of one 1-token target forward.

Pure data and arithmetic, no models. :class:`CostTable` prices a single
request's round, :class:`BatchCostTable` a batched step's forward. Both read
their cells through :func:`interpolate` (one piecewise-linear rule, continued
linearly past the measured range) and price drafting with :func:`draft_cost`;
:func:`is_cheap` is the one "cheap drafter" rule the planners share.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

#: A drafter whose tokens cost less than this (in target forwards) is planned as cheap:
#: it drafts deep and the stopping rule keeps what pays.
CHEAP_DRAFT_PER_TOKEN = 0.1


def interpolate(xs: Sequence[int], ys: Sequence[float], x: float, *, rising_tail: bool = False) -> float:
    """Piecewise-linear y(x) through (xs, ys), xs increasing.

    ys[i] exactly at xs[i]; linear between knots; past either end continued with
    the nearest segment's slope; between and before the knots never below 0. With
    ``rising_tail`` the slope past the last knot is clamped at >= 0 (so never below
    ys[-1]). One knot: proportional, ys[0] * x / xs[0].
    """
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i >= len(xs):
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        if rising_tail:
            return ys[-1] + max(slope, 0.0) * (x - xs[-1])
        return max(0.0, ys[-1] + slope * (x - xs[-1]))
    i = max(i, 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def draft_cost(fixed: float, per_token: float, num_tokens: int) -> float:
    """A proposal of ``num_tokens`` tokens: ``fixed + num_tokens * per_token``; nothing for none."""
    return fixed + per_token * num_tokens if num_tokens > 0 else 0.0


def is_cheap(per_token: float) -> bool:
    """Is drafting cheap enough to draft deep and let truncation cut (see :data:`CHEAP_DRAFT_PER_TOKEN`)?"""
    return per_token < CHEAP_DRAFT_PER_TOKEN


def _counts(table: Sequence[float]) -> range:
    return range(1, len(table) + 1)


@dataclass(frozen=True)
class CostTable:
    """Measured costs, in units of one target forward of 1 token (``step_s`` seconds).

    chain[n - 1]: a target forward verifying n tokens as a chain (chain[0] == 1).
    tree[n - 1]: the same for a tree forward over n tokens (root + n - 1 nodes).
    draft_fixed / draft_per_token: a proposal of m tokens costs
        draft_fixed + m * draft_per_token.
    draft_catch_up: per committed token the drafter has not seen yet, what it costs to feed
        before its next proposal (a draft model skips plain rounds, then prefills what they
        committed); 0 for drafters that read the committed tokens for free.
    overhead: the rest of a round (processing, commit), per verified token.
    facts: what the table was measured on (the cache key).
    """

    chain: tuple[float, ...]
    tree: tuple[float, ...]
    draft_fixed: float = 0.0
    draft_per_token: float = 0.0
    overhead: float = 0.0
    step_s: float = 0.0
    draft_catch_up: float = 0.0
    facts: dict = field(default_factory=dict, compare=False)

    def verify(self, num_tokens: int, tree: bool = False) -> float:
        """Cost of verifying ``num_tokens`` tokens; past the table linear, never falling."""
        tree = bool(tree and self.tree)
        n = max(1, int(num_tokens))
        known = self._tree_costs if tree else self._chain_costs
        if n <= len(known):
            return known[n - 1]
        table = self.tree if tree else self.chain
        return interpolate(_counts(table), table, n, rising_tail=True) + self.overhead * n

    @functools.cached_property
    def _chain_costs(self) -> tuple[float, ...]:
        """verify(n) for n = 1 .. len(chain) (planning reads these every round)."""
        return self._with_overhead(self.chain)

    @functools.cached_property
    def _tree_costs(self) -> tuple[float, ...]:
        return self._with_overhead(self.tree)

    def _with_overhead(self, table: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v + self.overhead * n for n, v in enumerate(table, start=1))

    def draft(self, num_tokens: int) -> float:
        return draft_cost(self.draft_fixed, self.draft_per_token, num_tokens)

    def ceiling(self, max_tokens: int, tree: bool = False) -> float:
        """The best speed over a plain step any round of 1 .. ``max_tokens`` drafts could reach with
        every draft accepted: max_k (1 + k) v(1) / (draft(k) + v(1 + k)); 0 for no drafts. At most
        1, no draft can pay whatever the acceptance."""
        plain = self.verify(1)
        return max(((1 + k) * plain / (self.draft(k) + self.verify(1 + k, tree)) for k in range(1, max_tokens + 1)),
                   default=0.0)

    @property
    def cheap(self) -> bool:
        return is_cheap(self.draft_per_token)

    @property
    def max_tokens(self) -> int:
        return len(self.chain)


def _grid(name: str, table: tuple[tuple[float, ...], ...], rows: int, columns: int) -> None:
    if len(table) != rows or any(len(line) != columns for line in table):
        raise ValueError(f"batch table: {name} is not sizes x widths")


@dataclass(frozen=True)
class BatchCostTable:
    """Measured costs of batched verify forwards, in units of one 1-row 1-token forward (``step_s`` seconds).

    body[i][j]: a forward of sizes[i] rows, widths[j] tokens each, one logits row per row,
    with ``slots[0]`` slots in the shared cache.
    head: each further logits row (a row verifying k drafts reads k + 1).
    wide, slots: where measured, the same forwards with ``slots[1]`` shared slots (a forward's
    attention and cache append grow with the shared width); :meth:`at` interpolates between.
    ragged[i][j]: where measured, the forward of sizes[i] rows where one row feeds widths[j]
    tokens and the others one each (padded to widths[j]: linear layers skip the padding,
    attention does not), on ``slots[0]`` slots. Between that and ``body``, a forward's cost is
    linear in its real tokens (:meth:`verify`'s ``tokens``).
    facts: what the table was measured on (the cache key).
    Construction refuses grids that are not sizes x widths (ValueError).
    """

    sizes: tuple[int, ...]
    widths: tuple[int, ...]
    body: tuple[tuple[float, ...], ...]
    head: float = 0.0
    step_s: float = 0.0
    facts: dict = field(default_factory=dict, compare=False)
    wide: tuple[tuple[float, ...], ...] = ()
    slots: tuple[int, ...] = ()
    ragged: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self):
        _grid("body", self.body, len(self.sizes), len(self.widths))
        if self.ragged:
            _grid("ragged", self.ragged, len(self.sizes), len(self.widths))
        if self.wide:
            _grid("wide", self.wide, len(self.sizes), len(self.widths))
            if len(self.slots) != 2:
                raise ValueError("batch table: wide needs two slot counts")

    def at(self, slots: int) -> BatchCostTable:
        """The table for a shared cache ``slots`` wide: each entry linear in the width between the
        two measured ones (continued past the wider one, never below the narrower one's entry);
        the table itself when only one width was measured."""
        if not self.wide or len(self.slots) != 2 or self.slots[1] <= self.slots[0]:
            return self
        share = max(0.0, (slots - self.slots[0]) / (self.slots[1] - self.slots[0]))
        body = tuple(tuple(max(n, n + (w - n) * share) for n, w in zip(narrow, wide, strict=True))
                     for narrow, wide in zip(self.body, self.wide, strict=True))
        ragged = ()
        if self.ragged:  # padding saves the same at any width: shift by what the slots add
            ragged = tuple(tuple(r + (b - n) for r, n, b in zip(line, narrow, wide_line, strict=True))
                           for line, narrow, wide_line in zip(self.ragged, self.body, body, strict=True))
        return BatchCostTable(self.sizes, self.widths, body, self.head, self.step_s, self.facts, ragged=ragged)

    def verify(self, rows: int, width: int, logits_rows: int | None = None, tokens: int | None = None) -> float:
        """Cost of one batched forward of ``rows`` rows ``width`` tokens wide, ``tokens`` of them
        real (default: all, rows x width; at least rows - 1 + width), reading ``logits_rows``
        logits rows (default: one per row); bilinear in (rows, width), linear past the table."""
        rows, width = max(1, rows), max(1, width)
        extra = 0 if logits_rows is None else max(0, logits_rows - rows)
        padded = self._cell(self.body, rows, width)
        if tokens is not None:
            padded -= self.padding_saving(rows, width, padded) * (rows * width - max(tokens, rows - 1 + width))
        return padded + self.head * extra

    def padding_saving(self, rows: int, width: int, padded: float | None = None) -> float:
        """What each padded (not real) token of a ``rows`` x ``width`` forward saves against a real
        one: 0 without a ragged table or where padding saves nothing measurable. padded: that
        forward's uniform cost when the caller has it."""
        rows, width = max(1, rows), max(1, width)
        span = (rows - 1) * (width - 1)  # rows x width minus the ragged shape's rows - 1 + width tokens
        if not self.ragged or not span:
            return 0.0
        padded = self._cell(self.body, rows, width) if padded is None else padded
        return max(0.0, padded - self._cell(self.ragged, rows, width)) / span

    def _cell(self, table: tuple[tuple[float, ...], ...], rows: int, width: int) -> float:
        """``table`` (sizes x widths) at (rows, width), bilinear, linear past either end."""
        return interpolate(self.sizes, [interpolate(self.widths, line, width) for line in table], rows)

    @classmethod
    def from_chain(cls, chain: Sequence[float], sizes: Sequence[int] = (1, 2, 4, 8), max_width: int = 9,
                   step_s: float = 0.0) -> BatchCostTable:
        """A stand-in when only a single-row table is known: B rows of w tokens cost what one row of
        B * w tokens does (``chain`` is v(n) for n = 1.., continued as :meth:`CostTable.verify`)."""
        widths = tuple(range(1, max_width + 1))
        body = tuple(tuple(interpolate(_counts(chain), chain, b * w, rising_tail=True) for w in widths)
                     for b in sizes)
        return cls(tuple(sizes), widths, body, 0.0, step_s)
