"""The side panel: guarantee banner, speed, acceptance bars, time split, selected token.

It only renders what it is given (a :class:`PanelSnapshot`, a TokenEvent); it
never reads engine state. Colours come from chat.tcss.
"""

from __future__ import annotations

from collections.abc import Mapping

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.style import Style
from textual.widgets import Static

from specgen.events import TokenEvent
from specgen.guarantee import GUARANTEE_KINDS, Guarantee
from specgen.tui.tally import PanelSnapshot

BAR_WIDTH = 12
_EIGHTHS = " ▏▎▍▌▋▊▉"
#: Component classes of StatsPanel (colours in chat.tcss), looked up by name in a palette.
PALETTE_NAMES = ("bar", "track", "draft", "verify", "process", "grammar", "state")

Palette = Mapping[str, Style | str]


def bar(fraction: float, width: int = BAR_WIDTH) -> tuple[str, str]:
    """A horizontal bar for ``fraction`` in [0, 1]: (filled part, empty track)."""
    cells = max(0.0, min(1.0, fraction)) * width
    full = int(cells)
    partial = _EIGHTHS[int((cells - full) * 8)] if full < width else ""
    filled = "█" * full + partial.strip()
    return filled, "·" * (width - len(filled))


def split_cells(values: list[float], width: int) -> list[int]:
    """Divide ``width`` cells in proportion to ``values`` (largest remainders), summing to ``width``."""
    total = sum(values)
    if total <= 0:
        return [0] * len(values)
    exact = [width * v / total for v in values]
    cells = [int(x) for x in exact]
    by_remainder = sorted(range(len(values)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in by_remainder[: width - sum(cells)]:
        cells[i] += 1
    return cells


#: Banner heads that are not a guarantee kind: the app's states before a pipeline exists.
BANNER_STATES = ("error", "loading")


def guarantee_class(head: str) -> str:
    """CSS class for the banner of ``head`` (a guarantee kind, or one of :data:`BANNER_STATES`):
    -exact, -greedy, -approximate, -off, -error or -loading; -off for anything else."""
    return f"-{head}" if head in (*GUARANTEE_KINDS, *BANNER_STATES) else "-off"


def acceptance_content(snapshot: PanelSnapshot, palette: Palette) -> Content:
    """Header plus one bar per draft position."""
    lines: list = [("acceptance by draft pos", "bold")]
    if not snapshot.acceptance:
        lines.append("\n" + ("— plain decoding" if not snapshot.speculative else "— no drafts yet"))
    for position, share in enumerate(snapshot.acceptance, start=1):
        filled, track = bar(share)
        lines += [f"\n{position:>2} ", (filled, palette.get("bar", "")), (track, palette.get("track", "")),
                  f" {share:4.2f}"]
    return Content.assemble(*lines)


def timing_content(snapshot: PanelSnapshot, palette: Palette) -> Content:
    """Header plus a stacked bar of the stage times and their shares."""
    total = sum(seconds for _, seconds in snapshot.timings)
    if not snapshot.timings:
        return Content.assemble(("time split", "bold"), "\n— when the reply ends")
    if total <= 0:
        return Content.assemble(("time split", "bold"), "\n— after the first round")
    parts: list = [("time split", "bold"), "\n"]
    cells = split_cells([seconds for _, seconds in snapshot.timings], 2 * BAR_WIDTH)
    for (label, _), count in zip(snapshot.timings, cells, strict=True):
        parts.append(("█" * count, palette.get(label, "")))
    for index, (label, seconds) in enumerate(snapshot.timings):
        parts += ["\n" if index % 2 == 0 else "  ", (f"{label:<8}", palette.get(label, "")),
                  f"{100 * seconds / total:3.0f}%"]
    return Content.assemble(*parts)


def numbers_content(snapshot: PanelSnapshot) -> Content:
    """τ, speed, rounds, target calls, prompt tokens cached / prefilled, tokens and finish reason."""
    finish = f" · {snapshot.finish_reason}" if snapshot.finish_reason else " · streaming"
    return Content.assemble(
        ("τ ", "bold"), f"{snapshot.tau:.2f}/call  ", f"{snapshot.tokens_per_s:.1f} tok/s\n",
        ("rounds ", "bold"), f"{snapshot.rounds}  ", ("calls ", "bold"), f"{snapshot.target_calls}\n",
        ("prompt ", "bold"), f"{snapshot.prefill_reused} cached · {snapshot.prefill_computed} prefilled\n",
        ("tokens ", "bold"), f"{snapshot.new_tokens}{finish if snapshot.rounds else ''}",
    )


def token_content(token: TokenEvent | None) -> Content:
    """Details of the selected token, or how to select one."""
    if token is None:
        return Content.assemble(("selected token", "bold"), "\nclick a token, or Tab to a\nreply and use ← →")
    position = "—" if token.draft_position is None else str(token.draft_position)
    prob = "—" if token.accept_prob is None else f"{token.accept_prob:.3f}"
    return Content.assemble(
        ("selected token ", "bold"), repr(token.text), f" #{token.token_id}\n",
        (token.kind, "bold"), f" · draft pos {position}\n",
        "min(1,p/q) ", (prob, "bold"), f" · round {token.round}",
        "" if token.gamma is None else f" · γ {token.gamma}",
    )


class StatsPanel(VerticalScroll):
    """Live numbers for the reply in progress; see the module docstring."""

    COMPONENT_CLASSES = frozenset(f"panel--{name}" for name in PALETTE_NAMES)

    def palette(self) -> dict[str, Style]:
        """The bar and stage colours from chat.tcss."""
        return {name: self.get_visual_style(f"panel--{name}") for name in PALETTE_NAMES}

    def compose(self) -> ComposeResult:
        yield Static(id="banner")
        yield Static(id="mode")
        yield Static(id="numbers")
        yield Static(id="acceptance")
        yield Static(id="timings")
        yield Static(token_content(None), id="token")

    def show_guarantee(self, guarantee: Guarantee) -> None:
        """Set the banner: the guarantee of the run (or of the reply in progress), with the numerical
        path an exact/greedy claim is exact against (:meth:`Guarantee.label`)."""
        path = f"vs {guarantee.against}" if guarantee.exact and guarantee.against else ""
        self.show_banner(guarantee.kind, "; ".join(part for part in (guarantee.reason, path) if part))

    def show_banner(self, head: str, reason: str = "") -> None:
        """Set the banner to ``head`` (a guarantee kind or one of :data:`BANNER_STATES`) and its reason."""
        banner = self.query_one("#banner", Static)
        banner.set_classes(guarantee_class(head))
        banner.update(Content.assemble((head.upper(), "bold"), f": {reason}" if reason else ""))

    def show_mode(self, speculate: bool, available: bool) -> None:
        """Whether the next reply speculates (toggled with the speculation key)."""
        if not available:
            text = "speculation unavailable"
        else:
            text = f"next reply: {'speculative' if speculate else 'plain'}"
        self.query_one("#mode", Static).update(text)

    def show_snapshot(self, snapshot: PanelSnapshot) -> None:
        """Render the running numbers."""
        self.show_guarantee(snapshot.guarantee)
        self.query_one("#numbers", Static).update(numbers_content(snapshot))
        palette = self.palette()
        self.query_one("#acceptance", Static).update(acceptance_content(snapshot, palette))
        self.query_one("#timings", Static).update(timing_content(snapshot, palette))

    def show_token(self, token: TokenEvent | None) -> None:
        self.query_one("#token", Static).update(token_content(token))
