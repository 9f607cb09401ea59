"""Eager vs ``compile=true`` on one target, side by side in one process.

For each dtype: compile time of each verify bucket (first call, after a
prefill), the forward time v(n) for n = 1, 2, 4, 8, 16 new tokens after a
192-token context (minimum of ``--repeats``, eager and compiled interleaved),
then plain and speculative (ngram, fixed gamma) greedy tokens/s (median of
``--repeats`` generations, interleaved). Prints one JSON line per dtype.

    python scripts/compile_bench.py --dtypes float32 bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import specgen

SIZES = (1, 2, 4, 8, 16)
CONTEXT = 192
PROMPT = ("Copy this list twice, one item a line, exactly as written: apple pie, banana bread, cherry tart, "
          "date loaf, elderberry jam, fig roll, grape jelly, honey cake.")


def _pipeline(target: str, dtype: str, threads: int, gamma: int, compile_: bool):
    return specgen.pipeline(f"target={target}", f"dtype={dtype}", f"threads={threads}", "drafter=ngram",
                            f"drafter.num_tokens={gamma}", "sampling.temperature=0",
                            f"compile={str(compile_).lower()}", progress=False)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _forward_s(lm, cache, n: int) -> float:
    """Seconds of one n-token forward after CONTEXT cached tokens (the cache is cropped back)."""
    seconds = _timed(lambda: lm.forward(cache, [(7 * i) % 1000 + 5 for i in range(n)], keep=n, check=False))
    cache.crop(CONTEXT)
    return seconds


def measure(target: str, dtype: str, threads: int, repeats: int, max_new_tokens: int, gamma: int) -> dict:
    eager = _pipeline(target, dtype, threads, gamma, False)
    compiled = _pipeline(target, dtype, threads, gamma, True)
    context = [(13 * i) % 1000 + 5 for i in range(CONTEXT)]
    caches = {}
    for name, pipe in (("eager", eager), ("compiled", compiled)):
        caches[name] = pipe.target.new_cache()
        pipe.target.forward(caches[name], context, keep=1)  # the prefill (eager on both sides)
    compile_s = {n: _forward_s(compiled.target, caches["compiled"], n) for n in SIZES}  # first call per bucket
    forward_s = {"eager": {n: [] for n in SIZES}, "compiled": {n: [] for n in SIZES}}
    for _ in range(repeats):
        for n in SIZES:
            for name, pipe in (("eager", eager), ("compiled", compiled)):
                forward_s[name][n].append(_forward_s(pipe.target, caches[name], n))
    rates = {f"{name} {mode}": [] for mode in ("plain", "spec") for name in ("eager", "compiled")}
    tokens = {}
    for name, pipe in (("eager", eager), ("compiled", compiled)):  # untimed warm-up
        pipe.generate(PROMPT, max_new_tokens=8, speculative=False)
        pipe.generate(PROMPT, max_new_tokens=8)
    for _ in range(repeats):
        for mode in ("plain", "spec"):
            for name, pipe in (("eager", eager), ("compiled", compiled)):
                start = time.perf_counter()
                out = pipe.generate(PROMPT, max_new_tokens=max_new_tokens, speculative=mode == "spec")
                rates[f"{name} {mode}"].append(len(out.token_ids) / (time.perf_counter() - start))
                tokens[f"{name} {mode}"] = out.token_ids
    return {
        "dtype": dtype, "threads": threads, "gamma": gamma, "max_new_tokens": max_new_tokens,
        "compile_s": {n: round(s, 1) for n, s in compile_s.items()},
        "forward_ms": {name: {n: round(1e3 * min(v), 2) for n, v in per.items()} for name, per in forward_s.items()},
        "tok_s": {key: round(statistics.median(v), 1) for key, v in rates.items()},
        "same_tokens": {mode: tokens[f"eager {mode}"] == tokens[f"compiled {mode}"] for mode in ("plain", "spec")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args()
    for dtype in args.dtypes:
        print(json.dumps(measure(args.target, dtype, args.threads, args.repeats, args.max_new_tokens, args.gamma)),
              flush=True)


if __name__ == "__main__":
    main()
