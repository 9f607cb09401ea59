"""Incremental detokenisation and stop strings over committed tokens.

Only committed tokens are pushed here, so nothing provisional ever reaches the
user; a snapshot/restore pair lets a failed round undo a partial commit.

Detokenisation decodes a short window of recent ids and releases text only when
it does not end in U+FFFD, so a multi-byte character split across tokens is
never emitted broken. Stop strings: text that could still be the start of a
stop string is held back; once a stop string appears, the text before it is
released and the stream stops (nothing past the stop is emitted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

REPLACEMENT = "\ufffd"


@dataclass
class TextState:
    """ids: the committed ids a next push still decodes: the last released piece's (``ids[:read_offset]``,
    context for the decoder) and those not released yet, so the window, and a snapshot of it, stay
    a few tokens long however long the text grows."""

    ids: list[int] = field(default_factory=list)
    read_offset: int = 0
    held: str = ""
    emitted: str = ""
    stopped: bool = False


class TextStream:
    """decode: ids -> text (special tokens skipped). stop: strings that end generation."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.state = TextState()

    def snapshot(self) -> TextState:
        return replace(self.state, ids=list(self.state.ids))

    def restore(self, snapshot: TextState) -> None:
        self.state = replace(snapshot, ids=list(snapshot.ids))

    @property
    def stopped(self) -> bool:
        return self.state.stopped

    @property
    def text(self) -> str:
        """All text released so far."""
        return self.state.emitted

    def push(self, token: int) -> str:
        """Add one committed token; return the text it releases (maybe "")."""
        st = self.state
        if st.stopped:
            return ""
        st.ids.append(token)
        before = self.decode(st.ids[: st.read_offset])
        after = self.decode(st.ids)
        if after.endswith(REPLACEMENT) or len(after) < len(before):
            return ""
        delta = after[len(before) :]
        del st.ids[: st.read_offset]  # decoded for good: the window restarts at the last released token
        st.read_offset = len(st.ids)
        return self._release(delta)

    def flush(self) -> str:
        """At the end of generation: release held text (incomplete characters are dropped)."""
        st = self.state
        if st.stopped:
            return ""
        tail = self.decode(st.ids)[len(self.decode(st.ids[: st.read_offset])) :]
        tail = tail.rstrip(REPLACEMENT)
        out = st.held + tail
        st.held = ""
        st.ids.clear()
        st.read_offset = 0
        st.emitted += out
        return out

    def _release(self, delta: str) -> str:
        st = self.state
        buffer = st.held + delta
        if not self.stop:
            st.emitted += buffer
            st.held = ""
            return buffer
        cut = min((i for i in (buffer.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            st.stopped = True
            st.held = ""
            st.emitted += buffer[:cut]
            return buffer[:cut]
        keep = _longest_stop_prefix_suffix(buffer, self.stop)
        out, st.held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        st.emitted += out
        return out


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
