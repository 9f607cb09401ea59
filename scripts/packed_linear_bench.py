"""Whole-forward cost of n new tokens with oneDNN-packed linear layers and with PyTorch's ``linear``.

    python scripts/packed_linear_bench.py [--threads 1] [--target smollm2-135m] [--repeats 6] [--sizes 1,2,3,4,5,8,12,16]

For each n, over a 192-token context, prints the forward time relative to the
1-token forward through ``linear`` (every PackedLinear switched off), for
``linear`` and for the packed path, measured interleaved in one process: the
table in docs/benchmarks.md ("Verify costs and packed weights").
"""

from __future__ import annotations

import argparse
import time

import torch

import specgen
from specgen.models import packed_linear
from specgen.models.target import hf_model_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--sizes", default="1,2,3,4,5,8,12,16")
    args = parser.parse_args()
    pipe = specgen.pipeline(f"target={args.target}", "backend=torch", "drafter=none", f"threads={args.threads}",
                            f"dtype={args.dtype}")
    lm = pipe.target
    model = hf_model_of(lm)
    vocab = pipe.tokenizer.vocab_size
    context = [(7919 * i + 11) % vocab for i in range(192)]
    cache = lm.new_cache()
    lm.forward(cache, context[:-1], keep=1)
    base = len(cache)
    sizes = [int(s) for s in args.sizes.split(",")]
    times = {mode: {n: [] for n in sizes} for mode in ("linear", "packed")}
    for _ in range(args.repeats):
        for mode in times:
            packed_linear.set_enabled(model, mode == "packed")
            for n in sizes:
                feed = [context[-1]] + context[: n - 1]
                lm.forward(cache, feed, keep=n)  # untimed: packs the weights; a shape's first forward may cost more
                cache.crop(base)
                start = time.perf_counter()
                lm.forward(cache, feed, keep=n)
                times[mode][n].append(time.perf_counter() - start)
                cache.crop(base)
    unit = min(times["linear"][1])
    print(f"{args.target} {args.dtype}, {torch.get_num_threads()} threads; "
          f"unit = a 1-token forward through linear = {unit * 1e3:.1f} ms")
    print("| layers | " + " | ".join(f"n={n}" for n in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    for mode, rows in times.items():
        print(f"| {mode} | " + " | ".join(f"{min(rows[n]) / unit:.2f}" for n in sizes) + " |")


if __name__ == "__main__":
    main()
