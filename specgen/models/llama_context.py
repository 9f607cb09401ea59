"""One llama.cpp context: its KV cache, sequence handles and decodes (llama-cpp-python's low-level API).

A context holds up to ``sequences`` KV handles (:class:`LlamaKV`, one llama.cpp
sequence id each). A handle records the tokens its sequence holds; cropping
removes the sequence's entries from a position on (``llama_memory_seq_rm``),
which is how a round rolls back. :meth:`LlamaContext.forward_rows` feeds several
handles in one decode. ``unified``: every sequence draws cells from one shared
pool of ``n_ctx`` cells; otherwise each sequence has a stream of its own
``n_ctx / sequences`` cells, so a sequence's cells stay in position order whatever
the others do (what batched rows need to see a request's own logits).
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
import weakref

import numpy as np
import torch

from specgen.errors import ConfigError, ModelLoadError, NumericalError, SpecgenError
from specgen.models.invariance import span_splits
from specgen.models.target import TokenCache

#: The most tokens fed to llama.cpp per decode call (a longer feed is split). llama.cpp's CPU kernels
#: switch to other matrix paths for wide decodes, whose logits differ from narrow ones'; the width a
#: context actually uses (:attr:`LlamaContext.batch_tokens`) is the widest that LlamaCppLM measures
#: equal to single-token decodes, at most this.
BATCH_TOKENS = 32
#: The prefill split of a context opened without one: the most tokens of one sequence fed per decode
#: before its kept rows (a prompt's context, the tokens before the first kept row, with that row in the
#: last decode). Such a span is decoded alone, split from its own first position, so every path that
#: feeds it (plain, speculative, a batched row) splits it alike and reads the first kept row from the
#: same decode. It is also the chunk a batch prefills a long prompt by, one per step
#: (:func:`specgen.batch.steps.prefill_chunks`), so it bounds what a request admitted meanwhile waits
#: for. A GGUF model's contexts use the split it measures (:mod:`specgen.models.llama_split`).
PREFILL_TOKENS = 32
#: llama.cpp's flash-attention switch by name (its enum: 0 off, 1 on; llama.cpp's own -1 "auto" is
#: not used: LlamaCppLM chooses by measurement).
FLASH = {"off": 0, "on": 1}
#: Bytes before the stream count in llama.cpp's saved state of one sequence (llama_state_seq_get_data).
STATE_HEADER = 8

_INITIALISED = False
_LOG_CALLBACK = None  # kept referenced: llama.cpp calls it for every log line


def available() -> bool:
    """Whether llama-cpp-python is installed."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def library():
    """llama-cpp-python's low-level module, initialised once (its log lines routed to :func:`_log`)."""
    global _INITIALISED
    try:
        import llama_cpp
    except ImportError as error:
        raise ConfigError("backend=llama_cpp needs llama-cpp-python (scripts/install.sh installs it); "
                          "or use backend=torch") from error
    if not _INITIALISED:
        global _LOG_CALLBACK
        _LOG_CALLBACK = llama_cpp.llama_log_callback(_log)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _INITIALISED = True
    return llama_cpp


def _log(level: int, text: bytes, user_data) -> None:
    """llama.cpp's log lines: errors go to Python's logging, its load chatter is dropped."""
    if level == 4 and text:  # GGML_LOG_LEVEL_ERROR
        logging.getLogger("specgen.llama_cpp").error(text.decode("utf-8", "replace").rstrip())


