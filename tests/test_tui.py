"""specgen-chat: pure helpers, the worker loop without Textual, and Pilot runs on the tiny models.

No test here depends on how fast the machine is: a reply that must still be
streaming when a key is pressed is held by a gate in its stream (GatedPipe), or
never ends on its own (FloodPipe), instead of being merely long.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import pty
import subprocess
import sys
import threading
import time

import pytest

import specgen
from specgen.engine.assemble import build_pipeline
from specgen.config.compose import compose
from specgen.engine.chat import ChatHistory
from specgen.errors import PromptError
from specgen.events import FinishEvent, Generation, TokenEvent
from specgen.guarantee import Guarantee
from specgen.tui import app as app_module
from specgen.tui.app import ChatApp, ConfigScreen, chat_config, main
from specgen.tui.panel import StatsPanel, bar, guarantee_class, split_cells, token_content
from specgen.tui.reply import ErrorMessage, Notice, ReplyView, UserMessage, token_class
from specgen.tui.session import ReplyRequest, ReplyUpdate, UpdateInbox, fit_history, prepare_reply, run_reply
from specgen.tui.tally import PanelSnapshot, Tally

TINY = ["target=tiny", "drafter=tiny", "threads=1", "invariant_verify=true", "sampling.temperature=0.8",
        "sampling.min_new_tokens=40", "max_new_tokens=60"]  # invariant_verify: an exact path, as conftest's TINY
LONG = [*TINY[:-2], "sampling.min_new_tokens=5000", "max_new_tokens=5000"]
SIZE = (80, 24)


@pytest.fixture(scope="module")
def cfg():
    return compose(TINY)


@pytest.fixture(scope="module")
def pipe(cfg):
    return build_pipeline(cfg, progress=False)


@pytest.fixture(scope="module")
def long_pipe():
    return specgen.pipeline(*LONG, progress=False)


class GatedPipe:
    """A real pipeline whose streams stop after ``after`` tokens until ``gate`` is set.

    ``paused`` is set when a stream reaches the gate, so a test can act while a
    reply is certainly still streaming, however fast the machine is. Everything
    else is the real pipeline's.
    """

    def __init__(self, pipe, after: int = 10):
        self.pipe, self.after = pipe, after
        self.gate, self.paused = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.pipe, name)

    def stream(self, *args, **kwargs):
        events = self.pipe.stream(*args, **kwargs)  # arguments are checked here, as by the real one

        def gated():
            try:
                for index, event in enumerate(events):
                    if index == self.after and not self.gate.is_set():
                        self.paused.set()
                        assert self.gate.wait(60), "the test never opened the gate"
                    yield event
            finally:
                events.close()

        return gated()


class FloodPipe(GatedPipe):
    """A real pipeline whose streams yield made-up tokens until closed, about a thousand a second
    (a GPU's pace: dozens per frame), never ending on their own."""

    def stream(self, prompt, options):
        stats = options.stats

        def flood():
            for index in range(10**9):
                time.sleep(0.001)
                stats.record_round(1, 1)
                stats.new_tokens += 1
                yield TokenEvent(5, "a", "accepted", 1, 1.0, index + 1)

        return flood()


async def wait_for(pilot, predicate, timeout: float = 60.0) -> None:
    """Let the app run until ``predicate()`` holds (fails the test after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the app"
        await pilot.pause(0.05)


async def send(pilot, text: str) -> ReplyView:
    """Type ``text``, press Enter, return the new reply's view."""
    before = len(pilot.app.query(ReplyView))
    await pilot.click("#prompt")
    await pilot.press(*text, "enter")
    await wait_for(pilot, lambda: len(pilot.app.query(ReplyView)) > before)
    return pilot.app.query(ReplyView).last()


#: Backgrounds chat.tcss gives each kind (shades of green by draft position).
TOKEN_COLOURS = {"token--accepted-1": "#1B5E20", "token--accepted-2": "#388E3C", "token--accepted-3": "#81C784",
                 "token--accepted-4": "#C8E6C9", "token--resampled": "#F57C00", "token--bonus": "#1565C0",
                 "token--plain": "#121212"}


def token_backgrounds(view: ReplyView) -> set[str]:
    """Background colours of the token spans as rendered."""
    return {span.style.background.hex for span in view.render().spans if span.style.background}


def panel_text(app, widget_id: str) -> str:
    return str(app.query_one(StatsPanel).query_one(f"#{widget_id}").render())


# --- pure helpers -------------------------------------------------------------------------------

def test_history_prompt_with_and_without_template():
    history = ChatHistory(use_template=False)
    history.add("user", "hi")
    history.add("assistant", "hello")
    history.add("user", "more")
    assert history.prompt() == "User: hi\nAssistant: hello\nUser: more\nAssistant:"
    assert history.stop_strings(("x",)) == ("x", "\nUser:")
    templated = ChatHistory(use_template=True, messages=list(history.messages))
    assert templated.prompt() == history.messages and templated.stop_strings(("x",)) == ("x",)


class CharPipe:
    """Just enough pipeline for fit_history: one token per character of the text."""

    def __init__(self, context: int, max_new_tokens: int):
        self.target = type("Target", (), {"context_length": context})()
        self.defaults = type("Defaults", (), {"max_new_tokens": max_new_tokens})()

    def encode(self, prompt):
        return list(prompt) if isinstance(prompt, str) else [c for m in prompt for c in m["content"]]


def conversation(use_template: bool = True) -> ChatHistory:
    history = ChatHistory(use_template)
    history.add("system", "S" * 10)
    for role, letter in zip(["user", "assistant"] * 2 + ["user"], "abcde"):
        history.add(role, letter * 30)
    return history


@pytest.mark.parametrize(("context", "dropped", "kept"), [
    (200, 0, "Sabcde"),  # 160 tokens + 40 for the reply fit
    (150, 2, "Scde"),    # a reply keeps min(40, 150 // 4) = 37 free
    (60, 4, "Se"),
    (45, 4, "Se"),       # the last message fits only with less room for the reply: sent as is
])
def test_fit_history_drops_oldest_turns_keeping_the_system_message(context, dropped, kept):
    history = conversation()
    prompt, count = fit_history(CharPipe(context, 40), history)
    assert count == dropped and "".join(m["content"][0] for m in prompt) == kept
    assert len(history.messages) == 6  # the caller's history is untouched
    history.drop_oldest(count)
    assert history.prompt() == prompt


def test_fit_history_refuses_a_message_longer_than_the_context():
    with pytest.raises(PromptError, match="context is 40; shorten it .Ctrl.N starts a new chat"):
        fit_history(CharPipe(40, 40), conversation())


def test_dropping_keeps_a_user_turn_first_and_transcripts_keep_the_system_line():
    history = ChatHistory(use_template=False)
    for role, text in [("system", "be brief"), ("user", "u1"), ("user", "u2"), ("assistant", "a2"), ("user", "u3")]:
        history.add(role, text)
    assert history.droppable() == [0, 1, 3]
    assert history.prompt(3) == "System: be brief\nUser: u3\nAssistant:"


def test_token_class_shades_accepted_by_position():
    def view(kind, position):
        return TokenEvent(1, "a", kind, position, None, 1)

    assert token_class(view("accepted", 1)) == "token--accepted-1"
    assert token_class(view("accepted", 9)) == "token--accepted-4"
    assert [token_class(view(k, 2)) for k in ("resampled", "bonus")] == ["token--resampled", "token--bonus"]
    assert token_class(view("plain", None)) == "token--plain"


def test_a_token_from_a_round_that_drafted_nothing_is_plain_not_bonus():
    """The ngram drafter has nothing to propose before the text repeats: those rounds verify no draft,
    and their token is the target's own, shown as "plain" (not "bonus · draft pos 1")."""
    ngram = specgen.pipeline("target=tiny", "drafter=ngram", "threads=1", progress=False)
    events = [e for e in ngram.stream("hello hello", specgen.RequestOptions(max_new_tokens=60, seed=0))
              if isinstance(e, TokenEvent)]
    undrafted = [e for e in events if e.gamma == 0]
    assert undrafted and any(e.kind in ("accepted", "bonus") for e in events)  # both kinds of round ran
    assert {(e.kind, e.draft_position, e.accept_prob) for e in undrafted} == {("plain", None, None)}
    details = str(token_content(undrafted[0]))
    assert "plain · draft pos —" in details and "γ 0" in details and "bonus" not in details
    assert token_class(undrafted[0]) == "token--plain"


def test_bars_and_cells():
    assert bar(1.0, 4) == ("████", "")
    assert bar(0.0, 4) == ("", "····")
    assert len("".join(bar(0.37, 10))) == 10
    assert sum(split_cells([0.5, 0.3, 0.15, 0.05], 24)) == 24
    assert split_cells([0, 0], 5) == [0, 0]
    assert [guarantee_class(g) for g in ("exact", "off", "approximate", "loading", "weird")] == \
        ["-exact", "-off", "-approximate", "-loading", "-off"]


def test_live_stats_match_the_final_stats(pipe):
    """The Stats the engine fills while streaming is the request's own: live numbers grow, then finish."""
    tally = Tally(Guarantee("exact"), True)
    seen_rounds = []
    for event in pipe.stream("User: hi\nAssistant:", seed=3, max_new_tokens=50, stats=tally.live):
        if isinstance(event, FinishEvent):
            final = event.generation.stats
        else:
            seen_rounds.append(tally.snapshot().rounds)
    assert final is tally.live
    assert seen_rounds == sorted(seen_rounds) and seen_rounds[-1] == final.rounds
    tally.finish(final)
    snap = tally.snapshot("eos")
    assert snap.tau == pytest.approx(final.tokens_per_target_call) and [t for t, _ in snap.timings][-1] == "state"


# --- the worker loop, without Textual -------------------------------------------------------------

def test_run_reply_streams_batches_and_finishes(pipe):
    updates = []
    request = ReplyRequest("User: hi\nAssistant:", True, seed=0, stop=("\nUser:",))
    final = run_reply(pipe, request, threading.Event(), updates.append, interval=0.0)
    assert final.done and updates[-1] is final and len(updates) > 2
    tokens = [t for u in updates for t in u.tokens]
    assert len(tokens) == final.snapshot.new_tokens
    assert tokens[0].kind == "plain"  # the prefill round drafts nothing (planned, auto)
    assert {t.kind for t in tokens[1:]} <= {"accepted", "resampled", "bonus"}
    assert str(final.snapshot.guarantee) == "exact" and final.snapshot.rounds == final.snapshot.target_calls


def test_run_reply_cancel_keeps_partial_and_engine_usable(long_pipe):
    cancel = threading.Event()
    seen = []

    def emit(update):
        seen.extend(update.tokens)
        if len(seen) >= 20:
            cancel.set()

    final = run_reply(long_pipe, ReplyRequest("hello", True, seed=0), cancel, emit, interval=0.0)
    assert final.finish_reason == "cancelled" and 20 <= len(seen) < 100
    again = long_pipe.generate("hello", seed=0, max_new_tokens=30)
    assert len(again.token_ids) == 30


def test_run_reply_uses_live_engine_stats_when_offered():
    class LivePipe:
        """An engine whose stream fills the caller's Stats (timings included) as rounds commit."""

        speculative, guarantee, drafter = True, Guarantee("exact"), None

        def stream(self, prompt, options):
            stats = options.stats
            for index in range(3):
                stats.record_round(2, 1)
                stats.timings.draft += 0.01
                stats.timings.verify += 0.03
                stats.new_tokens += 2
                yield TokenEvent(1, "a", "accepted", 1, 0.9, index + 1)
                yield TokenEvent(2, "b", "resampled", 2, 0.2, index + 1)
            yield FinishEvent("", "length", Generation("ab" * 3, [1, 2] * 3, Guarantee("exact"), "length", stats, [1]))

    updates = []
    final = run_reply(LivePipe(), ReplyRequest("hi", True, seed=0), threading.Event(), updates.append,
                      interval=0.0)
    first = updates[0].snapshot
    assert dict(first.timings)["verify"] == pytest.approx(0.03) and first.rounds == 1
    assert final.snapshot.acceptance == (1.0, 0.0) and final.snapshot.tau == pytest.approx(2.0)


def test_run_reply_reports_errors_without_raising(pipe):
    class Broken:
        speculative, guarantee, drafter = False, Guarantee.off("test"), None

        def stream(self, prompt, options):
            raise PromptError("the prompt is empty")

    final = run_reply(Broken(), ReplyRequest("", False, seed=0), threading.Event(), lambda u: None)
    assert final.finish_reason == "error" and final.error == "the prompt is empty"


# --- the app ------------------------------------------------------------------------------------

def test_chat_streams_coloured_tokens_and_updates_panel(cfg, tmp_path):
    async def scenario():
        app = ChatApp(cfg)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.pipe is not None)
            assert "EXACT" in panel_text(app, "banner") and "vs torch (float32)" in panel_text(app, "banner")
            view = await send(pilot, "hello")
            await wait_for(pilot, lambda: app.active is None)
            kinds = {t.kind for t in view.tokens}
            assert "accepted" in kinds and kinds <= {"plain", "accepted", "resampled", "bonus"}
            assert view.tokens[0].kind == "plain"  # the prefill round drafts nothing
            assert token_backgrounds(view) == {TOKEN_COLOURS[token_class(t)] for t in view.tokens if t.text}
            assert "rounds" in panel_text(app, "numbers") and " 1 " in panel_text(app, "acceptance")
            assert "draft" in panel_text(app, "timings")
            assert app.history.messages[-1] == {"role": "assistant", "content": view.text}
            await pilot.press("tab")
            assert app.focused is view and view.selected == len(view.tokens) - 1
            await pilot.press("home", "right")
            token = view.tokens[1]
            details = panel_text(app, "token")
            assert f"round {token.round}" in details and token.kind in details
            await pilot.click("#prompt")
            await pilot.click(ReplyView, offset=(2, 1))  # past border and padding: the first token
            assert view.selected == 0 and app.focused is view
            path = app.save_screenshot("chat.svg", str(tmp_path))
            return open(path, encoding="utf-8").read()

    svg = asyncio.run(scenario())
    for text in ("EXACT", "acceptance", "assistant", "resampled", "bonus", "selected", "Cancel"):
        assert text in svg
    assert "#1b5e20" in svg.lower()  # accepted-at-position-1 shade on screen


