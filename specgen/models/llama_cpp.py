"""The llama.cpp target backend: a GGUF file on a CPU through llama-cpp-python's low-level API.

One llama.cpp context per model holds a unified KV cache shared by up to
``sequences`` KV handles (one llama.cpp sequence id each). A handle
(:class:`LlamaKV`) records the tokens its sequence holds; cropping removes the
sequence's entries from a position on (``llama_memory_seq_rm``), which is how a
round rolls back. Forwards feed a chain at consecutive positions and return the
logits of the last ``keep`` positions, so this backend serves chain drafters;
trees, target features and ragged batches are declared unsupported
(:class:`~specgen.models.target.Capabilities`) and refused before loading.

Exactness rests on batch invariance: the logits of a position fed with others
must equal those of the same position fed alone. :meth:`LlamaCppLM.verify_gap`
measures it; the pipeline declares ``exact``/``greedy`` only where it is zero.
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import numpy as np
import torch

from specgen.errors import ConfigError, ModelLoadError, NumericalError, SpecgenError
from specgen.models.target import Capabilities, TokenCache

#: Tokens fed to llama.cpp per decode call (a longer feed is split; only the last call's rows are read).
BATCH_TOKENS = 512

_INITIALISED = False
#: llama.cpp's flash-attention switch by name (its enum: -1 auto, 0 off, 1 on).
_FLASH = {"auto": -1, "off": 0, "on": 1}
_LOG_CALLBACK = None  # kept referenced: llama.cpp calls it for every log line


def available() -> bool:
    """Whether llama-cpp-python is installed."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _library():
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
    """One llama.cpp sequence of a :class:`LlamaCppLM`'s context; its id is released when the handle is collected."""

    def __init__(self, lm: LlamaCppLM, seq: int):
        self.lm = lm
        self.seq = seq
        self.tokens: list[int] = []
        weakref.finalize(self, lm._release, seq)

    def _truncate(self, length: int) -> None:
        self.lm._remove(self.seq, length)


