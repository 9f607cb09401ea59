"""The llama.cpp target backend: a GGUF file on a CPU through llama-cpp-python's low-level API.

A :class:`LlamaCppLM` holds the model and a pool of contexts
(:class:`~specgen.models.llama_pool.ContextPool`): each KV handle (a request's, a
draft session's, cost measurement's) gets a context of its own, so concurrent
requests and threads never share KV cells or a native call. Forwards feed a chain at
consecutive positions and return the logits of the last ``keep`` positions, so this
backend serves chain drafters; trees and target features are declared unsupported
(:class:`~specgen.models.target.Capabilities`) and refused before loading. Batched
rows (:class:`~specgen.models.llama_batch.LlamaBatch`, for :mod:`specgen.batch`) get a
context of their own, one stream per row.

Exactness rests on batch invariance: the logits of a position fed with others
must equal those of the same position fed alone. :meth:`LlamaCppLM.verify_gap`
measures it within a sequence, and the pipeline declares ``exact``/``greedy`` only
where it is zero; :func:`~specgen.models.llama_batch.batch_gap` measures it across
batched rows, which are batched only where it is zero (else they run one after another).
"""

from __future__ import annotations

import ctypes
import sys
import weakref

import torch

from specgen.errors import ConfigError, ModelLoadError
from specgen.models.llama_batch import LlamaBatch, batch_gap, check_fits, row_cells, split_gap
from specgen.models.invariance import GAP_PREFIX, chain_gap_probe, prefix_gap, worst
from specgen.models.llama_context import BATCH_TOKENS, FLASH, LlamaContext, LlamaKV, available, library
from specgen.models.llama_split import PREFILL_WIDTHS, measure_costs, model_facts, prefill_width
from specgen.models.llama_pool import ContextPool
from specgen.models.target import Capabilities, TargetDefaults

__all__ = ["LlamaBatch", "LlamaCppLM", "LlamaKV", "available"]

#: Rows the batch-invariance probe feeds together.
BATCH_GAP_ROWS = 4
#: Repacked weights are kept (llama_cpp.repack=auto) only where decodes of at least this many tokens
#: give single-token logits: a verify of up to 7 drafts in one decode, prefills not cut too fine.
REPACK_MIN_WIDTH = 8
#: The KV cells of a handle's context under llama_cpp.context=auto (fewer where the model was trained on fewer).
AUTO_CONTEXT = 4096
#: llama_cpp.flash_attention: llama.cpp's attention paths, or ``auto`` (off unless only on is batch invariant).
FLASH_MODES = ("auto", "off", "on")
#: llama_cpp.repack: weights in llama.cpp's repacked CPU buffers (``on``), as stored (``off``), or
#: repacked unless that makes every decode width's logits differ from single-token ones (``auto``).
REPACK = ("auto", "on", "off")


