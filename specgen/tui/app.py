"""``specgen-chat``: a terminal chat that colours every token by how it was produced.

Threading contract: the models load and every reply streams in Textual thread
workers (:func:`specgen.tui.session.run_reply`); the worker touches the UI only
through ``post_message`` / ``call_from_thread``. Updates are coalesced in the
reply's :class:`~specgen.tui.session.UpdateInbox`: at most one ReplyReady message
waits at a time, so fast tokens never back up the UI's queue. Only one reply
streams at a time; messages sent meanwhile (or while the models load) are queued
and sent in order, each as its own turn. Esc sets the reply's cancel flag and the
worker closes the stream between events. While nothing streams, a pause in typing
(PREPARE_PAUSE) prefills the message so far in a worker (:func:`prepare_reply`), so
sending it prefills only its last words.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Input, TextArea

from specgen.engine.chat import ChatHistory, uses_template
from specgen.config.compose import compose as compose_config
from specgen.errors import SpecgenError
from specgen.config.options import SEED_MAX
from specgen.config.run import RunConfig
from specgen.tui.panel import StatsPanel
from specgen.tui.reply import ErrorMessage, Legend, Notice, ReplyView, UserMessage
from specgen.tui.session import ReplyRequest, ReplyUpdate, UpdateInbox, load_pipeline, prepare_reply, run_reply
from specgen.tui.tally import PanelSnapshot

USAGE = """usage: specgen-chat [key=value ...]

A terminal chat that colours each token by how speculative decoding produced it.
Takes the same Hydra overrides as `specgen`, e.g.
  specgen-chat target=qwen2.5-coder-1.5b drafter=qwen2.5-coder-0.5b sampling.temperature=0.7
prompt=... is sent as the first message; system=... sets the system message.
The chat samples by default (sampling=creative: temperature 0.8, top-k 50, top-p 0.95,
repetition penalty 1.1; speculation stays exact); sampling=default is greedy.
"""


#: Seconds without a keystroke after which the message typed so far is prefilled in the background.
PREPARE_PAUSE = 0.3


@dataclass
class ActiveReply:
    """A reply being generated: its view, what was asked, its cancel flag, chat epoch and inbox.

    dropped: old turns the worker left out to fit the context (applied to the
    history when the reply ends).
    """

    view: ReplyView
    request: ReplyRequest
    cancel: threading.Event
    epoch: int
    inbox: UpdateInbox = field(default_factory=UpdateInbox)
    dropped: int = 0


class ReplyReady(Message):
    """Posted by the reply worker when ``reply``'s inbox went from empty to holding an update."""

    def __init__(self, reply: ActiveReply):
        super().__init__()
        self.reply = reply


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


#: Narrower than this (columns), the side panel starts hidden so the conversation keeps the width.
PANEL_MIN_WIDTH = 80


