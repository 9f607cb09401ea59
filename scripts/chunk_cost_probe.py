"""What one prompt chunk costs on a llama.cpp batch row by its width and depth, beside one decode step.

Usage: python scripts/chunk_cost_probe.py [--threads 1] [--widths 1,4,32] [--depths 0,1000,2968] [overrides ...]

On a :class:`specgen.models.llama_batch.LlamaBatch` of two rows, the process CPU time (not wall clock:
the figures hold on a loaded machine, one thread) of: one decode step of a short chat prompt's row
(one token at its prompt's depth); and a chunk of a 3,000-token prompt's row (no logits read) of each
width at each depth, the row holding that many of the prompt's tokens before it. Median of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import specgen
from prefill_split_probe import probe_prompts  # the same prompts (scripts/ is on the path when a script runs)


def cpu_ms(action, repeats: int) -> float:
    """Median process CPU milliseconds of ``action()`` over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        action()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1")
    parser.add_argument("--widths", default="1,4,32")
    parser.add_argument("--depths", default="0,1000,2968")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    pipe = specgen.pipeline(f"threads={args.threads}", "drafter=none", *args.overrides, progress=False)
    target = pipe.target
    long_ids, short_ids = probe_prompts(pipe)
    batch = target.new_batch(2, 4096)
    batch.clear_row(1)  # the context for both rows
    context, long_row, short_row = batch.context, batch.rows[0], batch.rows[1]
    context.forward_rows([short_row], [short_ids[:-1]], [0])

    def decode():
        short_row.crop(len(short_ids) - 1)
        context.forward_rows([short_row], [short_ids[-1:]], [1])

    print(f"model {pipe.config.target.get('name')} ({target.describe()['dtype']})  threads {args.threads}  "
          f"process CPU ms, median of {args.repeats}")
    print(f"decode step of a short row ({len(short_ids)} tokens): {cpu_ms(decode, args.repeats):.1f} ms")
    widths = [int(w) for w in args.widths.split(",")]
    for depth in (int(d) for d in args.depths.split(",")):
        long_row.crop(0)
        if depth:
            context.forward_rows([long_row], [long_ids[:depth]], [0])
        cells = []
        for width in widths:
            def chunk(width=width):
                long_row.crop(depth)
                context.forward_rows([long_row], [long_ids[depth: depth + width]], [0])
            ms = cpu_ms(chunk, args.repeats)
            cells.append(f"w={width}: {ms:6.1f} ms ({ms / width:5.1f}/token)")
        print(f"chunk at depth {depth:5d}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