def test_cancel_new_chat_and_toggle_speculation(cfg, long_pipe):
    gated = GatedPipe(long_pipe, after=10)

    async def scenario():
        app = ChatApp(cfg, pipeline=gated)
        async with app.run_test(size=SIZE) as pilot:
            view = await send(pilot, "hi")
            await wait_for(pilot, gated.paused.is_set)
            await pilot.press("escape")
            assert app.active is not None and app.active.cancel.is_set()
            gated.gate.set()
            await wait_for(pilot, lambda: app.active is None)
            assert view.border_subtitle.startswith("cancelled")
            assert len(view.tokens) == gated.after + 1  # the stream closes at the first event after Esc
            assert app.history.messages[-1]["content"] == view.text != ""
            await pilot.press("ctrl+n")
            await pilot.pause()
            assert not app.query(ReplyView) and app.history.messages == []
            await pilot.press("ctrl+t")
            assert "plain" in panel_text(app, "mode")
            plain = await send(pilot, "again")
            await wait_for(pilot, lambda: len(plain.tokens) >= 5)
            assert "OFF" in panel_text(app, "banner") and "plain" in plain.border_title
            await pilot.press("ctrl+n")
            await wait_for(pilot, lambda: app.active is None)
            assert {t.kind for t in plain.tokens} == {"plain"} and not app.query(ReplyView)

    asyncio.run(scenario())


