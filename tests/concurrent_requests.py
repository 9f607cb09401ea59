"""Requests on one pipeline at once (threads, interleaved streams) against each request run alone.

Imported by tests for in-process runs, and run as a script for the llama.cpp path, where a
regression can kill the process (``python tests/concurrent_requests.py [overrides...]`` prints
one JSON object), so that it fails a test instead of ending pytest.
"""

from __future__ import annotations

import json
import sys
import threading

PROMPTS = ["Write a Python function that merges two sorted lists.", "Tell me a short story about a dragon."]


def _prompt(prompt) -> dict:
    """A prompt given as text or as token ids, as pipe.generate/stream take it."""
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_ids": prompt}


def solo(pipe, prompts, **options) -> list[list[int]]:
    """Each request alone, one after another."""
    return [pipe.generate(**_prompt(p), seed=i + 1, **options).token_ids for i, p in enumerate(prompts)]


def threaded(pipe, prompts, **options) -> list[list[int]]:
    """Each request on a thread of its own, all started together; a thread's exception is re-raised."""
    out: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        try:
            out[i] = pipe.generate(**_prompt(prompts[i]), seed=i + 1, **options).token_ids
        except BaseException as error:  # noqa: BLE001 (handed to the caller below)
            out[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in out:
        if isinstance(result, BaseException):
            raise result
    return out


def interleaved(pipe, prompts, **options) -> list[list[int]]:
    """Every request's stream open at once, advanced one event each in turn."""
    streams = [pipe.stream(**_prompt(p), seed=i + 1, **options) for i, p in enumerate(prompts)]
    out: list = [None] * len(prompts)
    while any(s is not None for s in streams):
        for i, stream in enumerate(streams):
            if stream is None:
                continue
            event = next(stream, None)
            if event is None:
                streams[i] = None
            elif hasattr(event, "generation"):
                out[i] = event.generation.token_ids
    return out


def closed_midway(pipe, prompts, events: int = 3) -> int:
    """Open a stream per prompt, advance each ``events`` events, close them all; -> how many
    streams were open (the pool's idle size after is the caller's to check)."""
    streams = [pipe.stream(**_prompt(p), max_new_tokens=24) for p in prompts]
    for stream in streams:
        for _ in range(events):
            next(stream)
    for stream in streams:
        stream.close()
    return len(streams)


def shared_context(lm, sequences: int = 4):
    """A context of ``lm``'s model whose ``sequences`` share one cell pool, as every handle's
    did before a context per handle (for negative controls: sequences beside each other
    there change each other's logits)."""
    from specgen.models.llama_context import LlamaContext

    shared = LlamaContext(lm._lib, lm._model, None, name=lm.name, n_ctx=lm.context_length, sequences=sequences,
                          unified=True, threads=lm.threads, flash_attention=lm.flash_attention,
                          vocab_size=lm.vocab_size)
    shared.batch_tokens = min(shared.batch_tokens, lm.decode_width)
    return shared


def shared_cell_pool(lm, sequences: int = 4) -> None:
    """Every new handle of ``lm`` from then on a sequence of one :func:`shared_context`."""
    shared = shared_context(lm, sequences)
    lm.pool._adopt(shared)
    lm.pool.handle = shared.new_handle


def llama_report(overrides: list[str]) -> dict:
    """Every check on the llama.cpp path, for the default model unless ``overrides`` say otherwise."""
    import specgen

    greedy = specgen.pipeline("threads=1", *overrides, progress=False)
    sampled = specgen.pipeline("threads=1", "sampling=creative", "drafter.num_tokens=4", *overrides, progress=False)
    report: dict = {"backend": greedy.target.backend, "kv_bytes": greedy.target.context_kv_bytes}
    runs = {"greedy": (greedy, {}), "greedy_plain": (greedy, {"speculative": False}),
            "sampled": (sampled, {}), "sampled_plain": (sampled, {"speculative": False})}
    for name, (pipe, options) in runs.items():
        options = {"max_new_tokens": 24, **options}
        report[name] = {"threaded": [threaded(pipe, PROMPTS, **options) for _ in range(2)],
                        "interleaved": interleaved(pipe, PROMPTS, **options),
                        "solo": solo(pipe, PROMPTS, **options)}
    pool = greedy.target.pool
    greedy.prefix_cache.clear()  # the finished requests' parked handles give their contexts back
    before = pool.size
    report["closed"] = {"streams": closed_midway(greedy, PROMPTS), "before": before, "size": pool.size,
                        "idle": pool.idle}
    shared_cell_pool(greedy.target)
    report["shared_pool"] = {"interleaved": interleaved(greedy, PROMPTS, max_new_tokens=24),
                             "solo": report["greedy"]["solo"]}
    return report


if __name__ == "__main__":
    print(json.dumps(llama_report(sys.argv[1:])))