class LlamaCppLM:
    """A GGUF model on llama.cpp, implementing :class:`specgen.models.target.Target` for chains.

    vocab_size: the tokenizer's size (logits are cut to it); threads: llama.cpp's threads;
    context_length: the KV cache's size in tokens, shared by every live handle (None: the
    model's training context); sequences: how many KV handles may be live at once;
    flash_attention: llama.cpp's flash attention (on | off | auto). With it on, a position's
    logits do not depend on how many positions a decode feeds (measured by :meth:`verify_gap`);
    off, llama.cpp's other attention path gives verify logits that differ from single-token ones.
    """

    backend = "llama_cpp"
    capabilities = Capabilities(trees=False, features=False, batches=False)
    compiled = None
    hf_model = None

    def __init__(self, path, *, vocab_size: int, name: str = "model", threads: int = 1,
                 context_length: int | None = None, sequences: int = 4, flash_attention: str = "on"):
        if flash_attention not in _FLASH:
            raise ConfigError(f"llama_cpp.flash_attention={flash_attention!r} is not one of {', '.join(_FLASH)}")
        lib = _library()
        self._lib = lib
        self.name = name
        self.path = str(path)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(self.path.encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp cannot load {self.path} (not a GGUF it supports)")
        trained = int(lib.llama_model_n_ctx_train(self._model))
        self._context = min(trained, int(context_length)) if context_length else trained
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self._context
        cparams.n_batch = cparams.n_ubatch = min(BATCH_TOKENS, self._context)
        cparams.n_seq_max = int(sequences)
        cparams.kv_unified = True
        cparams.n_threads = cparams.n_threads_batch = int(threads)
        cparams.no_perf = True
        cparams.flash_attn_type = _FLASH[flash_attention]
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ModelLoadError(f"llama.cpp cannot make a context for {self.path} with {self._context} tokens")
        self._memory = lib.llama_get_memory(self._ctx)
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model)))
        self.vocab_size = min(int(vocab_size), self.n_vocab)
        self._batch_tokens = int(cparams.n_batch)
        self._batch = lib.llama_batch_init(self._batch_tokens, 0, 1)
        self._free = list(range(int(sequences)))
        self._description = self._describe_model()
        weakref.finalize(self, _close, lib, self._model, self._ctx, self._batch)

    def _describe_model(self) -> str:
        buffer = ctypes.create_string_buffer(256)
        self._lib.llama_model_desc(self._model, buffer, len(buffer))
        return buffer.value.decode("utf-8", "replace")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The logits' dtype (the weights keep the GGUF's own types)."""
        return torch.float32

    @property
    def context_length(self) -> int:
        return self._context

    @property
    def memory_bytes(self) -> int:
        return int(self._lib.llama_model_size(self._model))

    def describe(self) -> dict:
        return {"backend": self.backend, "dtype": self._description, "attention": None}

    def new_cache(self) -> LlamaKV:
        if not self._free:
            raise SpecgenError(f"{self.name}: every llama.cpp sequence of this context is in use "
                               f"({self._lib.llama_n_seq_max(self._ctx)}); finish a request first")
        return LlamaKV(self, self._free.pop(0))  # a pooled sequence is empty: _release clears it

    def _release(self, seq: int) -> None:
        if self._ctx:
            self._remove(seq, 0)
            self._free.append(seq)

    def _remove(self, seq: int, start: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, seq, start, -1)

    @torch.inference_mode()
    def forward(self, cache: LlamaKV, new_tokens: list[int] | torch.Tensor, keep: int,
                check: bool = True) -> torch.Tensor:
        """Feed ``new_tokens`` after the cached ones; return the last ``keep`` rows' raw logits
        [keep, vocab_size] (float32). On a failed decode the fed tokens are removed again."""
        ids = new_tokens.tolist() if isinstance(new_tokens, torch.Tensor) else [int(t) for t in new_tokens]
        n = len(ids)
        if not n:
            raise ValueError("forward needs at least one new token")
        if cache.lm is not self:
            raise ValueError(f"that KV handle belongs to another model than {self.name}")
        start = len(cache)
        if start + n > self._context:
            raise SpecgenError(f"{self.name}: {start + n} tokens do not fit its {self._context}-token context")
        keep = min(keep, n)
        rows = []
        try:
            for offset in range(0, n, self._batch_tokens):
                chunk = ids[offset: offset + self._batch_tokens]
                wanted = [offset + i >= n - keep for i in range(len(chunk))]
                self._decode(cache.seq, chunk, start + offset, wanted)
                if any(wanted):
                    rows.append(self._logits(sum(wanted)))
        except BaseException:
            self._remove(cache.seq, start)
            raise
        cache.tokens.extend(ids)
        logits = torch.from_numpy(np.concatenate(rows) if len(rows) > 1 else rows[0])[:, : self.vocab_size]
        if check and logits.numel() and torch.isnan(logits.max()):
            raise NumericalError(f"{self.name} produced NaN logits at position {start + n - 1}")
        return logits  # [keep, vocab]

    def _decode(self, seq: int, tokens: list[int], position: int, wanted: list[bool]) -> None:
        batch = self._batch
        for i, (token, out) in enumerate(zip(tokens, wanted, strict=True)):
            if not 0 <= token < self.n_vocab:
                raise SpecgenError(f"{self.name}: token id {token} is outside its vocabulary ({self.n_vocab})")
            batch.token[i] = token
            batch.pos[i] = position + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = int(out)
        batch.n_tokens = len(tokens)
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise SpecgenError(f"{self.name}: llama.cpp could not decode {len(tokens)} tokens at position "
                               f"{position} (status {status}: the KV cache is full or the call was refused)")

    def _logits(self, rows: int) -> np.ndarray:
        """The last decode's output rows, copied: [rows, n_vocab] float32."""
        pointer = self._lib.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, shape=(rows, self.n_vocab)).copy()

    def verify_gap(self, widths, prefix: int = 16) -> tuple[float, int]:
        """Batch invariance: the largest |logit| difference between positions fed ``width`` at a time
        and the same positions fed one by one, over ``widths``; -> (max difference, its width)."""
        widths = list(widths)
        tokens = [(7919 * i + 11) % self.vocab_size for i in range(prefix + max(widths))]
        cache = self.new_cache()
        self.forward(cache, tokens[:prefix], keep=1)  # the shared prefix, fed once
        worst, at = 0.0, 0
        for width in widths:
            cache.crop(prefix)
            together = self.forward(cache, tokens[prefix: prefix + width], keep=width)  # [width, vocab]
            cache.crop(prefix)
            alone = torch.cat([self.forward(cache, [t], keep=1) for t in tokens[prefix: prefix + width]])
            gap = float((together - alone).abs().max())
            if gap > worst or not at:
                worst, at = gap, width
        return worst, at


def _close(lib, model, ctx, batch) -> None:
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)
    lib.llama_model_free(model)