def test_escape_is_handled_while_tokens_flood_in(cfg, pipe):
    """A stream that never ends on its own: Esc must still get through, and the UI draws in batches."""
    flood = FloodPipe(pipe)

    async def scenario():
        app = ChatApp(cfg, pipeline=flood)
        async with app.run_test(size=SIZE) as pilot:
            view = await send(pilot, "hi")
            await wait_for(pilot, lambda: len(view.tokens) >= 10)
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.active is None)
            assert view.border_subtitle.startswith("cancelled")
            assert app.history.messages[-1] == {"role": "assistant", "content": view.text}
            assert view.text == "a" * len(view.tokens)

    asyncio.run(scenario())


def test_reply_view_restyles_only_what_changed_and_stays_right(cfg, pipe):
    """Styled tokens are cached between frames: new tokens and a moved selection must still show."""
    selected = "#D500F9"

    def spans(view):
        return [(view.render().plain[s.start:s.end], s.style.background.hex) for s in view.render().spans
                if s.style.background]

    async def scenario():
        app = ChatApp(cfg, pipeline=pipe)
        async with app.run_test(size=SIZE):
            view = ReplyView("test")
            await app.query_one("#chat").mount(view)
            view.extend([TokenEvent(1, "a", "accepted", 1, 0.9, 1), TokenEvent(2, "b", "bonus", None, None, 1)])
            assert [c for _, c in spans(view)] == [TOKEN_COLOURS["token--accepted-1"], TOKEN_COLOURS["token--bonus"]]
            view.select(0)
            assert [c for _, c in spans(view)] == [selected, TOKEN_COLOURS["token--bonus"]]
            view.extend([TokenEvent(3, "c", "resampled", 2, 0.1, 2)])
            view.select(2)
            assert [c for _, c in spans(view)] == [TOKEN_COLOURS["token--accepted-1"], TOKEN_COLOURS["token--bonus"],
                                                   selected]

    asyncio.run(scenario())


