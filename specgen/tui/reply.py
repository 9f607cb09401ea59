"""Chat widgets: a user message, a reply whose tokens are coloured by kind, the legend.

Token colours live in chat.tcss as component classes (``token--accepted-1`` ...
``token--accepted-4``, ``token--resampled``, ``token--bonus``, ``token--plain``,
``token--selected``), shared by :class:`ReplyView` and :class:`Legend`.
"""

from __future__ import annotations

from collections.abc import Iterable

from textual import events
from textual.binding import Binding
from textual.content import Content
from textual.message import Message
from textual.style import Style
from textual.widget import Widget
from textual.widgets import Static

from specgen.events import TokenEvent

#: Deepest draft position with its own shade; deeper positions share it.
MAX_SHADE = 4
TOKEN_CLASSES = frozenset({*(f"token--accepted-{i}" for i in range(1, MAX_SHADE + 1)),
                           "token--resampled", "token--bonus", "token--plain", "token--selected"})


def token_class(token: TokenEvent) -> str:
    """The component class that colours ``token``: kind, and for accepted tokens the draft position."""
    if token.kind == "accepted":
        return f"token--accepted-{min(max(token.draft_position or 1, 1), MAX_SHADE)}"
    return f"token--{token.kind}"


class UserMessage(Static):
    """One user turn, as typed; ``queued`` while it waits for the reply in progress (class ``-queued``)."""

    def __init__(self, text: str, *, queued: bool = False):
        super().__init__()
        self.text = text
        self.queued = queued

    def on_mount(self) -> None:
        self.set_queued(self.queued)

    def set_queued(self, queued: bool) -> None:
        """Show the turn as waiting to be sent (True) or as sent (False)."""
        self.queued = queued
        self.set_class(queued, "-queued")
        label = "you (queued) › " if queued else "you › "
        self.update(Content.assemble((label, "bold"), self.text))


class Notice(Static):
    """Something the chat did on its own that the user should know (e.g. old turns left out)."""


class ErrorMessage(Static):
    """A user-facing error (bad config, load failure, failed reply); never a traceback."""

    def __init__(self, text: str):
        super().__init__(Content.assemble(("error: ", "bold"), text))


class ReplyView(Widget, can_focus=True):
    """One assistant reply, streamed token by token.

    Each token is styled by :func:`token_class` and carries its index as style
    meta, so a click selects it; with focus, ←/→/Home/End move the selection.
    Selecting posts :class:`ReplyView.TokenSelected`.
    """

    COMPONENT_CLASSES = TOKEN_CLASSES
    BINDINGS = [
        Binding("left", "move(-1)", "Prev token", show=False),
        Binding("right", "move(1)", "Next token", show=False),
        Binding("home", "move_to(0)", "First token", show=False),
        Binding("end", "move_to(-1)", "Last token", show=False),
    ]

    class TokenSelected(Message):
        """The user selected ``token`` in ``reply``."""

        def __init__(self, reply: ReplyView, token: TokenEvent):
            super().__init__()
            self.reply = reply
            self.token = token

    def __init__(self, title: str):
        super().__init__()
        self.tokens: list[TokenEvent] = []
        self.tail = ""
        self.selected: int | None = None
        self._parts: list[tuple[str, Style]] = []  # styled tokens[:len(_parts)], as of _parts_selected
        self._parts_selected: int | None = None
        self.border_title = title
        self.border_subtitle = "streaming · Esc cancels"

    @property
    def text(self) -> str:
        """The reply's text so far (what goes into the chat history)."""
        return "".join(t.text for t in self.tokens) + self.tail

    def extend(self, tokens: Iterable[TokenEvent], tail: str = "") -> None:
        """Append committed tokens (and, at the end, the engine's released tail)."""
        self.tokens.extend(tokens)
        self.tail += tail
        self.refresh(layout=True)

    def finish(self, summary: str) -> None:
        self.border_subtitle = summary

    def select(self, index: int) -> None:
        """Select the token at ``index`` (clamped) and announce it."""
        if not self.tokens:
            return
        self.selected = min(max(index, 0), len(self.tokens) - 1)
        self.refresh()
        self.post_message(self.TokenSelected(self, self.tokens[self.selected]))

    def action_move(self, step: int) -> None:
        self.select((len(self.tokens) if self.selected is None else self.selected) + step)

    def action_move_to(self, index: int) -> None:
        self.select(index if index >= 0 else len(self.tokens) - 1)

    def on_focus(self) -> None:
        if self.selected is None:
            self.action_move_to(-1)

    def on_click(self, event: events.Click) -> None:
        index = event.style.meta.get("token")
        if index is not None:
            self.focus()
            self.select(int(index))

    def render(self) -> Content:
        """The tokens, each styled by kind; styled parts are cached, so a frame styles only new tokens."""
        for index in range(len(self._parts), len(self.tokens)):
            self._parts.append(self._part(index))
        for index in {self._parts_selected, self.selected} - {None}:
            self._parts[index] = self._part(index)
        self._parts_selected = self.selected
        content = Content.assemble(*self._parts, self.tail)
        return content if content.plain else Content("…")

    def notify_style_update(self) -> None:
        """The CSS (or theme) changed: style every token again at the next render."""
        super().notify_style_update()
        self._parts.clear()

    def _part(self, index: int) -> tuple[str, Style]:
        token = self.tokens[index]
        text = "∅" if index == self.selected and not token.text else token.text
        names = (token_class(token), "token--selected") if index == self.selected else (token_class(token),)
        style = Style()
        for name in names:
            style += self.get_visual_style(name)
        return text, style + Style.from_meta({"token": index})


class Legend(Widget):
    """One line explaining the token colours."""

    COMPONENT_CLASSES = TOKEN_CLASSES

    def render(self) -> Content:
        shades = [(f" {i}{'+' if i == MAX_SHADE else ''} ", self.get_visual_style(f"token--accepted-{i}"))
                  for i in range(1, MAX_SHADE + 1)]
        return Content.assemble(
            "accepted at draft pos ", *shades, "  ",
            (" resampled ", self.get_visual_style("token--resampled")), " ",
            (" bonus ", self.get_visual_style("token--bonus")), " ",
            (" plain ", self.get_visual_style("token--plain")), " ",
            (" selected ", self.get_visual_style("token--selected")),
        )
