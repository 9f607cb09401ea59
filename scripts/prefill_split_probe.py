"""What a prompt's prefill costs on llama.cpp by the width its decodes are split at (its prefill split).

Usage: python scripts/prefill_split_probe.py [--threads 1] [--widths 16,32,64,512] [--rounds 1]
       [--depth 2048] [--chunks-only] [overrides ...]

For each width, on a context opened with that prefill split, the process CPU time (not wall clock:
the figures hold on a loaded machine, one thread) of: a short chat prompt's prefill with its first
logits ("short"); one chunk of a 3,000-token prompt at position 0 and at position --depth (per
token); the whole 3,000-token prompt with its first logits ("long"). --rounds N times the widths in
turn N times and prints each width's least time of each kind (a busy VM only adds time);
--chunks-only times the two chunks alone. The widths run in one process; the first line names the
split the model chose (``llama_cpp.prefill_split``, auto by default).
"""

from __future__ import annotations

import argparse
import time

import specgen


def cpu(action) -> float:
    """Process CPU seconds that ``action()`` took."""
    start = time.process_time()
    action()
    return time.process_time() - start


def probe_prompts(pipe) -> tuple[list[int], list[int]]:
    """(a 3,000-token prompt of numbered filler lines, a short chat prompt) in ``pipe``'s tokens."""
    text = " ".join(f"item {i}: the quick brown fox jumps over the lazy dog." for i in range(3000))
    return pipe.encode(text, chat=False)[:3000], pipe.encode("Name three colours.", chat=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1")
    parser.add_argument("--widths", default="16,32,64,512")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--depth", type=int, default=2048)
    parser.add_argument("--chunks-only", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    pipe = specgen.pipeline(f"threads={args.threads}", "drafter=none", *args.overrides, progress=False)
    target = pipe.target
    long_ids, short_ids = probe_prompts(pipe)
    widths = [int(w) for w in args.widths.split(",")]
    print(f"model {pipe.config.target.get('name')}  threads {args.threads}  "
          f"the model's split {target.prefill_width}  short prompt {len(short_ids)} "
          f"tokens  long prompt {len(long_ids)} tokens  rounds {args.rounds}  (process CPU time, least)")
    contexts = {width: target.open_context(4096, 1, prefill_tokens=width) for width in widths}
    least: dict[int, dict[str, float]] = {width: {} for width in widths}
    try:
        for _ in range(args.rounds):
            for width, context in contexts.items():
                for kind, seconds in timed(context, width, long_ids, short_ids, args.depth, args.chunks_only).items():
                    least[width][kind] = min(least[width].get(kind, seconds), seconds)
    finally:
        for context in contexts.values():
            context.close()
    for width, times in least.items():
        line = (f"split {width:4d}  chunk at 0 {times['at0'] / width * 1e3:5.1f} ms/token  "
                f"at {args.depth} {times['deep'] / width * 1e3:5.1f} ms/token")
        if not args.chunks_only:
            line += f"  short {times['short'] * 1e3:6.0f} ms  long {times['long']:6.1f} s"
        print(line)


def timed(context, width: int, long_ids: list[int], short_ids: list[int], depth: int,
          chunks_only: bool) -> dict[str, float]:
    """One round's CPU seconds on ``context`` (split at ``width``): {"at0", "deep"} chunks, and
    {"short", "long"} prompts unless ``chunks_only``."""
    handle = context.new_handle()
    times = {"at0": cpu(lambda: context.forward_rows([handle], [long_ids[:width]], [1]))}
    handle.crop(0)
    context.forward_rows([handle], [long_ids[:depth]], [0])
    times["deep"] = cpu(lambda: context.forward_rows([handle], [long_ids[depth:depth + width]], [1]))
    if not chunks_only:
        handle.crop(0)
        times["short"] = cpu(lambda: context.forward_rows([handle], [short_ids], [1]))
        handle.crop(0)
        times["long"] = cpu(lambda: context.forward_rows([handle], [long_ids], [1]))
    handle.release()
    return times


if __name__ == "__main__":
    main()