def test_update_inbox_wakes_the_ui_once_and_merges():
    inbox = UpdateInbox()
    snap = PanelSnapshot(Guarantee("exact"), True)
    one, two = (TokenEvent(i, str(i), "bonus", None, None, i) for i in (1, 2))
    assert inbox.put(ReplyUpdate((one,), snap)) is True
    assert inbox.put(ReplyUpdate((two,), snap, dropped=2)) is False
    assert inbox.put(ReplyUpdate((), snap, "eos", tail="!")) is False
    merged = inbox.take()
    assert merged.tokens == (one, two) and merged.done and merged.tail == "!" and merged.dropped == 2
    assert inbox.take() is None and inbox.put(ReplyUpdate((), snap)) is True


def test_messages_sent_while_a_reply_streams_are_queued_as_their_own_turns(cfg, pipe):
    """Enter, a second message and Enter straight away: two turns, never "firstsecond"."""
    gated = GatedPipe(pipe, after=5)

    async def scenario():
        app = ChatApp(cfg, pipeline=gated)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.click("#prompt")
            await pilot.press(*"first", "enter", *"second", "enter")
            assert app.query_one("#prompt").value == ""
            queued = [m for m in app.query(UserMessage) if m.queued]
            assert [m.text for m in queued] == ["second"]
            gated.gate.set()
            await wait_for(pilot, lambda: app.active is None and not app.queued and len(app.query(ReplyView)) == 2)
            users = [m["content"] for m in app.history.messages if m["role"] == "user"]
            assert users == ["first", "second"] and not any(m.queued for m in app.query(UserMessage))
            assert [m["role"] for m in app.history.messages] == ["user", "assistant", "user", "assistant"]
            order = [type(w).__name__ for w in app.query_one("#chat").children]
            assert order == ["UserMessage", "ReplyView", "UserMessage", "ReplyView"]

    asyncio.run(scenario())


