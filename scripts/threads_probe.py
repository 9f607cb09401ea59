"""Decode rate of the default model on the torch backend at a given thread count.

    python scripts/threads_probe.py THREADS {plain,batch} [--busy N]

``plain``: four prompts one at a time; ``batch``: eight prompts in one
``generate_batch`` (batch_size 8); 40 new tokens each, speculation off.
``--busy N`` runs N busy-looping processes alongside (other work on the
cores). Prints one JSON line: the threads asked for, the threads used and
tok/s over the timed part (a 4-token warm-up is left out).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

PROMPTS = [
    "Write a short story about a robot.", "Explain how a CPU cache works.", "List three uses of Python.",
    "What is the capital of France and why?", "Describe the water cycle.", "Give tips for learning to cook.",
    "How do airplanes fly?", "Summarise the plot of Hamlet.",
]


def _spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("threads", help="an int or auto")
    ap.add_argument("mode", choices=["plain", "batch"])
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes to run alongside")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args()
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    try:
        import specgen
        import torch

        time.sleep(0.5 if spinners else 0)
        pipe = specgen.pipeline(f"threads={args.threads}", "backend=torch", "speculative=false",
                                f"max_new_tokens={args.max_new_tokens}", progress=False)
        pipe.generate(PROMPTS[0], max_new_tokens=4)
        start, tokens = time.perf_counter(), 0
        if args.mode == "batch":
            tokens = sum(len(g.token_ids) for g in pipe.generate_batch(PROMPTS, batch_size=8))
        else:
            tokens = sum(len(pipe.generate(p).token_ids) for p in PROMPTS[:4])
        elapsed = time.perf_counter() - start
        print(json.dumps({"threads": args.threads, "used": torch.get_num_threads(), "mode": args.mode,
                          "busy": args.busy, "tok_s": round(tokens / elapsed, 2)}))
    finally:
        for s in spinners:
            s.terminate()


if __name__ == "__main__":
    main()
