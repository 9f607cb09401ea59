"""Whole-forward cost of n new tokens with and without the weight-major small-row path.

    python scripts/small_rows_bench.py [--threads 1] [--target smollm2-135m] [--repeats 6]

Prints, for n = 1..8 over a 192-token context, the forward time relative to the
1-token forward through PyTorch's ``linear`` (every SmallRowsLinear set to
``max_rows=0``), for ``linear`` and for specgen's path, measured interleaved:
the table in the docstring of ``specgen/models/small_rows.py``.
"""

from __future__ import annotations

import argparse
import time

import torch

import specgen
from specgen.models.small_rows import SmallRowsLinear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    pipe = specgen.pipeline(f"target={args.target}", "drafter=none", f"threads={args.threads}")
    lm = pipe.target
    layers = [m for m in lm.model.modules() if isinstance(m, SmallRowsLinear)]
    limits = [m.max_rows for m in layers]
    vocab = pipe.tokenizer.vocab_size
    context = [(7919 * i + 11) % vocab for i in range(192)]
    cache = lm.new_cache()
    lm.forward(cache, context[:-1], keep=1)
    base = len(cache)
    sizes = range(1, args.max_tokens + 1)
    times = {mode: {n: [] for n in sizes} for mode in ("linear", "specgen")}
    for _ in range(args.repeats):
        for mode in times:
            for layer, limit in zip(layers, limits):
                layer.max_rows = 0 if mode == "linear" else limit
            for n in sizes:
                feed = [context[-1]] + context[: n - 1]
                lm.forward(cache, feed, keep=n)  # untimed: a shape's first forward may cost more
                cache.crop(base)
                start = time.perf_counter()
                lm.forward(cache, feed, keep=n)
                times[mode][n].append(time.perf_counter() - start)
                cache.crop(base)
    unit = min(times["linear"][1])
    print(f"{args.target}, {torch.get_num_threads()} threads, unit = 1-token linear forward = {unit * 1e3:.1f} ms")
    print("mode     " + " ".join(f"n={n:<3d}" for n in sizes))
    for mode, rows in times.items():
        print(f"{mode:8s} " + " ".join(f"{min(rows[n]) / unit:5.2f}" for n in sizes))


if __name__ == "__main__":
    main()