class PreparingPipe(GatedPipe):
    """A GatedPipe that records each prompt it is asked to prepare, then prepares it on the real pipeline."""

    def __init__(self, pipe, after: int = 10):
        super().__init__(pipe, after)
        self.prepared: list = []

    def prepare(self, prompt, **kwargs):
        self.prepared.append(prompt)
        return self.pipe.prepare(prompt, **kwargs)


def test_a_pause_in_typing_prepares_the_message_so_far_but_not_while_a_reply_streams(cfg, pipe):
    spy = PreparingPipe(pipe, after=5)

    async def scenario():
        app = ChatApp(cfg, pipeline=spy)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.click("#prompt")
            await pilot.press(*"hello the")
            await wait_for(pilot, lambda: spy.prepared and "hello the" in str(spy.prepared[-1]))
            draft = app.history.copy()
            draft.add("user", "hello the")
            expected, _ = fit_history(pipe, draft)
            assert spy.prepared[-1] == expected  # the prompt the message will be sent as, so far
            await pilot.press("r", "e", "enter")
            await wait_for(pilot, spy.paused.is_set)
            before = len(spy.prepared)
            app._prepare("more words")  # what a pause in typing calls: refused while the reply streams
            await pilot.press(*"more")
            await pilot.pause(3 * app_module.PREPARE_PAUSE)
            assert len(spy.prepared) == before
            spy.gate.set()
            await wait_for(pilot, lambda: app.active is None)
            app._prepare("more words")
            # the typing pause's own timer for "more" may fire now too on a slow machine: wait for this call's prompt
            await wait_for(pilot, lambda: any("more words" in str(p) for p in spy.prepared[before:]))
            assert all("hello there" in str(p) for p in spy.prepared[before:])

    asyncio.run(scenario())


