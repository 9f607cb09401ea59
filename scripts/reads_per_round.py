"""Host reads per speculative round for each drafter, with and without ``read_once``, as a
Markdown table (docs/benchmarks.md, "Host reads per round").

    python scripts/reads_per_round.py --target smollm2-135m --rounds 6

Counts with specgen.bench.host_reads.counting_reads (the CPU stand-in for
``torch.cuda.set_sync_debug_mode``), through scripts/gpu_check.py's ``reads_per_round``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from gpu_check import PROMPT, reads_per_round  # noqa: E402 (the sibling script)


def main(argv: list[str] | None = None) -> int:
    import specgen

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafters", default="ngram,eagle,medusa,mtp")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    print("| drafter | T | γ | reads/round, read_once | reads/round, CPU rounds |")
    print("|---|---|---|---|---|")
    for drafter in args.drafters.split(","):
        for temperature in (0.0, 0.8):
            for gamma in (2, 6):
                pipe = specgen.pipeline(f"target={args.target}", f"drafter={drafter}", f"device={args.device}",
                                        f"drafter.num_tokens={gamma}", f"sampling.temperature={temperature}",
                                        "threads=1", progress=False)
                ids = pipe.encode(PROMPT)
                reads = {}
                for read_once in (True, False):
                    pipe.read_once = read_once
                    reads[read_once] = reads_per_round(pipe, ids, gamma, rounds=args.rounds)
                print(f"| {drafter} | {temperature:g} | {gamma} | {reads[True]:.1f} | {reads[False]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
