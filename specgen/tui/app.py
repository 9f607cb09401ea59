"""``specgen-chat``: a terminal chat that colours every token by how it was produced.

Threading contract: the models load and every reply streams in Textual thread
workers (:func:`specgen.tui.session.run_reply`); the worker touches the UI only
through ``post_message`` / ``call_from_thread``. Only one reply streams at a
time; Esc sets its cancel flag and the worker closes the stream between events.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

from omegaconf import OmegaConf
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, TextArea

from specgen.config import compose as compose_config
from specgen.errors import SpecgenError
from specgen.tui.panel import StatsPanel
from specgen.tui.reply import ErrorMessage, Legend, ReplyView, UserMessage
from specgen.tui.session import ChatHistory, ReplyRequest, ReplyUpdate, load_pipeline, run_reply, uses_template
from specgen.tui.tally import PanelSnapshot

USAGE = """usage: specgen-chat [key=value ...]

A terminal chat that colours each token by how speculative decoding produced it.
Takes the same Hydra overrides as `specgen`, e.g.
  specgen-chat target=qwen2.5-coder-1.5b drafter=qwen2.5-coder-0.5b sampling.temperature=0.7
prompt=... is sent as the first message; system=... sets the system message.
"""


@dataclass
class ActiveReply:
    """A reply being generated: its view, what was asked, its cancel flag and chat epoch."""

    view: ReplyView
    request: ReplyRequest
    cancel: threading.Event
    epoch: int


class ReplyProgress(Message):
    """Posted by the reply worker: a batch of tokens and numbers for ``reply``."""

    def __init__(self, reply: ActiveReply, update: ReplyUpdate):
        super().__init__()
        self.reply = reply
        self.update = update


class ConfigScreen(ModalScreen[None]):
    """The composed config as YAML; Esc closes it."""

    BINDINGS = [Binding("escape,q,ctrl+g", "app.pop_screen", "Close")]

    def __init__(self, yaml_text: str):
        super().__init__()
        self.yaml_text = yaml_text

    def compose(self) -> ComposeResult:
        text = TextArea(self.yaml_text, read_only=True, show_cursor=False, id="config-text")
        text.border_title = "composed config (Esc closes)"
        yield text


class ChatApp(App[int]):
    """The chat. ``cfg``: the composed config; ``pipeline``: an already built one (tests)."""

    CSS_PATH = "chat.tcss"
    TITLE = "specgen-chat"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (90, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("escape", "cancel_reply", "Cancel reply"),
        Binding("ctrl+n", "new_chat", "New chat", priority=True),
        Binding("ctrl+t", "toggle_speculation", "Speculation on/off", priority=True),
        Binding("ctrl+g", "show_config", "Config", priority=True),
    ]

    def __init__(self, cfg, *, pipeline=None):
        super().__init__()
        self.cfg = cfg
        self.pipe = pipeline
        self.history: ChatHistory | None = None
        self.active: ActiveReply | None = None
        self.speculate = True
        self.epoch = 0
        self.replies = 0
        self.load_error: str | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield VerticalScroll(id="chat", can_focus=False)
            yield StatsPanel(id="panel", can_focus=False)
        yield Legend(id="legend")
        yield Input(placeholder="loading the models…", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#chat", VerticalScroll).anchor()
        self.query_one("#prompt", Input).focus()
        if self.pipe is not None:
            self._on_loaded(self.pipe)
            return
        target = OmegaConf.select(self.cfg, "target.name", default="target")
        drafter = OmegaConf.select(self.cfg, "drafter.kind", default="drafter")
        self.panel.show_guarantee(f"loading: {target} + {drafter}")
        self._load()

    @property
    def panel(self) -> StatsPanel:
        return self.query_one("#panel", StatsPanel)

    @work(thread=True, group="load")
    def _load(self) -> None:
        """Build the pipeline off the UI thread; report success or a one-line error."""
        try:
            pipe = load_pipeline(self.cfg)
        except SpecgenError as exc:
            self.call_from_thread(self._load_failed, str(exc))
            return
        self.call_from_thread(self._on_loaded, pipe)

    def _on_loaded(self, pipe) -> None:
        self.pipe = pipe
        self.history = ChatHistory(uses_template(pipe))
        self.speculate = pipe.speculative
        self.panel.show_snapshot(PanelSnapshot(pipe.guarantee, pipe.speculative))
        self.panel.show_mode(self.speculate, pipe.speculative)
        self.query_one("#prompt", Input).placeholder = "message (Enter sends)"
        first = OmegaConf.select(self.cfg, "prompt", default=None)
        if first:
            self._send(str(first))

    def _load_failed(self, message: str) -> None:
        self.load_error = message
        self.panel.show_guarantee("error: could not start")
        chat = self.query_one("#chat", VerticalScroll)
        chat.mount(ErrorMessage(f"{message}\nFix the override and restart; Ctrl+Q quits."))
        prompt = self.query_one("#prompt", Input)
        prompt.placeholder = "unavailable: the models did not load"
        prompt.disabled = True

    @on(Input.Submitted, "#prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.pipe is None:
            self.notify("still loading the models…", severity="warning")
        elif self.active is not None:
            self.notify("a reply is still streaming; Esc cancels it", severity="warning")
        else:
            event.input.clear()
            self._send(text)

    def _send(self, text: str) -> None:
        """Add the user turn, mount an empty reply and start the worker."""
        self.history.add("user", text)
        speculative = self.speculate and self.pipe.speculative
        request = ReplyRequest(self.history.prompt(), speculative, seed=int(self.pipe.defaults.seed) + self.replies,
                               stop=self.history.stop_strings(self.pipe.defaults.stop))
        self.replies += 1
        view = ReplyView(f"assistant · {'speculative' if speculative else 'plain'}")
        chat = self.query_one("#chat", VerticalScroll)
        chat.mount(UserMessage(text))
        chat.mount(view)
        self.active = ActiveReply(view, request, threading.Event(), self.epoch)
        self._generate(self.active)

    @work(thread=True, group="reply")
    def _generate(self, reply: ActiveReply) -> None:
        """Stream ``reply`` in this thread; every batch goes to the UI as a ReplyProgress message."""
        def emit(update: ReplyUpdate) -> None:
            self.post_message(ReplyProgress(reply, update))

        run_reply(self.pipe, reply.request, reply.cancel, emit)

    def on_reply_progress(self, message: ReplyProgress) -> None:
        reply, update = message.reply, message.update
        current = reply.epoch == self.epoch
        if current:
            reply.view.extend(update.tokens, update.tail)
            self.panel.show_snapshot(update.snapshot)
        if update.done:
            self._finished(reply, update, current)

    def _finished(self, reply: ActiveReply, update: ReplyUpdate, current: bool) -> None:
        if self.active is reply:
            self.active = None
        if not current:
            return
        s = update.snapshot
        reply.view.finish(f"{update.finish_reason} · {s.new_tokens} tok · {s.tokens_per_s:.1f} tok/s · τ {s.tau:.2f}")
        if reply.view.text:
            self.history.add("assistant", reply.view.text)
        elif update.error:
            self.history.drop_last()
        if update.error:
            self.query_one("#chat", VerticalScroll).mount(ErrorMessage(update.error))

    def on_reply_view_token_selected(self, message: ReplyView.TokenSelected) -> None:
        self.panel.show_token(message.token)

    def action_cancel_reply(self) -> None:
        """Esc: stop the streaming reply; the worker keeps what was committed."""
        if self.active is not None:
            self.active.cancel.set()

    def action_new_chat(self) -> None:
        """Ctrl+N: cancel any reply, forget the history, clear the screen.

        A cancelled reply stays ``active`` until its worker reports back, so two
        requests never run on the pipeline at once.
        """
        self.action_cancel_reply()
        self.epoch += 1
        if self.history is not None:
            self.history.clear()
            self.panel.show_snapshot(PanelSnapshot(self.pipe.guarantee, self.pipe.speculative))
        self.panel.show_token(None)
        self.query_one("#chat", VerticalScroll).remove_children()
        self.query_one("#prompt", Input).focus()

    def action_toggle_speculation(self) -> None:
        """Ctrl+T: speculate or decode plainly from the next reply on."""
        if self.pipe is None:
            return
        if not self.pipe.speculative:
            self.notify(f"speculation is unavailable in this run ({self.pipe.guarantee})", severity="warning")
            return
        self.speculate = not self.speculate
        self.panel.show_mode(self.speculate, True)
        self.notify(f"next reply: {'speculative' if self.speculate else 'plain decoding'}")

    def action_show_config(self) -> None:
        self.push_screen(ConfigScreen(OmegaConf.to_yaml(self.cfg)))

    def on_unmount(self) -> None:
        self.action_cancel_reply()


def main(argv: list[str] | None = None) -> int:
    """Console entry point: compose the config (errors: one line, status 2), then run the app."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ("-h", "--help") for arg in args):
        print(USAGE, end="")
        return 0
    try:
        cfg = compose_config(args)
    except SpecgenError as exc:
        print(f"specgen-chat: error: {exc}", file=sys.stderr)
        return 2
    app = ChatApp(cfg)
    app.run()
    if app.load_error:
        print(f"specgen-chat: error: {app.load_error}", file=sys.stderr)
        return 2
    return 0