def test_preparing_a_message_never_raises_into_the_app(pipe):
    """A failure in the background prefill (here the pipeline's prepare raising) prepares nothing;
    the app's worker must not see it, since an uncaught worker error ends a Textual app."""
    class Failing(PreparingPipe):
        def prepare(self, prompt, **kwargs):
            super().prepare(prompt, **kwargs)
            raise RuntimeError("the target failed")

    spy = Failing(pipe)
    history = ChatHistory(False)
    prepare_reply(spy, history, "hello the")
    assert spy.prepared and history.messages == []  # it was called, it raised, nothing escaped
    prepare_reply(spy, history, "a " * 100_000)  # too long for the context: refused before prepare
    assert len(spy.prepared) == 1


def test_messages_typed_while_the_models_load_are_queued(cfg, pipe, monkeypatch):
    loaded = threading.Event()

    def slow_load(_cfg):
        assert loaded.wait(60)
        return pipe

    monkeypatch.setattr(app_module, "load_pipeline", slow_load)

    async def scenario():
        app = ChatApp(cfg)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.click("#prompt")
            await pilot.press(*"one", "enter", *"two", "enter")
            assert app.pipe is None and [m.text for m in app.queued] == ["one", "two"]
            loaded.set()
            await wait_for(pilot, lambda: app.active is None and not app.queued and len(app.query(ReplyView)) == 2)
            assert [m["content"] for m in app.history.messages if m["role"] == "user"] == ["one", "two"]

    asyncio.run(scenario())