class LlamaKV(TokenCache):
    """One sequence of a :class:`LlamaContext`; its id is released when the handle is collected."""

    def __init__(self, context: LlamaContext, seq: int):
        self.context = context
        self.seq = seq
        self.tokens: list[int] = []
        #: Leading entries written by decodes of at least the context's ``prefill_floor`` tokens each.
        self.exact = 0
        self._release = weakref.finalize(self, context.release, seq)

    @property
    def reusable(self) -> int:
        """The leading entries a fresh prefill writes alike: those decoded in decodes of at least
        :attr:`LlamaContext.prefill_floor` tokens, in order from the first (a narrower decode's,
        such as a decode step's, and every entry after it, are not)."""
        return self.exact

    def release(self) -> None:
        """Empty the sequence and give its id back to the context now (once; the handle is not used after)."""
        self._release()

    def held_bytes(self) -> int:
        """0: the context's cells stay allocated in its model's pool whether this handle is live, parked in
        a prefix cache or released, so parking it holds no more memory (it holds a context: see
        :class:`~specgen.models.llama_pool.ContextPool`, whose refusal makes a prefix cache give one back)."""
        return 0

    def bind(self, context: LlamaContext) -> None:
        """Make this handle one of ``context``'s (same sequence id; its entries already there)."""
        self._release.detach()
        self.context = context
        self._release = weakref.finalize(self, context.release, self.seq)

    def _truncate(self, length: int) -> None:
        self.context.remove(self.seq, length)
        self.exact = min(self.exact, length)


