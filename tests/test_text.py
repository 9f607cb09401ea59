"""Incremental detokenisation and stop strings (byte-level ids: id = one UTF-8 byte)."""

from __future__ import annotations

import pytest

from specgen.text import TextStream

TEXT = "héllo wörld, 世界 🙂 done"


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def push_all(stream, text):
    pieces = [stream.push(b) for b in text.encode("utf-8")]
    return pieces + [stream.flush()]


def test_never_emits_broken_characters():
    pieces = push_all(TextStream(byte_decode), TEXT)
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.parametrize("stop", ["wörld", "界 🙂", "o w", "d, 世"])
def test_stop_string_spanning_tokens(stop):
    stream = TextStream(byte_decode, [stop, "never"])
    pieces = push_all(stream, TEXT)
    assert stream.stopped
    assert "".join(pieces) == TEXT[: TEXT.index(stop)]
    assert stream.text == TEXT[: TEXT.index(stop)]


def test_earliest_of_several_stops_wins():
    stream = TextStream(byte_decode, ["🙂", "wör"])
    assert "".join(push_all(stream, TEXT)) == "héllo "


def test_held_prefix_is_released_when_no_stop_follows():
    stream = TextStream(byte_decode, ["done!"])
    pieces = push_all(stream, TEXT)
    assert "".join(pieces) == TEXT
    assert pieces[-1] == "done"  # held back until the end, then flushed


def test_nothing_after_stop():
    stream = TextStream(byte_decode, ["l"])
    push_all(stream, "hel")
    assert stream.push(ord("x")) == ""
    assert stream.text == "he"


def test_snapshot_restore():
    stream = TextStream(byte_decode, ["zz"])
    for b in "abz".encode():
        stream.push(b)
    snap = stream.snapshot()
    stream.push(ord("z"))
    assert stream.stopped
    stream.restore(snap)
    assert not stream.stopped
    assert stream.push(ord("q")) == "zq"


def test_the_decode_window_stays_short_over_a_long_stream():
    """Only ids not yet decoded for good are kept, so a step's work and snapshot do not grow with the text."""
    stream = TextStream(byte_decode)
    text = ("héllo 世界 " * 300).encode("utf-8")
    longest = 0
    pieces = []
    for b in text:
        pieces.append(stream.push(b))
        longest = max(longest, len(stream.state.ids))
    pieces.append(stream.flush())
    assert "".join(pieces) == text.decode("utf-8")
    assert longest <= 8  # the last released piece and the character being completed, 4 bytes at most each
    assert len(stream.snapshot().ids) <= 8