def test_reply_seeds_wrap_around_at_the_largest_seed(cfg, pipe):
    """Each reply uses seed + n; with seed=2**64-1 the second reply must not fail on an invalid seed."""
    largest = GatedPipe(pipe)
    largest.gate.set()
    largest.defaults = dataclasses.replace(pipe.defaults, seed=2**64 - 1)

    async def scenario():
        app = ChatApp(cfg, pipeline=largest)
        async with app.run_test(size=SIZE) as pilot:
            for text in ("one", "two"):
                app.query_one("#prompt").value = text
                await pilot.press("enter")
                await wait_for(pilot, lambda: app.active is None)
            assert not app.query(ErrorMessage) and len(app.history.messages) == 4

    asyncio.run(scenario())


def test_long_chat_drops_the_oldest_turns_and_says_so(cfg, pipe):
    """tiny encodes one token per character; its context is 512 and a reply keeps 60 free."""
    async def scenario():
        app = ChatApp(cfg, pipeline=pipe)
        async with app.run_test(size=SIZE) as pilot:
            prompt = app.query_one("#prompt")
            for letter in "abc":
                prompt.value = letter * 150
                await pilot.press("enter")
                await wait_for(pilot, lambda: app.active is None)
                assert not app.query(ErrorMessage)
            notice = str(app.query_one(Notice).render())
            assert "context" in notice and "Ctrl+N" in notice
            users = [m["content"][0] for m in app.history.messages if m["role"] == "user"]
            assert users == ["b", "c"] and app.history.messages[0]["role"] == "user"
            assert len(pipe.encode(app.history.prompt())) <= 512

    asyncio.run(scenario())


def test_config_view_first_prompt_and_reply_error(pipe):
    async def scenario():
        app = ChatApp(compose([*TINY, "prompt=hi there"]), pipeline=pipe)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.active is None and app.query(ReplyView))
            assert app.history.messages[0] == {"role": "user", "content": "hi there"}
            await pilot.press("ctrl+g")
            assert isinstance(app.screen, ConfigScreen) and "drafter:" in app.screen.yaml_text
            await pilot.press("escape")
            assert not isinstance(app.screen, ConfigScreen)
            app.query_one("#prompt").value = "x" * 600  # longer than tiny's 512-token context
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.query(ErrorMessage))
            assert "context" in str(app.query_one(ErrorMessage).render()) and len(app.history.messages) == 2

    asyncio.run(scenario())


def _shows(app, widget) -> bool:
    """Whether ``widget`` lies inside the chat's viewport, at least two columns and a row of it."""
    chat = app.query_one("#chat").region
    return widget.region.width >= 2 and chat.intersection(widget.region).area > 0


def test_narrow_terminals_hide_the_panel_and_ctrl_o_toggles_it(cfg, pipe):
    async def scenario(size):
        app = ChatApp(cfg, pipeline=pipe)
        async with app.run_test(size=size) as pilot:
            view = await send(pilot, "hello")
            await wait_for(pilot, lambda: app.active is None)
            await pilot.pause()
            seen = (app.panel.display, app.query_one("#chat").region.width, _shows(app, view))
            await pilot.press("ctrl+o")
            await pilot.pause()
            toggled = (app.panel.display, app.query_one("#chat").region.width)
            if size == (60, 20):  # the choice holds when the terminal grows or shrinks again
                await pilot.resize_terminal(100, 30)
                await pilot.pause()
                assert app.panel.display and app.query_one("#chat").region.width == 100 - 38
                await pilot.press("ctrl+o")
                await pilot.resize_terminal(60, 20)
                await pilot.pause()
                assert not app.panel.display
            return seen, toggled

    assert asyncio.run(scenario((80, 24))) == ((True, 50, True), (False, 80))  # wide enough: shown
    assert asyncio.run(scenario((60, 20))) == ((False, 60, True), (True, 30))
    assert asyncio.run(scenario((30, 10)))[0] == (False, 30, True)


