"""What a prompt's prefill costs on llama.cpp by the width its decodes are split at (PREFILL_TOKENS).

Usage: python scripts/prefill_split_probe.py [--threads 1] [--widths 16,32,64,512] [overrides ...]

For each width, on a context opened with llama_context.PREFILL_TOKENS set to it, the process CPU
time (not wall clock: the figures hold on a loaded machine, one thread) of: a short chat prompt's
prefill with its first logits ("short"); one chunk of a 3,000-token prompt at position 0 and at
position 2,048 (per token); the whole 3,000-token prompt with its first logits ("long"). The widths
run one after another in one process.
"""

from __future__ import annotations

import argparse
import time

import specgen
from specgen.models import llama_context


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
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    pipe = specgen.pipeline(f"threads={args.threads}", "drafter=none", *args.overrides, progress=False)
    target = pipe.target
    long_ids, short_ids = probe_prompts(pipe)
    print(f"model {pipe.config.target.get('name')}  threads {args.threads}  short prompt {len(short_ids)} "
          f"tokens  long prompt {len(long_ids)} tokens  (process CPU time)")
    for width in (int(w) for w in args.widths.split(",")):
        llama_context.PREFILL_TOKENS = width
        context = target.open_context(4096, 1)
        handle = context.new_handle()
        short = cpu(lambda: context.forward_rows([handle], [short_ids], [1]))
        handle.crop(0)
        at0 = cpu(lambda: context.forward_rows([handle], [long_ids[:width]], [0]))
        handle.crop(0)
        context.forward_rows([handle], [long_ids[:2048]], [0])
        at2k = cpu(lambda: context.forward_rows([handle], [long_ids[2048:2048 + width]], [0]))
        handle.crop(0)
        long = cpu(lambda: context.forward_rows([handle], [long_ids], [1]))
        handle.release()
        context.close()
        print(f"split {width:4d}  short {short * 1e3:6.0f} ms  chunk at 0 {at0 / width * 1e3:5.1f} ms/token  "
              f"at 2048 {at2k / width * 1e3:5.1f} ms/token  long {long:6.1f} s")


if __name__ == "__main__":
    main()
