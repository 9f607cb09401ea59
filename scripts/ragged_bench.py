"""What skipping the padding of a ragged batched step saves, interleaved in one process.

Times one batched forward (:meth:`specgen.models.batch_kv.BatchKV.forward`) of 8 rows after
prefills of ``--prefill`` to ``--prefill`` + 35 tokens (compacted) for several feed shapes,
two ways: every row fed the widest row's width (what computing the padding costs); and the
rows' real tokens fed flat (:class:`specgen.models.attention.BatchRows`: no padding reaches a
linear layer or an attention call; the default). Prints the fastest and the median of the
timed forwards per cell (the first of each cell is a warm-up). The torch backend (``backend=torch``):
its rows share one padded cache width.
Wall-clock figures depend on machine load: report the load with them
(docs/benchmarks.md, "Batching": one batched forward by feed shape).

    python scripts/ragged_bench.py --threads 1 --dtype float32 [--prefill 450]
"""

from __future__ import annotations

import argparse
import statistics
import time

import specgen
from specgen.models.batch_kv import BatchKV

SHAPES = {
    "8 x 5 tokens (no padding)": [5] * 8,
    "one row 5, seven rows 1": [5] + [1] * 7,
    "5, 3, 2 and five rows of 1": [5, 3, 2] + [1] * 5,
    "one row 9, seven rows 1": [9] + [1] * 7,
    "4, 3, 6, 1, 5, 2, 4, 1 (26 tokens)": [4, 3, 6, 1, 5, 2, 4, 1],
    "8 x 1 token": [1] * 8,
}
MODES = ("padded (every row fed the widest)", "flat (the default)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill", type=int, default=250, help="the shortest row's prefill (tokens)")
    args = parser.parse_args()
    pipe = specgen.pipeline("backend=torch", f"threads={args.threads}", f"dtype={args.dtype}", progress=False)
    vocab = pipe.tokenizer.vocab_size
    context = [(7919 * i + 11) % vocab for i in range(args.prefill + 50)]
    kv = BatchKV(pipe.target, 8)
    for r in range(8):
        kv.prefill(r, context[: args.prefill + 5 * r])
    kv.compact()
    lengths, width = [len(row) for row in kv.rows], kv.width

    def timed(feeds: list[list[int]], mode: int) -> float:
        keeps = [len(feed) for feed in feeds]
        if mode == 0:
            feeds = [context[: max(keeps)]] * len(feeds)
        start = time.perf_counter()
        kv.forward(feeds, keeps)
        spent = time.perf_counter() - start
        for row, length in zip(kv.rows, lengths, strict=True):
            row.crop(length)
        kv.rewind(width)
        return spent

    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for name, widths in SHAPES.items():
            for mode in range(len(MODES)):
                times.setdefault((name, mode), []).append(timed([context[:w] for w in widths], mode))
    print(f"threads={args.threads} dtype={args.dtype}, 8 rows, {width} shared slots; ms: fastest [median]")
    print(f"| feeds | {' | '.join(MODES)} |\n|---|{'---|' * len(MODES)}")
    for name in SHAPES:
        cells = []
        for mode in range(len(MODES)):
            kept = times[(name, mode)][1:]
            cells.append(f"{1e3 * min(kept):.0f} [{1e3 * statistics.median(kept):.0f}]")
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