def test_an_error_is_scrolled_into_view_also_after_scrolling_up_and_new_chat(cfg, pipe):
    async def scenario():
        app = ChatApp(cfg, pipeline=pipe)
        async with app.run_test(size=SIZE) as pilot:
            chat = app.query_one("#chat")
            while not chat.max_scroll_y:  # a chat taller than its view
                await send(pilot, "hello again")
                await wait_for(pilot, lambda: app.active is None)
                await pilot.pause()
            chat.scroll_home(animate=False)  # the user scrolls up to read: the chat stops following
            await pilot.pause()
            assert chat.scroll_y < chat.max_scroll_y
            await pilot.press("ctrl+n")
            await send(pilot, "hi")
            await wait_for(pilot, lambda: app.active is None)
            app.query_one("#prompt").value = "x" * 600  # longer than tiny's context: an error
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.query(ErrorMessage))
            await pilot.pause()
            assert chat.max_scroll_y > 0 and _shows(app, app.query(ErrorMessage).last())
            chat.scroll_home(animate=False)  # scrolled up again, then a second error: it shows too
            await pilot.pause()
            assert chat.scroll_y < chat.max_scroll_y
            app.query_one("#prompt").value = "y" * 600
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(app.query(ErrorMessage)) == 2)
            await pilot.pause()
            assert _shows(app, app.query(ErrorMessage).last())

    asyncio.run(scenario())


def test_load_error_is_shown_in_the_app():
    async def error_scenario():
        app = ChatApp(compose([*TINY, "sampling.temperature=-1"]))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.load_error is not None)
            await pilot.pause()
            message = str(app.query_one(ErrorMessage).render())
            assert "temperature" in message and "Traceback" not in message
            assert "ERROR" in panel_text(app, "banner")

    asyncio.run(error_scenario())


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("redirected", ["stdin", "stdout"])
def test_main_refuses_to_run_without_a_terminal(redirected, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", FakeTerminal())
    monkeypatch.setattr(sys, "stdout", FakeTerminal())
    monkeypatch.setattr(sys, redirected, io.StringIO())
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specgen-chat: error:") and "terminal" in err and err.count("\n") == 1


def test_chat_with_stdin_from_dev_null_exits_at_once():
    """``specgen-chat </dev/null`` used to spin forever. stdout is a real terminal (a pty) here, so only
    the redirected stdin can make it stop."""
    leader, follower = pty.openpty()
    try:
        done = subprocess.run([sys.executable, "-c", "from specgen.tui.app import main; raise SystemExit(main())"],
                              stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    finally:
        os.close(follower)
        os.close(leader)
    assert done.returncode == 2 and "terminal" in done.stderr and "Traceback" not in done.stderr


def test_main_reports_bad_override_in_one_line(capsys):
    assert main(["target=no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specgen-chat: error:") and err.count("\n") == 1
    assert "no-such-model" in err and "terminal" not in err  # the override, not the missing terminal
    assert main(["--help"]) == 0 and "usage" in capsys.readouterr().out



def test_chat_samples_by_default_and_greedy_is_one_override_away():
    cfg = chat_config([])
    assert cfg.sampling.temperature == 0.8 and cfg.sampling.top_k == 50 and cfg.sampling.repetition_penalty == 1.1
    assert cfg.target.name == compose([]).target.name  # the rest is specgen's own config
    assert chat_config(["sampling=default"]).sampling.temperature == 0.0
    tuned = chat_config(["sampling.temperature=0.3"])
    assert tuned.sampling.temperature == 0.3 and tuned.sampling.top_p == 0.95  # an override lands on the chat preset
    assert compose([]).sampling.temperature == 0.0  # `specgen` itself stays greedy


def test_chat_default_sampling_keeps_speculation_exact():
    pipe = build_pipeline(chat_config(["target=tiny", "drafter=tiny", "threads=1", "invariant_verify=true"]))
    assert pipe.speculative and str(pipe.guarantee) == "exact"