class ChatApp(App[int]):
    """The chat. ``cfg``: the composed config (shown by Ctrl+G); ``run_config``: its checked
    :class:`RunConfig` (None: checked when the pipeline loads); ``pipeline``: an already built one (tests).

    The side panel shows on terminals at least :data:`PANEL_MIN_WIDTH` columns wide and hides on
    narrower ones; Ctrl+O shows or hides it whatever the width (the choice then holds).
    """

    CSS_PATH = "chat.tcss"
    TITLE = "specgen-chat"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (90, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("escape", "cancel_reply", "Cancel reply"),
        Binding("ctrl+n", "new_chat", "New chat", priority=True),
        Binding("ctrl+o", "toggle_panel", "Panel", priority=True),
        Binding("ctrl+t", "toggle_speculation", "Speculation on/off", priority=True),
        Binding("ctrl+g", "show_config", "Config", priority=True),
    ]

    def __init__(self, cfg, *, pipeline=None, run_config: RunConfig | None = None):
        super().__init__()
        self.cfg = cfg
        self.run_config = run_config
        self.pipe = pipeline
        self.history: ChatHistory | None = None
        self.active: ActiveReply | None = None
        self.speculate = True
        self.epoch = 0
        self.replies = 0
        self.load_error: str | None = None
        self.queued: deque[UserMessage] = deque()
        self.panel_choice: bool | None = None  # Ctrl+O's show (True) / hide (False); None: by width
        self.typing_pause = None  # the timer that prepares the message being typed

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield VerticalScroll(id="chat", can_focus=False)
            yield StatsPanel(id="panel", can_focus=False)
        yield Legend(id="legend")
        yield Input(placeholder="loading the models…", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self._fit_panel()
        self.query_one("#chat", VerticalScroll).anchor()
        self.query_one("#prompt", Input).focus()
        if self.pipe is not None:
            self._on_loaded(self.pipe)
            return
        target = OmegaConf.select(self.cfg, "target.name", default="target")
        drafter = OmegaConf.select(self.cfg, "drafter.kind", default="drafter")
        self.panel.show_banner("loading", f"{target} + {drafter}")
        self._load()

    @property
    def panel(self) -> StatsPanel:
        return self.query_one("#panel", StatsPanel)

    def on_resize(self) -> None:
        self._fit_panel()

    def _fit_panel(self) -> None:
        """Show the panel as Ctrl+O chose, else when the terminal is wide enough for it and the chat."""
        shown = self.size.width >= PANEL_MIN_WIDTH if self.panel_choice is None else self.panel_choice
        self.panel.display = shown

    def action_toggle_panel(self) -> None:
        """Ctrl+O: show or hide the side panel (from then on, whatever the width)."""
        self.panel_choice = not self.panel.display
        self._fit_panel()

    def _show_error(self, text: str) -> None:
        """Add an error to the chat and scroll to it, also when the user had scrolled up."""
        chat = self.query_one("#chat", VerticalScroll)
        chat.mount(ErrorMessage(text))
        chat.anchor()

    @work(thread=True, group="load")
    def _load(self) -> None:
        """Build the pipeline off the UI thread; report success or a one-line error."""
        try:
            pipe = load_pipeline(self.cfg if self.run_config is None else self.run_config)
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
        self._send_queued()

    def _load_failed(self, message: str) -> None:
        self.load_error = message
        self.panel.show_banner("error", "could not start")
        self._show_error(f"{message}\nFix the override and restart; Ctrl+Q quits.")
        prompt = self.query_one("#prompt", Input)
        prompt.placeholder = "unavailable: the models did not load"
        prompt.disabled = True

    @on(Input.Submitted, "#prompt")
    def _submitted(self, event: Input.Submitted) -> None:
        """Enter: send the message, or queue it as its own turn while loading or streaming."""
        text = event.value.strip()
        if not text or self.load_error is not None:
            return
        event.input.clear()
        if self.pipe is None or self.active is not None:
            message = UserMessage(text, queued=True)
            self.queued.append(message)
            self.query_one("#chat", VerticalScroll).mount(message)
            waiting = "the models load" if self.pipe is None else "the current reply ends"
            self.notify(f"queued: sent when {waiting}")
        else:
            self._send(text)

    @on(Input.Changed, "#prompt")
    def _typed(self, event: Input.Changed) -> None:
        """A keystroke: prepare the message so far once typing pauses for PREPARE_PAUSE."""
        if self.typing_pause is not None:
            self.typing_pause.stop()
        self.typing_pause = self.set_timer(PREPARE_PAUSE, lambda: self._prepare(event.value))

    def _prepare(self, text: str) -> None:
        """Prefill ``text`` as the next message, unless a reply streams or waits (it would share the CPU)."""
        if self.pipe is None or self.history is None or self.active is not None or self.queued or not text.strip():
            return
        self._prepare_in_worker(self.history.copy(), text)

    @work(thread=True, group="prepare")
    def _prepare_in_worker(self, history: ChatHistory, text: str) -> None:
        prepare_reply(self.pipe, history, text)

    def _send_queued(self) -> None:
        """Send the oldest queued message, if nothing is streaming."""
        if self.queued and self.active is None and self.pipe is not None:
            message = self.queued.popleft()
            self._send(message.text, message)

    def _send(self, text: str, message: UserMessage | None = None) -> None:
        """Add the user turn, mount an empty reply after it and start the worker.

        message: the turn's widget when it was queued (already on screen).
        """
        self.history.add("user", text)
        speculative = self.speculate and self.pipe.speculative
        seed = (int(self.pipe.defaults.seed) + self.replies) % (SEED_MAX + 1)  # each reply its own seed
        request = ReplyRequest(self.history.copy(), speculative, seed=seed,
                               stop=self.history.stop_strings(self.pipe.defaults.stop))
        self.replies += 1
        view = ReplyView(f"assistant · {'speculative' if speculative else 'plain'}")
        chat = self.query_one("#chat", VerticalScroll)
        if message is None:
            message = UserMessage(text)
            chat.mount(message)
        else:
            message.set_queued(False)
        chat.mount(view, after=message)
        self.active = ActiveReply(view, request, threading.Event(), self.epoch)
        self._generate(self.active)

    @work(thread=True, group="reply")
    def _generate(self, reply: ActiveReply) -> None:
        """Stream ``reply`` in this thread; batches wait in its inbox, one ReplyReady wakes the UI."""
        def emit(update: ReplyUpdate) -> None:
            if reply.inbox.put(update):
                self.post_message(ReplyReady(reply))

        run_reply(self.pipe, reply.request, reply.cancel, emit)

    def on_reply_ready(self, message: ReplyReady) -> None:
        """Draw everything that arrived since the last frame, in one go."""
        reply = message.reply
        update = reply.inbox.take()
        if update is None:
            return
        current = reply.epoch == self.epoch
        if current:
            if update.dropped > reply.dropped:
                self._show_dropped(reply, update.dropped)
            reply.view.extend(update.tokens, update.tail)
            self.panel.show_snapshot(update.snapshot)
        if update.done:
            self._finished(reply, update, current)

    def _show_dropped(self, reply: ActiveReply, dropped: int) -> None:
        reply.dropped = dropped
        context = self.pipe.target.context_length
        turns = "message is" if dropped == 1 else f"{dropped} messages are"
        notice = Notice(f"The chat outgrew the model's context ({context} tokens), so the oldest {turns} "
                        f"left out from now on. Ctrl+N starts a new chat.")
        self.query_one("#chat", VerticalScroll).mount(notice, before=reply.view)

    def _finished(self, reply: ActiveReply, update: ReplyUpdate, current: bool) -> None:
        if self.active is reply:
            self.active = None
        if current:
            s = update.snapshot
            reply.view.finish(f"{update.finish_reason} · {s.new_tokens} tok · {s.tokens_per_s:.1f} tok/s · "
                              f"τ {s.tau:.2f}")
            if not update.error:
                self.history.drop_oldest(reply.dropped)
            if reply.view.text:
                self.history.add("assistant", reply.view.text)
            elif update.error:
                self.history.drop_last()
            if update.error:
                self._show_error(update.error)
        self._send_queued()

    def on_reply_view_token_selected(self, message: ReplyView.TokenSelected) -> None:
        self.panel.show_token(message.token)

    def action_cancel_reply(self) -> None:
        """Esc: stop the streaming reply; the worker keeps what was committed."""
        if self.active is not None:
            self.active.cancel.set()

    def action_new_chat(self) -> None:
        """Ctrl+N: cancel any reply, forget the history and queued messages, clear the screen.

        A cancelled reply stays ``active`` until its worker reports back, so two
        requests never run on the pipeline at once; a message sent meanwhile waits.
        """
        self.action_cancel_reply()
        self.epoch += 1
        self.queued.clear()
        if self.history is not None:
            self.history.clear()
            self.panel.show_snapshot(PanelSnapshot(self.pipe.guarantee, self.pipe.speculative))
        self.panel.show_token(None)
        chat = self.query_one("#chat", VerticalScroll)
        chat.remove_children()
        chat.anchor()  # the new chat follows its replies again, also if the old one was scrolled up
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


def chat_configs(args: list[str]) -> tuple[DictConfig, RunConfig]:
    """The chat's composed config (conf/chat.yaml: specgen's config, sampling by default) and the
    run's one RunConfig checked from it; ConfigError if bad."""
    cfg = compose_config(args, "chat")
    return cfg, RunConfig.from_cfg(cfg)


def chat_config(args: list[str]) -> DictConfig:
    """The chat's composed config, checked (:func:`chat_configs`)."""
    return chat_configs(args)[0]


def main(argv: list[str] | None = None) -> int:
    """Console entry point: compose the config (errors: one line, status 2), then run the app."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ("-h", "--help") for arg in args):
        print(USAGE, end="")
        return 0
    try:
        cfg, run_config = chat_configs(args)
    except SpecgenError as exc:
        print(f"specgen-chat: error: {exc}", file=sys.stderr)
        return 2
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("specgen-chat: error: needs an interactive terminal (stdin or stdout is redirected); "
              "for scripts use `specgen prompt=...`", file=sys.stderr)
        return 2
    app = ChatApp(cfg, run_config=run_config)
    app.run()
    if app.load_error:
        print(f"specgen-chat: error: {app.load_error}", file=sys.stderr)
        return 2
    return 0
