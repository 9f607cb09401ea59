"""The prefill split of a GGUF model on llama.cpp: the width a prompt's decodes are split at.

What a prompt token costs llama.cpp's CPU kernels depends on the width of the decode it is fed
in, and how much depends on the model and its tensor types: some cost about the same per token
from a few dozen tokens on, others keep getting cheaper. A narrow split bounds what a request
admitted beside a long prompt waits for (a batch prefills one split per step,
:func:`specgen.batch.steps.prefill_chunks`), so :func:`choose_width` takes the narrowest of
PREFILL_WIDTHS whose cost per token is within PREFILL_SLACK of the cheapest.
:func:`prefill_width` measures them once per model file, llama.cpp build, CPU, thread count and
weight and attention layout, and keeps the choice in ``<cache_root>/llama/prefill-<key>.json``.
Every path of a model (plain, speculative, batched rows, the prefix cache) splits alike, so which
path serves a request never changes its logits.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import time
from collections.abc import Callable

from specgen.models import cpu
from specgen.models.gguf_cache import cache_root, read_json, write_json_atomic
from specgen.models.invariance import probe_tokens

#: The prefill splits ``llama_cpp.prefill_split=auto`` chooses from (the first is the narrowest).
PREFILL_WIDTHS = (32, 64, 128)
#: A wider split is chosen only where the narrower ones cost more per token than this times the cheapest.
PREFILL_SLACK = 1.10
#: Decodes of each width timed (interleaved with the others'); the cheapest counts.
REPEATS = 2
#: The format of the kept choice (a change measures again).
METHOD = 1


def choose_width(costs: dict[int, float]) -> int:
    """The narrowest width of ``costs`` ({width: seconds per token}) within PREFILL_SLACK of the cheapest."""
    cheapest = min(costs.values())
    return min(width for width, cost in costs.items() if cost <= PREFILL_SLACK * cheapest)


def measure_costs(open_context: Callable[[int], object], vocab_size: int, widths=PREFILL_WIDTHS,
                  repeats: int = REPEATS, clock: Callable[[], float] = time.process_time) -> dict[int, float]:
    """{width: the least process CPU seconds per token of one prompt decode of ``width`` tokens at
    position 0, over ``repeats`` rounds of every width}, on one handle of ``open_context(widest)``
    (a :class:`~specgen.models.llama_context.LlamaContext` whose prefill split is at least the widest),
    which is closed after. CPU time, not wall clock: what the decode costs, not what a busy machine
    made it wait."""
    widest = max(widths)
    context = open_context(widest)
    try:
        handle = context.new_handle()
        ids = probe_tokens(vocab_size, widest)
        best = {width: math.inf for width in widths}
        for _ in range(repeats):
            for width in widths:
                handle.crop(0)
                began = clock()
                context.forward_rows([handle], [ids[:width]], [1])
                best[width] = min(best[width], (clock() - began) / width)
        return best
    finally:
        context.close()


def prefill_width(facts: dict, measure: Callable[[], dict[int, float]],
                  report: Callable[[str], None] | None = None) -> int:
    """The chosen split (:func:`choose_width`) for a model described by ``facts`` (what its costs depend
    on): kept from an earlier measurement of the same facts, else ``measure()``\\ d and kept (``report``
    is told when the measurement starts and what it chose). A kept file that does not read is measured
    over; one that cannot be written is only not kept."""
    key = hashlib.sha256(json.dumps(dict(facts, widths=PREFILL_WIDTHS, slack=PREFILL_SLACK, method=METHOD),
                                    sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = cache_root() / "llama" / f"prefill-{key}.json"
    kept = read_json(path).get("width")
    if kept in PREFILL_WIDTHS:
        return kept
    if report:
        report("started")
    costs = measure()
    width = choose_width(costs)
    if report:
        report(f"{width} tokens per decode")
    try:
        write_json_atomic(path, {"width": width, "seconds_per_token": {str(w): c for w, c in costs.items()},
                                 "facts": facts, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
    except OSError:
        pass
    return width


def model_facts(lib, path: str, **layout) -> dict:
    """What a GGUF model's prefill costs depend on besides ``layout`` (threads, weights, attention):
    the file (path, size, modification time), the llama.cpp build (``lib``, llama-cpp-python's
    low-level module) and the CPU."""
    file = pathlib.Path(path)
    stat = file.stat()
    return {"file": str(file.resolve()), "size": stat.st_size, "mtime": stat.st_mtime_ns,
            "version": getattr(lib, "__version__", "?"),
            "build": lib.llama_print_system_info().decode("utf-8", "replace"), "cpu": cpu.model_name(), **layout}

