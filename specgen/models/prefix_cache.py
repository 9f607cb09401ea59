"""A pipeline's prefix cache: finished requests' KV handles, parked for the next request to start from.

When a request ends normally its target handle (a :class:`~specgen.models.target.TokenCache`
holding only committed entries: every commit syncs it to the committed ids) is parked
here instead of released. A new request takes the parked handle whose ``tokens`` share
the longest common prefix with its prompt ids (ties: the most recently parked), syncs it
to them (:meth:`TokenCache.sync` crops the rest) and prefills only what is not cached.

Contract: a handle is owned by exactly one request at a time. :meth:`PrefixCache.acquire`
removes the handle it returns from the cache, so a request's rollbacks and crops never
touch entries another request reads; nothing is shared between live requests.

Bounds: at most ``entries`` handles and ``max_bytes`` bytes of KV
(:meth:`TokenCache.held_bytes`) are parked; the least recently parked go first and are
released (:meth:`TokenCache.release`). ``entries=0`` turns the cache off (every handle is
released at once, every request starts empty). A backend whose logits after a cached
prefix are not bit for bit those of a fresh prefill declares ``Capabilities.prefix_reuse``
False: the cache is then off on it. Every method is thread safe.

A parked handle may be **settled** in the background: a thread of its own syncs it to the ids the
next request is expected to start with and feeds what it does not hold in one prefill. For a chat
those ids are the next turn's (``ahead``): the conversation as the chat template renders it, the
reply included (a reply the tokenizer splits otherwise than the model generated it is re-fed as
rendered), up to the next user message's content, so the next turn prefills only that message and
the generation prompt. It runs while the handle is parked, that is while the user reads the reply
and writes the next message; a request that takes the handle before then waits for it. A settle
writes entries as a prefill does, so a request served from them gets a fresh prefill's logits
wherever the target declares ``prefix_reuse``.

A request still being written can be **prepared** (:meth:`PrefixCache.prepare`): the ids its prompt
is expected to start with (a chat message up to its last complete word, as the user types it) are
fed the same way, into the parked handle sharing the most of them (a fresh one where none does),
so the request prefills only what was written last. Calls coalesce: the latest ids are fed next,
and a request that takes a handle drops ids not yet begun.

Where only some entries are a fresh prefill's (``Capabilities.prefill_floor`` above 1: a
backend whose decode steps compute otherwise than its prefills), a request starts from the
:attr:`TokenCache.reusable` entries only and feeds at least ``floor`` ids. A parked handle
holding other entries (a reply's, written by decode steps) is then settled even without ``ahead``:
those entries are re-fed in one prefill, so the next turn finds them reusable, and with them the
request's tokens that no forward fed (a reply's last token).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
import time
from dataclasses import dataclass

from specgen.errors import CacheExhausted
from specgen.models.target import TokenCache


@dataclass
class PrefixCacheStats:
    """Counts since the cache was made: lookups (requests), hits (started from a parked handle),
    reused / computed (prompt tokens taken from the cache / left to prefill)."""

    lookups: int = 0
    hits: int = 0
    reused: int = 0
    computed: int = 0
    #: Entries re-fed while parked (settled), and the seconds that took.
    settled: int = 0
    settle_seconds: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    limit = min(len(a), len(b))
    if list(a[:limit]) == list(b[:limit]):
        return limit
    n = 0
    while a[n] == b[n]:
        n += 1
    return n


class PrefixCache:
    """Parked handles of one target, in parking order (oldest first).

    new_cache: makes an empty handle (the target's ``new_cache``); it may raise
    :class:`~specgen.errors.CacheExhausted`, and then a parked handle is released to make room.
    floor: the target's ``Capabilities.prefill_floor``. settle: ``settle(handle, ids)`` feeds
    ``ids`` to a handle in one prefill (None: parked handles are never settled).
    """

    def __init__(self, new_cache: Callable[[], TokenCache], *, entries: int, max_bytes: int, floor: int = 1,
                 settle: Callable[[TokenCache, list[int]], object] | None = None):
        self._new_cache = new_cache
        self.entries, self.max_bytes = int(entries), int(max_bytes)
        self.floor, self._settle = int(floor), settle
        self._parked: list[TokenCache] = []
        self._settling: list[TokenCache] = []  # parked handles a settle thread is feeding
        self._wanted: list[int] | None = None  # the latest ids prepare() was given, not yet begun
        self._preparing = False  # a prepare thread runs
        self._lock = threading.Condition()
        self.stats = PrefixCacheStats()

    @property
    def enabled(self) -> bool:
        return self.entries > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked)

    def acquire(self, ids: Sequence[int]) -> tuple[TokenCache, int]:
        """A handle for a request whose prompt is ``ids``, owned by the caller, and how many of
        ``ids`` it already holds (at most ``len(ids) - 1``: the last prompt token is always fed,
        for its logits; at most its reusable entries, leaving ``floor`` ids to feed). The handle
        is synced to ``ids``: it holds exactly those ``reused`` ids. A handle being settled is
        waited for."""
        with self._lock:
            self._wanted = None  # a request has come: what was prepared for it is all it gets
            best = self._best_for(ids)
            handle = self._parked.pop(best) if best is not None else None
        if handle is None:
            handle = self._fresh()
        reused = handle.keep_prefix_of(list(ids), self.floor)
        with self._lock:
            self.stats.lookups += 1
            self.stats.hits += reused > 0
            self.stats.reused += reused
            self.stats.computed += len(ids) - reused
        return handle, reused

    def park(self, handle: TokenCache, tail: Sequence[int] = (),
             ahead: Callable[[], Sequence[int]] | None = None) -> None:
        """Give back a handle whose request ended normally (its ``tokens`` name exactly its
        committed entries); released at once when the cache is off or the handle is empty.
        tail: the ids the request committed after those entries, which no forward fed (its last
        sampled token). ahead: called once, in the settle thread, for the ids the next request
        is expected to start with (a chat's next turn: the conversation as its template renders
        it, up to the next user message's content), or [] when none is known.

        Settled in the background where there is ``ahead``, or where the target reuses only
        prefilled entries (``floor`` above 1) and the handle holds others or there is a tail: the
        settle syncs the handle to the ids ``ahead`` gives (else its entries and the tail) and
        feeds what it does not hold in one prefill."""
        if not self.enabled or not handle.tokens:
            handle.release()
            return
        floored = self.floor > 1 and (handle.reusable < len(handle.tokens) or len(tail) > 0)
        settle = self._settle is not None and (floored or ahead is not None)
        evicted = self._admit(handle, settle)
        if settle:
            # Not a daemon: an exiting interpreter waits for a forward it began.
            threading.Thread(target=self._settle_one, args=(handle, [int(t) for t in tail], ahead),
                             name="specgen-prefix-settle").start()
        for old in evicted:
            self._release(old)

    def prepare(self, ids: Sequence[int]) -> None:
        """Feed, in the background, the ids a coming request's prompt is expected to start with: the
        parked handle sharing the longest prefix with them (waited for while it settles), else a
        fresh one, is synced to them and fed what it does not hold, as a settle does, and stays
        parked. Returns at once. While a prepare runs, later calls only leave their ids for it to
        feed next (the latest win); :meth:`acquire` drops ids not yet begun. Nothing happens where
        the cache is off or does not settle, or for fewer than 2 ids."""
        if not self.enabled or self._settle is None or len(ids) < 2:
            return
        with self._lock:
            self._wanted = [int(i) for i in ids]
            if self._preparing:
                return
            self._preparing = True
        threading.Thread(target=self._prepare_latest, name="specgen-prefix-prepare").start()

    def wait_settled(self) -> None:
        """Block until no parked handle is being settled or prepared."""
        with self._lock:
            self._lock.wait_for(lambda: not self._settling and not self._preparing)

    def _best_for(self, ids: Sequence[int]) -> int | None:
        """The index of the parked handle sharing the longest prefix with ``ids`` (ties: the most
        recently parked), waiting while it settles; None where none shares one. Holds the lock."""
        while True:
            best, best_len = None, 0
            for i, handle in enumerate(self._parked):
                n = common_prefix(handle.tokens, ids)
                if n > 0 and n >= best_len:  # later entries are more recent: ties go to them
                    best, best_len = i, n
            if best is None or self._parked[best] not in self._settling:
                return best
            self._lock.wait()

    def _prepare_latest(self) -> None:
        """Feed the latest ids :meth:`prepare` was given until none are left (a prepare thread)."""
        while True:
            with self._lock:
                ids, self._wanted = self._wanted, None
                if ids is None:
                    self._preparing = False
                    self._lock.notify_all()
                    return
                best = self._best_for(ids)
                if best is not None:  # moved to the most recent end, and marked, in one step
                    handle = self._parked.pop(best)
                    self._parked.append(handle)
                    self._settling.append(handle)
            if best is None:
                try:
                    handle = self._fresh()
                except Exception:  # no handle to spare (or the target failed to make one): nothing is prepared
                    continue
                for old in self._admit(handle, settling=True):
                    self._release(old)
            self._settle_one(handle, [], lambda: ids)

    def clear(self) -> None:
        """Release every parked handle."""
        with self._lock:
            evicted, self._parked = self._parked, []
        for old in evicted:
            self._release(old)

    def _settle_one(self, handle: TokenCache, tail: list[int],
                    ahead: Callable[[], Sequence[int]] | None) -> None:
        """Sync ``handle`` to the ids ``ahead`` gives (else its entries, then ``tail``) and feed what it
        does not hold, its entries past the reusable ones included, in one prefill (a settle
        thread); a handle that fails is dropped from the cache and released."""
        start, failed = time.perf_counter(), False
        try:
            expected = [int(i) for i in ahead()] if ahead is not None else []
        except Exception:  # nothing is known of the next request: settle as without ahead
            expected = []
        ids = expected or list(handle.tokens) + tail
        kept = len(ids)
        try:
            known = bool(expected) or self.floor > 1  # else only the tail: the next request feeds it as cheaply
            if known and not (ids == list(handle.tokens) and handle.reusable == len(ids)):
                kept = handle.keep_prefix_of(ids, self.floor)
                self._settle(handle, ids[kept:])
        except Exception:  # the handle's entries are unknown now: drop it; the next request starts empty
            failed = True
        with self._lock:
            self._settling.remove(handle)
            if failed and handle in self._parked:
                self._parked.remove(handle)
            if not failed:
                self.stats.settled += len(ids) - kept
                self.stats.settle_seconds += time.perf_counter() - start
            self._lock.notify_all()
        if failed:
            handle.release()

    def _release(self, handle: TokenCache) -> None:
        """Release an evicted handle once no settle thread feeds it."""
        with self._lock:
            self._lock.wait_for(lambda: handle not in self._settling)
        handle.release()

    def _admit(self, handle: TokenCache, settling: bool) -> list[TokenCache]:
        """Park ``handle`` as the most recent (marked as settling where ``settling``) -> the handles its
        arrival pushes past the bounds, taken out of the cache for the caller to release."""
        with self._lock:
            self._parked.append(handle)
            if settling:
                self._settling.append(handle)
            return self._over_bounds()

    def _over_bounds(self) -> list[TokenCache]:
        evicted = []
        while self._parked and (len(self._parked) > self.entries
                                or sum(h.held_bytes() for h in self._parked) > self.max_bytes):
            evicted.append(self._parked.pop(0))
        return evicted

    def _fresh(self) -> TokenCache:
        while True:
            try:
                return self._new_cache()
            except CacheExhausted:
                with self._lock:
                    if not self._parked:
                        raise
                    old = self._parked.pop(0)
                self._release(old)
