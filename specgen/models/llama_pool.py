"""A bounded pool of llama.cpp contexts on one model: one context per live KV handle.

In one context whose sequences share a cell pool, where a sequence's tokens land
depends on what the other live sequences hold (a later token can take a cell
before its earlier ones, or sit further along than alone), and attention sums over
the cells in their order: a request's logits then depend on the requests beside it.
So every live handle of a :class:`~specgen.models.llama_cpp.LlamaCppLM` gets a
context of its own, all opened with the same settings: its cells are laid as in a
request run alone, and its logits are those of its solo run bit for bit, whatever
other requests or threads do. Contexts are opened on demand up to ``bound``, each
holding its full KV cache (``n_ctx`` cells), and are kept for reuse once their
handle is released (:meth:`~specgen.models.target.TokenCache.release`, or the
handle collected); a handle asked for beyond the bound is refused at once
(:class:`PoolExhausted`), never waited for: a generator interleaved with others on
one thread would wait forever. Each context serialises its own native calls (a
llama.cpp context is not thread safe); different contexts decode in parallel.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from specgen.errors import CacheExhausted
from specgen.models.llama_context import LlamaContext, LlamaKV


class PoolExhausted(CacheExhausted):
    """Every context a model may open holds a live KV handle (``llama_cpp.sequences``)."""


class ContextPool:
    """Contexts made by ``open_context`` (None: the one given first), at most ``bound`` at once,
    one live handle each. ``first``: a context already open, pooled as idle; name: for messages."""

    def __init__(self, open_context: Callable[[], LlamaContext], bound: int, first: LlamaContext, *, name: str):
        self._open, self.bound, self.name = open_context, int(bound), name
        self._lock = threading.RLock()  # a handle collected while it is held gives its context back on this thread
        self._contexts: list[LlamaContext] = []
        self._idle: list[LlamaContext] = []
        self._opening = 0
        self._adopt(first)
        self._idle.append(first)

    @property
    def size(self) -> int:
        """Contexts open (idle or in use)."""
        return len(self._contexts)

    @property
    def idle(self) -> int:
        """Contexts open and holding no live handle."""
        return len(self._idle)

    def handle(self) -> LlamaKV:
        """An empty KV handle on a context of its own (an idle one, else a new one);
        PoolExhausted when ``bound`` contexts already hold live handles."""
        with self._lock:
            context = self._idle.pop() if self._idle else None
            if context is None:
                if len(self._contexts) + self._opening >= self.bound:
                    raise PoolExhausted(f"{self.name}: all {self.bound} llama.cpp contexts hold a live request "
                                        f"(llama_cpp.sequences={self.bound}); finish or close a request first, "
                                        "or raise llama_cpp.sequences")
                self._opening += 1
        if context is None:
            try:
                context = self._open()
            finally:
                with self._lock:
                    self._opening -= 1
            with self._lock:
                self._adopt(context)
        return context.new_handle()

    def contexts(self) -> list[LlamaContext]:
        with self._lock:
            return list(self._contexts)

    def owns(self, context: LlamaContext) -> bool:
        return context in self._contexts

    def close(self) -> None:
        """Free every context (their handles must not be used after)."""
        with self._lock:
            contexts, self._contexts, self._idle = self._contexts, [], []
        for context in contexts:
            context.close()

    def _adopt(self, context: LlamaContext) -> None:
        context.on_idle = self._returned
        self._contexts.append(context)

    def _returned(self, context: LlamaContext) -> None:
        with self._lock:
            if context in self._contexts and context not in self._idle:
                self._idle.append(context)