class LlamaCppLM(TargetDefaults):
    """A GGUF model on llama.cpp, implementing :class:`specgen.models.target.Target` for chains.

    vocab_size: the tokenizer's size (logits are cut to it); threads: llama.cpp's threads;
    context_length: the KV cache of each handle's context, in tokens, at most the model's training
    context (ConfigError beyond it); None: the training context; ``"auto"``: AUTO_CONTEXT or the
    training context, the smaller; sequences: how many KV handles may be live at once, each on a context
    of its own (:class:`~specgen.models.llama_pool.ContextPool`; :attr:`context_kv_bytes` each);
    batch_row_context: the tokens a row of :meth:`new_batch` holds unless the caller sizes it;
    flash_attention: one of FLASH_MODES: llama.cpp's flash attention ``on`` or ``off``, or ``auto``:
    off (the cheaper path per token) unless no decode width is batch invariant with it off, then on.
    Which attention path gives logits independent of the decode width depends on the build
    (llamafile's small-matrix kernels) and the thread count; :meth:`verify_gap` measures it.
    repack: one of REPACK (``auto`` keeps repacked weights only where some decode width is batch
    invariant with them). prefill_split: the most tokens a prompt's decodes hold (:attr:`prefill_width`),
    or ``"auto"``: the narrowest of PREFILL_WIDTHS that costs about as little per token as the
    cheapest, measured once per model file and machine (:mod:`specgen.models.llama_split`; ``progress``:
    a line on stderr says so while it is measured).
    """

    backend = "llama_cpp"
    context_hint = "raise llama_cpp.context"

    def __init__(self, path, *, vocab_size: int, name: str = "model", threads: int = 1,
                 context_length: int | str | None = "auto", sequences: int = 64, flash_attention: str = "auto",
                 batch_row_context: int = 4096, repack: str = "auto", prefill_split: int | str = "auto",
                 progress: bool = False):
        if flash_attention not in FLASH_MODES:
            raise ConfigError(f"llama_cpp.flash_attention={flash_attention!r} is not one of {', '.join(FLASH_MODES)}")
        if repack not in REPACK:
            raise ConfigError(f"llama_cpp.repack={repack!r} is not one of {', '.join(REPACK)}")
        self._lib = library()
        self.name = name
        self.path = str(path)
        self.threads, self.batch_row_context = int(threads), int(batch_row_context)
        self._prefill_split, self._progress = prefill_split, progress
        self._capabilities: Capabilities | None = None
        self._splits_free: bool | None = None
        # ggml's AMX kernels (run from repacked buffers) raised SIGILL on an AMX VM: a build with them never repacks
        repacked = repack != "off" and not _has_amx_kernels(self._lib)
        attention = ("off", "on") if flash_attention == "auto" else (flash_attention,)
        for tried, flash in enumerate(attention, 1):
            #: llama.cpp's flash attention as used: "on" or "off".
            self.flash_attention = flash
            widest = self._open(repacked, vocab_size, context_length, sequences)
            if repack == "auto" and repacked and (widest or 0) < REPACK_MIN_WIDTH:
                self._close_now()  # repacked weights change logits with the decode width: load them as stored
                widest = self._open(False, vocab_size, context_length, sequences)
            if widest is not None or tried == len(attention):
                break
            self._close_now()  # no width is batch invariant on this attention path: try the other
        weakref.finalize(self, _close, self._pool.close, self._lib, self._model)
        if prefill_split == "auto":  # measured on the weights and attention path chosen above
            self.prefill_width = self._measured_split(vocab_size)
            for context in self._pool.contexts():  # opened with room for the widest split
                context.prefill_tokens = min(context.prefill_tokens, self.prefill_width)

    def _open(self, repacked: bool, vocab_size: int, context_length: int | None, sequences: int) -> int | None:
        """Load the model (its weights repacked for llama.cpp's CPU kernels or as stored) with its
        main context, and measure :attr:`decode_width`; -> the widest batch-invariant decode (None: none)."""
        lib = self._lib
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = repacked
        self._model = lib.llama_model_load_from_file(self.path.encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp cannot load {self.path} (not a GGUF it supports)")
        trained = int(lib.llama_model_n_ctx_train(self._model))
        if context_length not in (None, "auto") and int(context_length) > trained:
            lib.llama_model_free(self._model)
            raise ConfigError(f"llama_cpp.context={context_length} is more than {self.name}'s training context "
                              f"({trained} tokens); use at most {trained}, null (the training context) or auto")
        self._context = (trained if context_length is None else min(trained, AUTO_CONTEXT)
                         if context_length == "auto" else int(context_length))
        self.vocab_size, self.decode_width, self.prefill_floor = vocab_size, BATCH_TOKENS, 1
        #: The most tokens of a prompt fed per decode (every context's prefill split; under
        #: prefill_split "auto" the widest of PREFILL_WIDTHS until it is measured).
        self.prefill_width = PREFILL_WIDTHS[-1] if self._prefill_split == "auto" else int(self._prefill_split)
        try:
            first = self._open_own()
        except ModelLoadError:
            lib.llama_model_free(self._model)
            raise ModelLoadError(f"llama.cpp cannot make a context for {self.path} with {self._context} tokens")
        self.n_vocab, self.vocab_size = first.n_vocab, first.vocab_size
        self._pool = ContextPool(self._open_own, sequences, first, name=self.name)
        #: Whether the weights sit in llama.cpp's repacked buffers.
        self.repacked = repacked
        self._description = (self._describe_model() + (", repacked" if repacked else "")
                             + (", flash attention" if self.flash_attention == "on" else ""))
        self._gaps: dict[int, float] = {}  # decode width -> its gap after GAP_PREFIX tokens
        widest = self._widest_invariant()
        #: Tokens per llama.cpp decode: the widest measured batch invariant (BATCH_TOKENS where none is).
        self.decode_width = widest or BATCH_TOKENS
        #: The fewest tokens of a decode whose entries a prefix cache reuses: any decode's where every
        #: width is batch invariant, else only those of decodes wider than the widest invariant one
        #: (what a fresh prefill's decodes are; decode steps are narrower). prefix_gap measures it.
        self.prefill_floor = 1 if widest == BATCH_TOKENS else (widest or 1) + 1
        for context in self._pool.contexts():
            context.batch_tokens = min(context.batch_tokens, self.decode_width)
            context.prefill_floor = self.prefill_floor
        self._gaps = {w: g for w, g in self._gaps.items() if w <= self.decode_width}  # wider feeds now split
        return widest

    def _measured_split(self, vocab_size: int) -> int:
        """The prefill split :func:`~specgen.models.llama_split.prefill_width` chooses for the loaded model:
        as kept, or measured on a context of its own."""
        facts = model_facts(self._lib, self.path, threads=self.threads, repacked=self.repacked,
                            flash_attention=self.flash_attention)

        def opened(widest: int) -> LlamaContext:
            return LlamaContext(self._lib, self._model, None, name=self.name, n_ctx=widest, sequences=1,
                                unified=True, threads=self.threads, flash_attention=self.flash_attention,
                                vocab_size=vocab_size, prefill_tokens=widest)

        def report(line: str) -> None:
            print(f"specgen: measuring {self.name}'s prefill split on llama.cpp (once for this machine, then kept): "
                  f"{line}", file=sys.stderr, flush=True)

        return prefill_width(facts, lambda: measure_costs(opened, vocab_size), report if self._progress else None)

    def _widest_invariant(self) -> int | None:
        """The widest decode of 2..BATCH_TOKENS tokens whose logits equal single-token decodes, by
        bisection (llama.cpp's CPU kernels switch paths above some width); None where 2 already differ."""
        probe = chain_gap_probe(self, GAP_PREFIX, BATCH_TOKENS)

        def invariant(width: int) -> bool:
            return self._gaps_after(GAP_PREFIX, [width], probe)[width] == 0.0

        if invariant(BATCH_TOKENS):
            return BATCH_TOKENS
        good, bad = 1, BATCH_TOKENS
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if invariant(middle) else (good, middle)
        return good if good >= 2 else None

    def _open_own(self) -> LlamaContext:
        """A context for one KV handle; every one is opened alike, so the logits measured on one
        are every handle's."""
        context = LlamaContext(self._lib, self._model, None, name=self.name, n_ctx=self._context, sequences=1,
                               unified=True, threads=self.threads, flash_attention=self.flash_attention,
                               vocab_size=self.vocab_size, prefill_tokens=self.prefill_width)
        context.batch_tokens = min(context.batch_tokens, self.decode_width)
        context.prefill_floor = self.prefill_floor
        return context

    def _close_now(self) -> None:
        _close(self._pool.close, self._lib, self._model)

    @property
    def pool(self) -> ContextPool:
        """The contexts of this model's KV handles (see :mod:`specgen.models.llama_pool`)."""
        return self._pool

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token: every layer's keys and values in llama.cpp's default f16 cache type."""
        lib, model = self._lib, self._model
        head = int(lib.llama_model_n_embd(model)) // int(lib.llama_model_n_head(model))
        return 2 * 2 * int(lib.llama_model_n_layer(model)) * int(lib.llama_model_n_head_kv(model)) * head

    @property
    def context_kv_bytes(self) -> int:
        """The KV cache of one handle's context in bytes (:attr:`context_length` tokens)."""
        return self.kv_bytes_per_token * self._context

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

    @property
    def capabilities(self) -> Capabilities:
        """Chains; batched rows where :func:`batch_gap` measures them equal to solo rows bit for
        bit; prefix reuse where :func:`prefix_gap` measures a cached prefix's logits equal to a fresh
        prefill's, reusing only entries of decodes of at least :attr:`prefill_floor` tokens (a model's
        kernels may compute a position differently by the width of the decode it is fed in; both
        measured on first use)."""
        if self._capabilities is None:
            self._capabilities = Capabilities(trees=False, features=False,
                                              batches=batch_gap(self, BATCH_GAP_ROWS) == 0.0,
                                              prefix_reuse=prefix_gap(self, floor=self.prefill_floor) == 0.0,
                                              prefill_floor=self.prefill_floor)
        return self._capabilities

    @property
    def prefill_splits_free(self) -> bool:
        """Whether a prompt's decodes may be split at any widths up to the prefill split without changing a
        logit: :func:`~specgen.models.llama_batch.split_gap` is 0 (measured on first use). Batches then
        size a long prompt's chunks by time; else they keep the splits a solo run decodes at."""
        if self._splits_free is None:
            self._splits_free = split_gap(self) == 0.0
        return self._splits_free

    def new_cache(self) -> LlamaKV:
        """An empty KV handle on a context of its own; PoolExhausted beyond ``sequences`` live ones."""
        return self._pool.handle()

    def new_batch(self, size: int, row_context: int | None = None) -> LlamaBatch:
        """A batch of ``size`` rows of ``row_context`` tokens each (None: ``batch_row_context``),
        at most :attr:`context_length`, on a context of its own (:class:`LlamaBatch`), told whether
        prompts' decodes split freely (:attr:`prefill_splits_free`, measured on the first batch that fits).
        ConfigError, before any context is opened, where the rows need more memory than is available."""
        cells = row_cells(min(row_context or self.batch_row_context, self._context))
        check_fits(self, size, cells)
        return LlamaBatch(self, size, cells, splits_free=self.prefill_splits_free)

    def open_context(self, n_ctx: int, sequences: int, prefill_tokens: int | None = None) -> LlamaContext:
        """A further context on this model: ``sequences`` streams of n_ctx / sequences cells each, its
        prompts split at ``prefill_tokens`` (None: :attr:`prefill_width`, as every context of the model)."""
        context = LlamaContext(self._lib, self._model, self, name=self.name, n_ctx=n_ctx, sequences=sequences,
                               unified=False, threads=self.threads, flash_attention=self.flash_attention,
                               vocab_size=self.vocab_size, prefill_tokens=prefill_tokens or self.prefill_width)
        context.batch_tokens = min(context.batch_tokens, self.decode_width)
        context.prefill_floor = self.prefill_floor
        return context

    def forward(self, cache: LlamaKV, new_tokens: list[int] | torch.Tensor, keep: int,
                check: bool = True) -> torch.Tensor:
        """Feed ``new_tokens`` after the cached ones; return the last ``keep`` rows' raw logits
        [keep, vocab_size] (float32). On a failed decode the fed tokens are removed again."""
        ids = new_tokens.tolist() if isinstance(new_tokens, torch.Tensor) else [int(t) for t in new_tokens]
        if not ids:
            raise ValueError("forward needs at least one new token")
        if not self._pool.owns(cache.context):
            raise ValueError(f"that KV handle belongs to another model than {self.name}")
        return cache.context.forward_rows([cache], [ids], [keep], check=check)[0]

    def verify_gap(self, widths, parents: list[int] | None = None, prefix: int = GAP_PREFIX) -> tuple[float, int]:
        """Batch invariance (:mod:`specgen.models.invariance`): the largest |logit| difference between
        positions fed ``width`` at a time and the same positions fed one by one, over ``widths`` and
        :attr:`decode_width` (the width longer feeds are split into); -> (max difference, its width).
        ``parents``: a tree, which this backend does not verify (ValueError)."""
        if parents is not None:
            raise ValueError("llama.cpp verifies chains, not trees")
        return worst(self._gaps_after(prefix, sorted({*widths, self.decode_width})))

    def _gaps_after(self, prefix: int, widths: list[int], probe=None) -> dict[int, float]:
        """{width: max |logit| difference between ``width`` tokens fed together and one by one},
        after a fixed ``prefix``-token context (kept for the default prefix); ``probe``: a
        :func:`~specgen.models.invariance.chain_gap_probe` of that prefix, long enough for every
        width, to measure with."""
        memo = self._gaps if prefix == GAP_PREFIX else {}
        todo = [w for w in widths if w not in memo]
        if todo:
            probe = probe or chain_gap_probe(self, prefix, max(todo))
            memo.update((width, probe(width)) for width in todo)
        return {w: memo[w] for w in widths}


def _has_amx_kernels(lib) -> bool:
    """Whether this llama.cpp build carries ggml's AMX kernels (they run from its extra weight buffers)."""
    return b"AMX_INT8 = 1" in lib.llama_print_system_info()


def _close(close_contexts, lib, model) -> None:
    close_contexts()
    lib.llama_model_free(model)
