"""specgen-chat: pure helpers, the worker loop without Textual, and Pilot runs on the tiny models."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import specgen
from specgen.build import build_pipeline
from specgen.config import compose
from specgen.errors import PromptError
from specgen.events import FinishEvent, Generation, TokenEvent
from specgen.tui.app import ChatApp, ConfigScreen, main
from specgen.tui.panel import StatsPanel, bar, guarantee_class, split_cells
from specgen.tui.reply import ErrorMessage, ReplyView, token_class
from specgen.tui.session import ChatHistory, ReplyRequest, run_reply
from specgen.tui.tally import Tally

TINY = ["target=tiny", "drafter=tiny", "threads=1", "sampling.temperature=0.8",
        "sampling.min_new_tokens=40", "max_new_tokens=60"]
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
                 "token--accepted-4": "#C8E6C9", "token--resampled": "#F57C00", "token--bonus": "#1565C0"}


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


def test_token_class_shades_accepted_by_position():
    def view(kind, position):
        return TokenEvent(1, "a", kind, position, None, 1)

    assert token_class(view("accepted", 1)) == "token--accepted-1"
    assert token_class(view("accepted", 9)) == "token--accepted-4"
    assert [token_class(view(k, 2)) for k in ("resampled", "bonus")] == ["token--resampled", "token--bonus"]
    assert token_class(view("plain", None)) == "token--plain"


def test_bars_and_cells():
    assert bar(1.0, 4) == ("████", "")
    assert bar(0.0, 4) == ("", "····")
    assert len("".join(bar(0.37, 10))) == 10
    assert sum(split_cells([0.5, 0.3, 0.15, 0.05], 24)) == 24
    assert split_cells([0, 0], 5) == [0, 0]
    assert [guarantee_class(g) for g in ("exact", "off: drafter=none", "approximate: x", "weird")] == \
        ["-exact", "-off", "-approximate", "-off"]


def test_live_stats_match_the_final_stats(pipe):
    """The Stats the engine fills while streaming is the request's own: live numbers grow, then finish."""
    tally = Tally("exact", True)
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
    assert {t.kind for t in tokens} <= {"accepted", "resampled", "bonus"}
    assert final.snapshot.guarantee == "exact" and final.snapshot.rounds == final.snapshot.target_calls


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

        speculative, guarantee, drafter = True, "exact", None

        def stream(self, prompt, *, max_new_tokens, seed, stop, speculative, stats):
            for index in range(3):
                stats.record_round(2, 1)
                stats.timings.draft += 0.01
                stats.timings.verify += 0.03
                stats.new_tokens += 2
                yield TokenEvent(1, "a", "accepted", 1, 0.9, index + 1)
                yield TokenEvent(2, "b", "resampled", 2, 0.2, index + 1)
            yield FinishEvent("", "length", Generation("ab" * 3, [1, 2] * 3, "exact", "length", stats, [1]))

    updates = []
    final = run_reply(LivePipe(), ReplyRequest("hi", True, seed=0), threading.Event(), updates.append,
                      interval=0.0)
    first = updates[0].snapshot
    assert dict(first.timings)["verify"] == pytest.approx(0.03) and first.rounds == 1
    assert final.snapshot.acceptance == (1.0, 0.0) and final.snapshot.tau == pytest.approx(2.0)


def test_run_reply_reports_errors_without_raising(pipe):
    class Broken:
        speculative, guarantee, drafter = False, "off: test", None

        def stream(self, prompt, **kwargs):
            raise PromptError("the prompt is empty")

    final = run_reply(Broken(), ReplyRequest("", False, seed=0), threading.Event(), lambda u: None)
    assert final.finish_reason == "error" and final.error == "the prompt is empty"


# --- the app ------------------------------------------------------------------------------------

def test_chat_streams_coloured_tokens_and_updates_panel(cfg, tmp_path):
    async def scenario():
        app = ChatApp(cfg)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.pipe is not None)
            assert "EXACT" in panel_text(app, "banner")
            view = await send(pilot, "hello")
            await wait_for(pilot, lambda: app.active is None)
            kinds = {t.kind for t in view.tokens}
            assert "accepted" in kinds and kinds <= {"accepted", "resampled", "bonus"}
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
    async def scenario():
        app = ChatApp(cfg, pipeline=long_pipe)
        async with app.run_test(size=SIZE) as pilot:
            view = await send(pilot, "hi")
            await wait_for(pilot, lambda: len(view.tokens) >= 10)
            await pilot.press("escape")
            await wait_for(pilot, lambda: app.active is None)
            assert view.border_subtitle.startswith("cancelled") and len(view.tokens) < 5000
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


def test_main_reports_bad_override_in_one_line(capsys):
    assert main(["target=no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specgen-chat: error:") and err.count("\n") == 1
    assert main(["--help"]) == 0 and "usage" in capsys.readouterr().out
