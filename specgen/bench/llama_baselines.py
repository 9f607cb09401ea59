"""llama.cpp baselines: the pipeline's GGUF through llama-cpp-python's own ``Llama`` API, as users run it.

``llama_cpp``          plain decoding (``Llama.generate``: greedy at T = 0, else
                       temperature sampling with top-k, top-p and min-p off);
``llama_cpp_lookup``   its prompt-lookup decoding (``LlamaPromptLookupDecoding``
                       with ``num_pred_tokens`` = gamma).

They run in the bench's process beside specgen's methods, on the same file and
thread count. Each ``Llama`` is made once per file and thread count and its
KV cache is reset before every timed call (no prompt reuse across calls).
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Mapping

import torch

LLAMA_METHODS = ("llama_cpp", "llama_cpp_lookup")
_LOADED: dict[tuple[str, int, bool], object] = {}
#: Processors the baseline does not run, with the value that switches each off.
_OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0}


def llama_unavailable(pipe) -> str | None:
    """Why llama.cpp's own API cannot run what ``pipe`` runs, or None when it can."""
    from specgen.models import llama_cpp
    from specgen.models.backends import GGUF_KINDS

    if not llama_cpp.available():
        return "llama-cpp-python is not installed"
    kind = str(pipe.config.target["source"].get("kind"))
    if kind not in GGUF_KINDS:
        return f"the target is not a GGUF file (target.source.kind={kind})"
    grammar = (pipe.config.grammar or {}).get("kind", "none")
    if grammar != "none":
        return f"the baseline runs unconstrained and grammar={grammar}"
    sampling = pipe.config.sampling
    for key, off in _OFF.items():
        if sampling.get(key) not in (None, off):
            return f"sampling.{key}={sampling.get(key)} is not reproduced by the baseline"
    if sampling.get("bad_words"):
        return "sampling.bad_words are not reproduced by the baseline"
    return None


def _llama(pipe, lookup: bool):
    """The ``Llama`` of the pipeline's GGUF at this thread count; prompt lookup needs every
    position's logits (``logits_all``), as llama-cpp-python requires for a draft model."""
    from llama_cpp import Llama

    from specgen.models.loading import gguf_file

    path = str(gguf_file(pipe.config.target["source"], progress=False))
    threads = torch.get_num_threads()
    key = (path, threads, lookup)
    if not _LOADED:
        atexit.register(_close_all)  # before interpreter teardown, while llama-cpp-python can still free them
    if key not in _LOADED:
        _LOADED[key] = Llama(model_path=path, n_ctx=min(4096, pipe.target.context_length), n_threads=threads,
                             n_threads_batch=threads, n_gpu_layers=0, logits_all=lookup, verbose=False)
    return _LOADED[key]


def llama_for(pipe):
    """The plain ``Llama`` of the pipeline's GGUF at this thread count (made once, shared)."""
    return _llama(pipe, lookup=False)


def _close_all() -> None:
    while _LOADED:
        _LOADED.popitem()[1].close()


def run_llama(pipe, method: str, ids: list[int], *, max_new: int, temperature: float, seed: int,
              gamma, ignore_eos: bool, clock: Callable[[], float]) -> dict:
    """One timed generation of ``max_new`` tokens (fewer if EOS ends it and not ``ignore_eos``)
    -> {token_ids, wall, ttft}."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if method not in LLAMA_METHODS:
        raise ValueError(f"unknown llama.cpp method {method!r}; expected one of {LLAMA_METHODS}")
    lookup = method == "llama_cpp_lookup"
    llm = _llama(pipe, lookup)
    llm.draft_model = LlamaPromptLookupDecoding(num_pred_tokens=int(gamma)) if lookup else None
    llm.set_seed(int(seed))
    llm.reset()
    eos = set(pipe.tokenizer.eos_ids)
    tokens, ttft = [], None
    start = clock()
    for token in llm.generate(list(ids), top_k=0, top_p=1.0, min_p=0.0, temp=float(temperature),
                              repeat_penalty=1.0, reset=True):
        if ttft is None:
            ttft = clock() - start
        tokens.append(int(token))
        if len(tokens) >= max_new or (token in eos and not ignore_eos):
            break
    end = clock()
    return {"token_ids": tokens, "wall": end - start, "ttft": ttft}


def run_llama_arm(pipe, method: str, ids: list[int], gamma, *, max_new: int, seed: int,
                  clock: Callable[[], float]) -> dict:
    """:func:`run_llama` with the pipeline's own temperature and EOS handling."""
    sampling: Mapping = pipe.config.sampling
    ignore_eos = int(sampling.get("min_new_tokens") or 0) >= max_new
    return dict(run_llama(pipe, method, ids, max_new=max_new, temperature=float(sampling.get("temperature", 0.0)),
                          seed=seed, gamma=gamma, ignore_eos=ignore_eos, clock=clock), drafter_memory_bytes=0)
