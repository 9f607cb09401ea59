"""Short requests' time to first token beside a long prompt's prefill, on the online batch (BatchScheduler).

Usage: python scripts/fair_serve_bench.py [--long-tokens 3000] [--shorts 3] [--trials 5] [--warmup 1]
       [--delay 0] [--gap 0.05] [--threads 2] [--prefill-tokens N] [--arms shorts,chunked,grid,whole] [overrides ...]

Four arms on one pipeline (the default model unless overrides say otherwise), interleaved trial by
trial in one process:

* solo: a short request alone on an idle scheduler;
* shorts: the ``--shorts`` short requests ``--gap`` seconds apart on an idle scheduler, no long prompt
  (what they cost each other: on one thread their prefills queue);
* chunked: a ``--long-tokens`` prompt is submitted, then, ``--delay`` seconds later, ``--shorts`` short
  requests ``--gap`` seconds apart while it prefills (a chunk per step, :func:`specgen.batch.steps.prefill_chunks`);
* grid: as chunked, with the long prompt's chunks on the splits its solo run decodes at (``prefill_chunk``
  tokens each), where chunked sizes them by time when the model measures splits free
  (:meth:`specgen.models.llama_batch.LlamaBatch.prefill_take`);
* whole: the same with ``chunked_prefill=False`` (the long prompt prefilled in one step).

Each trial's long prompt is the same tokens rotated by the trial's number, so no batch slot holds a
prefix of it (a slot keeps its last request's entries for the next; see :class:`specgen.batch.steps.Batch`);
the short prompts share the chat template's preamble, solo as in the other arms.

Prints p50 / p99 TTFT (submission to first token) of each arm's short requests, their ratio to
solo's p50, and whether every short and long output equals its solo run token for token. The first
--warmup trials of each arm are run the same way but not counted: a batch's llama.cpp context grows
to the rows in use when they are first used (:class:`specgen.models.llama_batch.LlamaBatch`), once
per scheduler, and the figures are a running server's.
--prefill-tokens sets llama_cpp.prefill_split (the width a prompt's decodes are split at, solo and
batched alike; by default the model's measured one). Wall-clock numbers depend on machine load:
report the load with them.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import specgen
from specgen.batch import BatchScheduler
from specgen.events import FinishEvent, TokenEvent

SHORT = ["Name three colours.", "What is two plus two?", "Say hello in French.", "Give one word for happy."]


class Timed:
    """A request's submission time, first-token time and tokens (filled on the scheduler's thread)."""

    def __init__(self):
        self.sent = time.perf_counter()
        self.first: float | None = None
        self.tokens: list[int] = []
        self.done = threading.Event()

    def __call__(self, item) -> None:
        if isinstance(item, TokenEvent):
            if self.first is None:
                self.first = time.perf_counter()
            self.tokens.append(item.token_id)
        elif isinstance(item, FinishEvent) or isinstance(item, BaseException) or item is not None:
            self.done.set()

    @property
    def ttft(self) -> float:
        return self.first - self.sent


def _submit(scheduler: BatchScheduler, max_new: int, **request) -> Timed:
    timed = Timed()
    scheduler.submit(callback=timed, max_new_tokens=max_new, **request)
    return timed


def trial(scheduler: BatchScheduler, long_ids: list[int] | None, shorts: list[str], gap: float,
          long_new: int, delay: float = 0.0) -> tuple[list[Timed], Timed | None]:
    """The long prompt (if any), ``delay`` seconds later the first short, then each short ``gap`` seconds
    after the previous; waits for all."""
    long = _submit(scheduler, long_new, prompt_ids=long_ids) if long_ids else None
    time.sleep(delay)
    out = []
    for prompt in shorts:
        time.sleep(gap)
        out.append(_submit(scheduler, 4, prompt=prompt))
    for timed in [*out, *([long] if long else [])]:
        timed.done.wait()
    return out, long


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long-tokens", type=int, default=3000)
    parser.add_argument("--shorts", type=int, default=3)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted trials first")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds from the long prompt to the first short")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between submissions")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--prefill-tokens", type=int, default=None)
    parser.add_argument("--arms", default="shorts,chunked,whole", help="the arms beside solo, comma-separated")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    split = [f"llama_cpp.prefill_split={args.prefill_tokens}"] if args.prefill_tokens else []
    pipe = specgen.pipeline(f"threads={args.threads}", "drafter=none", *split, *args.overrides, progress=False)
    text = " ".join(f"item {i}: the quick brown fox jumps over the lazy dog." for i in range(args.long_tokens))
    long_ids = pipe.encode(text, chat=False)[: args.long_tokens]
    shorts = (SHORT * args.shorts)[: args.shorts]
    names = [name for name in ("shorts", "chunked", "grid", "whole") if name in args.arms.split(",")]
    arms = {"chunked": BatchScheduler(pipe, 8), "grid": BatchScheduler(pipe, 8),
            "whole": BatchScheduler(pipe, 8, chunked_prefill=False)}
    arms["grid"].batch.kv.splits = "grid"
    arms["shorts"] = arms["chunked"]
    ttft: dict[str, list[float]] = {name: [] for name in ("solo", *names)}
    long_ttft: dict[str, list[float]] = {name: [] for name in names if name != "shorts"}  # the long prompt's own
    solo_tokens = {p: pipe.generate(p, max_new_tokens=4).token_ids for p in shorts}
    same = True
    try:
        for number in range(args.warmup + args.trials):
            counted = number >= args.warmup
            # each trial's long prompt is new to the scheduler (rotated by the trial's number): a batch
            # slot keeps its last prompt's entries, and a repeated long prompt would prefill nothing
            fresh_long = long_ids[number:] + long_ids[:number]
            long_solo = pipe.generate(prompt_ids=fresh_long, max_new_tokens=8).token_ids
            for prompt in shorts:  # solo: one short at a time on an idle scheduler
                timed, _ = trial(arms["chunked"], None, [prompt], 0.0, 8)
                ttft["solo"].extend([timed[0].ttft] if counted else [])
            for name in names:
                timed, long = trial(arms[name], None if name == "shorts" else fresh_long, shorts, args.gap, 8,
                                    args.delay)
                ttft[name].extend(t.ttft for t in timed if counted)
                long_ttft.get(name, []).extend([long.ttft] if counted and long else [])
                same &= all(t.tokens == solo_tokens[p] for t, p in zip(timed, shorts, strict=True))
                same &= long is None or long.tokens == long_solo
    finally:
        for scheduler in (arms["chunked"], arms["grid"], arms["whole"]):
            scheduler.close()
    base = statistics.median(ttft["solo"])
    print(f"model {pipe.config.target.get('name')}  long prompt {len(long_ids)} tokens  "
          f"prefill split {pipe.target.prefill_width}  splits free {pipe.target.prefill_splits_free}  shorts/trial {len(shorts)} from {args.delay:g} s, "
          f"{args.gap:g} s apart  trials {args.trials} "
          f"(+{args.warmup} uncounted)")
    for name, values in ttft.items():
        p50, p99 = statistics.median(values), percentile(values, 0.99)
        print(f"{name:8s} n={len(values):3d}  p50 {p50 * 1e3:8.1f} ms  p99 {p99 * 1e3:8.1f} ms  "
              f"p99/solo p50 {p99 / base:6.2f}x")
    for name, values in long_ttft.items():
        print(f"{name:8s} the long prompt's own TTFT: median {statistics.median(values):6.1f} s")
    print(f"every output equals its solo run: {same}")


if __name__ == "__main__":
    main()
