"""Time to first token of each turn of a multi-turn chat, with the prefix cache and without it.

One process holds two pipelines on the same model and settings, one with the default
``prefix_cache`` and one with ``prefix_cache.entries=0``. Each turn of the conversation
runs on both, in alternating order (so drift in the machine's load falls on both arms
alike), and the two replies must be the same tokens: the cached arm's exactness is
checked on every turn, not assumed. The user turns are held-out ShareGPT first turns
(``specgen.bench.prompts``, the builtin set where the dataset is not installed); each
reply is appended to the conversation as the assistant message before the next turn.
``--repeats`` runs the whole conversation again from an empty cache.

    python scripts/prefix_cache_bench.py [--turns 5] [--repeats 3] [--max-new-tokens 32] [override ...]

Overrides are specgen's (``threads=1`` is the default here; ``backend=``, ``target=`` ...).
Prints one row per turn: prompt tokens, tokens the cache gave, median TTFT of each arm and
their ratio. A machine shared with other work makes single timings noisy: compare the
paired medians, and say how loaded the machine was.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import specgen
from specgen.bench.prompts import load_prompt_sets, sharegpt_path


def user_turns(count: int) -> list[str]:
    names = ["sharegpt"] if sharegpt_path() is not None else ["builtin"]
    prompts = load_prompt_sets(names, count)
    if len(prompts) < count:
        sys.exit(f"only {len(prompts)} prompts in {names[0]}; ask for fewer --turns")
    return [p.prompt if isinstance(p.prompt, str) else p.prompt[-1]["content"] for p in prompts]


def run_conversation(arms: dict, turns: list[str], max_new: int, times: dict, reused: dict, lengths: dict) -> None:
    """Every turn on both arms (alternating which goes first); records each arm's TTFT per turn."""
    messages: list[dict] = []
    for index, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        order = list(arms) if index % 2 == 0 else list(reversed(arms))
        replies = {}
        for name in order:
            gen = arms[name].generate(list(messages), chat=True, max_new_tokens=max_new)
            replies[name] = gen
            times[name].setdefault(index, []).append(gen.stats.ttft)
        cached, fresh = replies["cached"], replies["fresh"]
        if cached.token_ids != fresh.token_ids:
            sys.exit(f"turn {index + 1}: the cached arm's reply differs from the fresh arm's")
        reused.setdefault(index, []).append(cached.stats.prefill_reused)
        lengths[index] = cached.stats.prompt_tokens
        messages.append({"role": "assistant", "content": fresh.text})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    overrides = ["threads=1", *args.overrides]
    arms = {"cached": specgen.pipeline(*overrides, progress=False),
            "fresh": specgen.pipeline(*overrides, "prefix_cache.entries=0", progress=False)}
    turns = user_turns(args.turns)
    times: dict = {name: {} for name in arms}
    reused: dict = {}
    lengths: dict = {}
    for _ in range(args.repeats):
        arms["cached"].prefix_cache.clear()
        run_conversation(arms, turns, args.max_new_tokens, times, reused, lengths)
    target = arms["cached"].target
    print(f"# {target.name} on {target.backend}, {' '.join(overrides)}, guarantee {arms['cached'].guarantee}; "
          f"{args.repeats} repeats, medians; both arms gave the same tokens on every turn")
    print("turn  prompt  cached  ttft_cached_ms  ttft_fresh_ms  fresh/cached")
    for index in range(args.turns):
        on, off = (statistics.median(times[name][index]) for name in ("cached", "fresh"))
        print(f"{index + 1:>4}  {lengths[index]:>6}  {statistics.median(reused[index]):>6.0f}  "
              f"{1e3 * on:>14.1f}  {1e3 * off:>13.1f}  {off / on:>12.2f}")


if __name__ == "__main__":
    main()
