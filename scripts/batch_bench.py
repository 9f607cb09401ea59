"""Tokens/s of the batched engine (Pipeline.generate_batch) against the single-request loop.

Usage: python scripts/batch_bench.py [--drafter none|ngram] [--batch-sizes 1 4 8] [--prompts 8]
       [--max-new-tokens 48] [--threads 2] [--num-tokens 4] [overrides ...]

Runs the same greedy prompts through ``generate()`` one at a time (the oracle) and
through ``generate_batch`` at each batch size; prints tokens/s of each and whether
every batched output equals the single-request output token for token.
Wall-clock numbers depend on machine load: report the load with them.
"""

from __future__ import annotations

import argparse
import os
import time

import specgen

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of copper.",
    "What is the capital of France? Answer in one sentence.",
    "Give me a recipe for pancakes.",
    "Summarise the plot of Hamlet.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "Name the planets of the solar system.",
    "What does a compiler do?",
    "Write a haiku about autumn leaves.",
    "How do vaccines work?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", default="2")
    parser.add_argument("--num-tokens", default="4", help="γ for a drafter (fixed: no cost-table measurement)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [f"threads={args.threads}", "dtype=float32", f"drafter={args.drafter}", *args.overrides]
    if args.drafter != "none":
        overrides.append(f"drafter.num_tokens={args.num_tokens}")
    pipe = specgen.pipeline(*overrides, progress=False)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    options = dict(max_new_tokens=args.max_new_tokens, seed=0)
    pipe.generate(prompts[0], max_new_tokens=4)  # warm-up

    start = time.perf_counter()
    single = [pipe.generate(p, **options) for p in prompts]
    wall = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in single)
    print(f"load average {os.getloadavg()[0]:.2f}; {' '.join(overrides)}; {len(prompts)} prompts, "
          f"max_new_tokens={args.max_new_tokens}")
    print(f"single-request loop: {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s")
    for size in args.batch_sizes:
        start = time.perf_counter()
        batch = pipe.generate_batch(prompts, batch_size=size, **options)
        wall = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in batch)
        same = sum(b.token_ids == s.token_ids for b, s in zip(batch, single, strict=True))
        drafted = sum(g.stats.drafted for g in batch)
        accepted = sum(g.stats.accepted for g in batch)
        print(f"batch_size={size}: {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s; "
              f"identical to single-request: {same}/{len(prompts)}; drafted {drafted}, accepted {accepted}")


if __name__ == "__main__":
    main()
