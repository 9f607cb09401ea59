"""What skipping the padding of a ragged batched step saves, interleaved in one process.

Times one batched forward (:meth:`specgen.batch.BatchKV.forward`) of 8 rows after
250-285-token prefills (compacted) for several feed shapes, once with the linear layers
multiplying only the real tokens (``packed_linear.real_tokens``, the default) and once
with them multiplying the padding too. Prints the fastest and the median of the timed
forwards per cell (the first of each cell is a warm-up). Wall-clock figures depend on
machine load: report the load with them (docs/benchmarks.md, "Ragged steps").

    python scripts/ragged_bench.py --threads 1 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specgen
from specgen.batch.kv import BatchKV
from specgen.models import packed_linear

SHAPES = {
    "8 x 5 tokens (no padding)": [5] * 8,
    "one row 5, seven rows 1": [5] + [1] * 7,
    "5, 3, 2 and five rows of 1": [5, 3, 2] + [1] * 5,
    "one row 9, seven rows 1": [9] + [1] * 7,
    "8 x 1 token": [1] * 8,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    pipe = specgen.pipeline(f"threads={args.threads}", f"dtype={args.dtype}", progress=False)
    vocab = pipe.tokenizer.vocab_size
    context = [(7919 * i + 11) % vocab for i in range(300)]
    kv = BatchKV(pipe.target, 8)
    for r in range(8):
        kv.prefill(r, context[: 250 + 5 * r])
    kv.compact()
    lengths, width = [len(row) for row in kv.rows], kv.width
    skipping = packed_linear.real_tokens

    def padded(real: torch.Tensor, device=None):
        return skipping(torch.ones_like(real), device)

    def timed(feeds: list[list[int]], skip: bool) -> float:
        packed_linear.real_tokens = skipping if skip else padded
        start = time.perf_counter()
        kv.forward(feeds, [len(feed) for feed in feeds])
        spent = time.perf_counter() - start
        for row, length in zip(kv.rows, lengths, strict=True):
            row.crop(length)
        kv.rewind(width)
        return spent

    times: dict[tuple[str, bool], list[float]] = {}
    try:
        for _ in range(args.repeats):
            for name, widths in SHAPES.items():
                for skip in (False, True):
                    times.setdefault((name, skip), []).append(timed([context[:w] for w in widths], skip))
    finally:
        packed_linear.real_tokens = skipping
    print(f"threads={args.threads} dtype={args.dtype}, 8 rows, {width} shared slots; ms: fastest [median]")
    print("| feeds | padded | padding skipped |\n|---|---|---|")
    for name in SHAPES:
        cells = []
        for skip in (False, True):
            kept = times[(name, skip)][1:]
            cells.append(f"{1e3 * min(kept):.0f} [{1e3 * statistics.median(kept):.0f}]")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
