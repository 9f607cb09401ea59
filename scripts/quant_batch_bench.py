"""Tokens/s of ``generate_batch`` against one request at a time, per numerical path, arms interleaved in one process.

    python scripts/quant_batch_bench.py [--arms int4,w8a8,llama_cpp] [--batch-size 8] [--prompts 8]
        [--max-new-tokens 64] [--repeats 3] [--threads 1] [--speculative]

Each arm is the default target (SmolLM2-135M, its packaged GGUF) on one path: ``int4``/``int8``/``w8a8``
are ``backend=torch dtype=<arm>``, ``llama_cpp`` is ``backend=llama_cpp`` (the default path). The
prompts are held-out ShareGPT first turns and HumanEval stubs (``specgen.bench.prompts``), half
each, greedy, EOS masked (every row generates ``--max-new-tokens``), prefix cache off (each request
prefills its whole prompt in both modes). One sample is one arm and mode over the whole list:
``single`` runs ``pipe.generate`` per prompt, ``batch`` runs ``generate_batch`` with ``--batch-size``
rows; within a repeat the arms and modes go in a rotated order, so none always runs first. Prints
per arm the median tok/s of each mode, the per-repeat ratios batch / single (paired: the two ran in
the same repeat) and whether every batched row equals its single run token for token.
``--speculative``: the pipeline's drafter (ngram, γ auto) in both modes instead of plain decoding.
``--steps N``: instead, per quantized arm, the forward of one token for each of B = 1 and 8 rows
(rows after 150..199-token contexts), the fastest of N interleaved, and the time its linear layers'
kernels took inside it (what a batched decode step costs against a single one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import specgen
from specgen.bench.prompts import load_prompt_sets
from specgen.models.quantized.kernels import QuantLinear


def pipeline(arm: str, threads: int, speculative: bool, max_new: int):
    backend = ["backend=llama_cpp"] if arm == "llama_cpp" else ["backend=torch", f"dtype={arm}"]
    drafter = "drafter=ngram" if speculative else "drafter=none"
    return specgen.pipeline(f"threads={threads}", *backend, drafter, "prefix_cache.entries=0",
                            f"sampling.min_new_tokens={max_new}", progress=False)


def run(pipe, prompts: list[list[int]], mode: str, batch_size: int, max_new: int) -> tuple[list[list[int]], float]:
    options = dict(max_new_tokens=max_new, seed=0)
    start = time.perf_counter()
    if mode == "single":
        outputs = [list(pipe.generate(prompt_ids=ids, **options).token_ids) for ids in prompts]
    else:
        rows = [{"prompt_ids": ids} for ids in prompts]
        outputs = [list(g.token_ids) for g in pipe.generate_batch(rows, batch_size=batch_size, **options)]
    return outputs, time.perf_counter() - start


def steps(pipes: dict, repeats: int, rows: int) -> None:
    """Print each quantized arm's one-token forward of 1 and ``rows`` rows (see the module docstring)."""
    native, spent = QuantLinear.native, [0.0]

    def timed(layer, x):
        start = time.perf_counter()
        out = native(layer, x)
        spent[0] += time.perf_counter() - start
        return out

    contexts = [[(7919 * i + 13 * r + 11) % 20000 + 100 for i in range(150 + 7 * r)] for r in range(rows)]
    best: dict[tuple[str, int], tuple[float, float]] = {}
    QuantLinear.native = timed
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                for arm, pipe in pipes.items():
                    lm = pipe.target
                    if not hasattr(lm, "forward_rows"):
                        continue
                    for size in (1, rows):
                        caches = [lm.new_cache() for _ in range(size)]
                        for cache, ids in zip(caches, contexts):
                            lm.forward(cache, ids, 1)
                        spent[0] = 0.0
                        start = time.perf_counter()
                        lm.forward_rows(caches, [[5]] * size, [1] * size)
                        took = time.perf_counter() - start
                        if took < best.get((arm, size), (float("inf"),))[0]:
                            best[arm, size] = (took, spent[0])
    finally:
        QuantLinear.native = native
    print(f"load average {os.getloadavg()}")
    for (arm, size), (took, kernels) in best.items():
        print(f"{arm} {size} row(s): {took * 1e3:.2f} ms, kernels {kernels * 1e3:.2f} ms, other {(took - kernels) * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="int4,w8a8,llama_cpp")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speculative", action="store_true")
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    arms = args.arms.split(",")
    pipes = {arm: pipeline(arm, args.threads, args.speculative, args.max_new_tokens) for arm in arms}
    if args.steps:
        torch.set_num_threads(args.threads)
        return steps(pipes, args.steps, args.batch_size)
    first = pipes[arms[0]]
    sets = load_prompt_sets(["sharegpt", "humaneval"], 4 * args.prompts)
    by_task = {task: [first.encode(p.prompt) for p in sets if p.task == task] for task in ("sharegpt", "humaneval")}
    kept = {task: [ids for ids in encoded if len(ids) <= args.max_prompt_tokens] for task, encoded in by_task.items()}
    half = args.prompts // 2
    prompts = kept["sharegpt"][:half] + kept["humaneval"][:args.prompts - half]
    print(f"{len(prompts)} prompts ({sorted(len(p) for p in prompts)} tokens), {args.max_new_tokens} new tokens each, "
          f"batch {args.batch_size}, threads {args.threads}, {'ngram γ auto' if args.speculative else 'plain'}")
    for arm, pipe in pipes.items():  # warm-up, and the planner's tables measured before any timing
        run(pipe, prompts[:2], "single", 2, 8)
        run(pipe, prompts[:2], "batch", 2, 8)
        print(f"{arm}: {pipe.target.describe()}")
    samples: dict[tuple[str, str], list[float]] = {}
    same: dict[str, list[bool]] = {arm: [] for arm in arms}
    cells = [(arm, mode) for arm in arms for mode in ("single", "batch")]
    for repeat in range(args.repeats):
        order = cells[repeat % len(cells):] + cells[:repeat % len(cells)]
        outputs = {}
        for arm, mode in (order if repeat % 2 == 0 else order[::-1]):
            out, wall = run(pipes[arm], prompts, mode, args.batch_size, args.max_new_tokens)
            outputs[arm, mode] = out
            samples.setdefault((arm, mode), []).append(sum(map(len, out)) / wall)
        for arm in arms:
            same[arm].append(outputs[arm, "batch"] == outputs[arm, "single"])
        print(f"repeat {repeat}: load {os.getloadavg()[0]:.2f}; "
              + "; ".join(f"{arm} {mode} {samples[arm, mode][-1]:.1f}" for arm, mode in cells))
    print(f"load average {os.getloadavg()}")
    print("| path | one at a time tok/s | batch tok/s | batch / one, per repeat: median [min–max] | rows = single |")
    print("|---|---|---|---|---|")
    for arm in arms:
        single, batch = samples[arm, "single"], samples[arm, "batch"]
        ratios = [b / s for b, s in zip(batch, single)]
        print(f"| {arm} | {statistics.median(single):.1f} | {statistics.median(batch):.1f} | "
              f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}] | "
              f"{'yes' if all(same[arm]) else 'no'} |")


if __name__ == "__main__":
    main()