class LlamaContext:
    """A context of a loaded llama.cpp ``model`` (a llama_model pointer, kept alive by ``owner``).

    n_ctx: KV cells in all; sequences: handles live at once; unified: one shared cell
    pool (else one stream of n_ctx / sequences cells per sequence); vocab_size: logits
    are cut to it; name: for messages; prefill_tokens: the prefill split (None: PREFILL_TOKENS).
    Native calls on one context are serialised by
    its lock (a llama.cpp context is not thread safe). on_idle: called with the context
    when its last live handle is released (None: nothing is).
    """

    on_idle = None

    def __init__(self, lib, model, owner, *, name: str, n_ctx: int, sequences: int, unified: bool, threads: int,
                 flash_attention: str, vocab_size: int, prefill_tokens: int | None = None):
        self._lib, self.owner, self.name = lib, owner, name
        prefill_tokens = PREFILL_TOKENS if prefill_tokens is None else int(prefill_tokens)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = int(n_ctx)
        # llama.cpp needs room for one output per sequence; this class feeds prefill_tokens at most
        cparams.n_batch = cparams.n_ubatch = min(max(prefill_tokens, int(sequences)), int(n_ctx))
        cparams.n_seq_max = int(sequences)
        cparams.kv_unified = bool(unified)
        cparams.n_threads = cparams.n_threads_batch = int(threads)
        cparams.no_perf = True
        cparams.flash_attn_type = FLASH[flash_attention]
        self._ctx = lib.llama_init_from_model(model, cparams)
        if not self._ctx:
            raise ModelLoadError(f"llama.cpp cannot make a context for {name} with {n_ctx} tokens")
        self._memory = lib.llama_get_memory(self._ctx)
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model)))
        self.vocab_size = min(int(vocab_size), self.n_vocab)
        #: The most tokens one sequence may hold.
        self.length = int(n_ctx) if unified else int(n_ctx) // int(sequences)
        #: Tokens per llama_decode of the rows that give logits; longer feeds are split into this many.
        self.batch_tokens = min(BATCH_TOKENS, int(cparams.n_batch))
        #: Tokens per llama_decode of a sequence's span before its first kept row.
        self.prefill_tokens = min(prefill_tokens, int(cparams.n_batch))
        #: The fewest tokens a decode must hold for its entries to be a fresh prefill's (1: any decode;
        #: LlamaCppLM raises it where narrow decodes compute otherwise): a span is split so that no
        #: decode of it is narrower where it can be (:func:`span_splits`), and handles count the
        #: entries such decodes wrote (:attr:`LlamaKV.reusable`).
        self.prefill_floor = 1
        self._batch = lib.llama_batch_init(self.prefill_tokens, 0, 1)
        self._sequences = int(sequences)
        self._streams = 1 if unified else self._sequences  # KV streams
        self._free = list(range(self._sequences))
        self._lock = threading.RLock()
        self._closer = weakref.finalize(self, _free_context, lib, self._ctx, self._batch)

    def close(self) -> None:
        """Free the context now (its handles must not be used after)."""
        with self._lock:
            self._closer()

    def new_handle(self) -> LlamaKV:
        with self._lock:
            if not self._free:
                raise SpecgenError(f"{self.name}: every llama.cpp sequence of this context is in use "
                                   f"({self._sequences}); finish a request first")
            return LlamaKV(self, self._free.pop(0))  # a pooled sequence is empty: release clears it

    def take(self, handle: LlamaKV) -> None:
        """Move ``handle``'s sequence from its context to the same sequence id of this empty-stream
        context: its KV entries copied byte for byte (llama.cpp's sequence state), laid from the
        stream's first cell in position order as they were; the handle then belongs to this context."""
        old, seq = handle.context, handle.seq
        with old._lock, self._lock:
            if seq not in self._free:
                raise SpecgenError(f"{self.name}: sequence {seq} of this llama.cpp context is in use")
            if len(handle):
                state = self._restreamed(old._sequence_state(seq), old._streams)
                if int(self._lib.llama_state_seq_set_data(self._ctx, state, len(state), seq)) != len(state):
                    raise SpecgenError(f"{self.name}: llama.cpp could not move a sequence of {len(handle)} tokens "
                                       "to a larger context")
            self._free.remove(seq)
        handle.bind(self)

    def _sequence_state(self, seq: int) -> bytes:
        """llama.cpp's saved state of sequence ``seq`` (its KV entries)."""
        size = int(self._lib.llama_state_seq_get_size(self._ctx, seq))
        state = (ctypes.c_uint8 * size)()
        written = int(self._lib.llama_state_seq_get_data(self._ctx, state, size, seq))
        return bytes(state[:written])

    def _restreamed(self, state: bytes, streams: int):
        """A sequence state saved by a context of ``streams`` KV streams, for this context's: llama.cpp
        writes a header of STATE_HEADER bytes, the stream count, then per stream a cell count (0 for
        every stream but the sequence's own) and that stream's cells, and reads the cells into the
        sequence's own stream whatever their place; so the count is rewritten and the missing streams'
        empty counts appended. SpecgenError where the state is not laid out so."""
        at = STATE_HEADER
        if len(state) < at + 4 or struct.unpack_from("=I", state, at)[0] != streams or self._streams < streams:
            raise SpecgenError(f"{self.name}: a llama.cpp sequence state of an unexpected layout cannot be moved")
        data = (state[:at] + struct.pack("=I", self._streams) + state[at + 4:]
                + bytes(4 * (self._streams - streams)))
        return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)

    def release(self, seq: int) -> None:
        with self._lock:
            if not self._closer.alive:
                return
            self.remove(seq, 0)
            self._free.append(seq)
            idle = len(self._free) == self._sequences
        if idle and self.on_idle is not None:
            self.on_idle(self)

    def remove(self, seq: int, start: int) -> None:
        """Drop ``seq``'s entries from position ``start`` on."""
        with self._lock:
            if self._closer.alive:
                self._lib.llama_memory_seq_rm(self._memory, seq, start, -1)

    def forward_rows(self, caches: list[LlamaKV], feeds: list[list[int]], keeps: list[int],
                     check: bool = True) -> list[torch.Tensor | None]:
        """Feed each handle's ``feeds[i]`` after its cached tokens: sequence ids keep the handles
        apart, positions are each handle's own. Each handle's tokens before its last ``keeps[i]``
        go first, in decodes of their own (:attr:`prefill_tokens` each, split from the span's
        first token), and take the handle's first kept row with them (a prompt's last token is
        decoded with the prompt, on every path alike); the other kept rows of every handle then
        share decodes of :attr:`batch_tokens`. -> per handle the raw logits of its last
        ``keeps[i]`` fed positions [keeps[i], vocab_size] float32 (None where keeps[i] or the
        feed is 0). Every feed is appended, or on a failed decode none is. Holds the context's
        lock throughout."""
        with self._lock:
            if not self._closer.alive:
                raise SpecgenError(f"{self.name}: this llama.cpp context is closed")
            return self._forward_rows(caches, feeds, keeps, check)

    def _forward_rows(self, caches: list[LlamaKV], feeds: list[list[int]], keeps: list[int],
                      check: bool) -> list[torch.Tensor | None]:
        spans: list[list[tuple[int, int, int, bool]]] = []  # per handle, the entries decoded on their own
        entries: list[tuple[int, int, int, bool]] = []  # (sequence, token, position, logits wanted)
        starts = []
        for cache, feed, keep in zip(caches, feeds, keeps, strict=True):
            if cache.context is not self:
                raise ValueError(f"that KV handle belongs to another context than {self.name}'s")
            start, n = len(cache), len(feed)
            if start + n > self.length:
                raise SpecgenError(f"{self.name}: {start + n} tokens do not fit its {self.length}-token context")
            starts.append(start)
            split = n - min(keep, n)  # the first kept row
            alone = split + 1 if 0 < split < n else split  # a span takes the first kept row with it
            fed = [(cache.seq, int(t), start + i, i >= split) for i, t in enumerate(feed)]
            spans.append(fed[:alone])
            entries.extend(fed[alone:])
        if not entries and not any(spans):
            raise ValueError("forward needs at least one new token")
        heads: list[np.ndarray | None] = []  # per handle, the kept row its span's last decode gave
        by_seq = {cache.seq: cache for cache in caches}
        rows = []
        try:
            for span in spans:
                head, offset = None, 0
                for size in span_splits(len(span), self.prefill_tokens, self.prefill_floor):
                    chunk = span[offset: offset + size]
                    offset += size
                    self._decode(chunk)
                    self._count_exact(chunk, by_seq)
                    if chunk[-1][3]:
                        head = self._logits(1)[:, : self.vocab_size]  # [1, vocab]
                heads.append(head)
            for offset in range(0, len(entries), self.batch_tokens):
                chunk = entries[offset: offset + self.batch_tokens]
                self._decode(chunk)
                self._count_exact(chunk, by_seq)
                wanted = sum(e[3] for e in chunk)
                if wanted:
                    rows.append(self._logits(wanted))
        except BaseException:
            for cache, start in zip(caches, starts, strict=True):
                self.remove(cache.seq, start)
                cache.exact = min(cache.exact, start)
            raise
        for cache, feed in zip(caches, feeds, strict=True):
            cache.tokens.extend(int(t) for t in feed)
        flat = np.concatenate(rows) if len(rows) > 1 else rows[0] if rows else np.zeros((0, self.n_vocab), np.float32)
        flat = flat[:, : self.vocab_size]  # [shared kept rows of every handle, vocab]
        if check and any(np.isnan(part.max()) for part in (flat, *heads) if part is not None and part.size):
            raise NumericalError(f"{self.name} produced NaN logits at position {starts[0] + len(feeds[0]) - 1}"
                                 if len(caches) == 1 else f"{self.name} produced NaN logits")
        out: list[torch.Tensor | None] = []
        used = 0
        for feed, keep, head in zip(feeds, keeps, heads, strict=True):
            kept = min(keep, len(feed))
            shared = kept - (head is not None)
            part = flat[used: used + shared]  # [shared, vocab]
            used += shared
            if head is not None:
                part = np.concatenate([head, part]) if shared else head
            out.append(torch.from_numpy(part) if kept else None)
        return out

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (sequence, token, position, logits wanted) entries."""
        batch = self._batch
        for i, (seq, token, position, out) in enumerate(entries):
            if not 0 <= token < self.n_vocab:
                raise SpecgenError(f"{self.name}: token id {token} is outside its vocabulary ({self.n_vocab})")
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = int(out)
        batch.n_tokens = len(entries)
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise SpecgenError(f"{self.name}: llama.cpp could not decode {len(entries)} tokens at position "
                               f"{entries[0][2]} (status {status}: the KV cache is full or the call was refused)")

    def _count_exact(self, entries: list[tuple[int, int, int, bool]], by_seq: dict[int, LlamaKV]) -> None:
        """After a decode of ``entries``: a decode of at least :attr:`prefill_floor` tokens extends each
        handle's reusable entries where its entries continue them."""
        if len(entries) < self.prefill_floor:
            return
        for seq, _, position, _ in entries:
            handle = by_seq[seq]
            if handle.exact == position:
                handle.exact = position + 1

    def _logits(self, rows: int) -> np.ndarray:
        """The last decode's output rows, copied: [rows, n_vocab] float32."""
        pointer = self._lib.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, shape=(rows, self.n_vocab)).copy()


def _free_context(lib, ctx, batch) -> None:
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
