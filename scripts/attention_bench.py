"""What packed grouped-query attention and the in-place KV cache save, interleaved in one process.

Times (a) one batched forward of 8 rows × w tokens after 450-token prefills (compacted) and
(b) the single-request chain cost table, each with transformers' ``sdpa`` + concatenating
DynamicCache ("before") and with specgen's ``specgen_sdpa`` + GrowingLayer ("after"); a batched
forward feeds its rows flat through ``specgen_sdpa`` (:class:`specgen.models.attention.BatchRows`), so
in (a) "before" is the concatenating DynamicCache alone. Wall-clock
figures depend on machine load: report the load with them (CHANGELOG.md,
2026-12-03, first session).

    python scripts/attention_bench.py --threads 1 --dtype float32
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

import specgen
import specgen.models.batch_kv as batch_kv
import specgen.models.causal_lm as causal_lm
from specgen.planning.measure import measure
from specgen.models.attention import NAME
from specgen.models.growing_cache import growing_cache


def _use(pipe, after: bool) -> None:
    cache = growing_cache if after else (lambda config: DynamicCache(config=config))
    batch_kv.growing_cache = causal_lm.growing_cache = cache
    pipe.target.model.set_attn_implementation(NAME if after else "sdpa")


def batched_forward_ms(pipe, width: int, rows: int = 8, prompt: int = 450, repeats: int = 12) -> float:
    model = pipe.target.model
    attention = model.config._attn_implementation
    model.set_attn_implementation(NAME)  # batched forwards run on specgen_sdpa only
    try:
        return _batched_forward_ms(pipe, width, rows, prompt, repeats)
    finally:
        model.set_attn_implementation(attention)


def _batched_forward_ms(pipe, width: int, rows: int, prompt: int, repeats: int) -> float:
    kv = batch_kv.BatchKV(pipe.target, rows)
    vocab = pipe.tokenizer.vocab_size
    for r in range(rows):
        kv.prefill(r, [(7919 * i + 11 * r) % vocab for i in range(prompt)])
    kv.compact()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kv.forward([[5] * width for _ in range(rows)], [1] * rows)
        times.append(time.perf_counter() - start)
    return min(times[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    pipe = specgen.pipeline("backend=torch", f"threads={args.threads}", f"dtype={args.dtype}", "drafter=ngram",
                            progress=False)
    for _ in range(args.rounds):
        for after in (False, True):
            _use(pipe, after)
            label = "after " if after else "before"
            forwards = ", ".join(f"w={w} {batched_forward_ms(pipe, w):.1f} ms" for w in (1, 3))
            chain = measure(pipe.cost_subject(), repeats=5).chain[:12]
            print(f"{label} batch 8: {forwards}; v(1..12): {' '.join(f'{v:.2f}' for v in chain)}", flush=True)
    _use(pipe, True)


if __name__ == "__main__":
    main()
