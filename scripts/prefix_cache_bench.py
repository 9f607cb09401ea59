"""Time to first token of each turn of a multi-turn chat, with the prefix cache and without it.

One process holds two pipelines on the same model and settings, one with the default
``prefix_cache`` and one with ``prefix_cache.entries=0``. Each turn of the conversation
runs on both, in alternating order (so drift in the machine's load falls on both arms
alike), and the two replies must be the same tokens: the cached arm's exactness is
checked on every turn, not assumed. The user turns are held-out ShareGPT first turns
(``specgen.bench.prompts``, the builtin set where the dataset is not installed); each
reply is appended to the conversation as the assistant message before the next turn.
``--repeats`` runs the whole conversation again from an empty cache.

Two references per turn: ``ideal``, the time the target takes to prefill only what a perfect
cache would not hold (the turn's prompt ids past their longest common prefix with the last
turn's prompt and reply), on a handle of its own already holding that prefix, timed after the
arms in each turn; and, with ``--llama-cpp``,
llama-cpp-python's own ``Llama.generate`` fed the same prompt ids turn after turn, which reuses
the longest prefix it still holds (its TTFT: the first token out).

    python scripts/prefix_cache_bench.py [--turns 5] [--repeats 3] [--max-new-tokens 32] [--llama-cpp] [--typing] [override ...]

The cached arm settles each reply in the background once the turn ends
(:mod:`specgen.models.prefix_cache`): it feeds what the next turn's prompt starts with (the
reply as the chat template renders it and the next user header; with
``prefix_cache.anticipate=false`` only where the target reuses only entries of prefills,
``prefill_floor`` above 1). That runs in the user's think time: the next turn starts only when it
is done, and ``settle_ms`` is how long it took, the think time the cached TTFT of the next turn
assumes (0 where nothing settles). So the cached arm may feed fewer tokens than ``new``, and cost
less than ``ideal``.

``--typing``: before each turn the cached arm also prepares the user's message as ``specgen-chat``
does while it is typed (``Pipeline.prepare``: the conversation up to the message's last complete
word) and waits for it, the typist's time; ``typed_ms`` is how long that took. Its TTFT is then the
prefill of the last word, the message's end and the generation prompt, so it may cost less than
``ideal``; the other arms do not prepare (llama-cpp-python cannot).

Overrides are specgen's (``threads=1`` is the default here; ``backend=``, ``target=`` ...).
Prints one row per turn: prompt tokens, tokens the cache gave, new tokens, the median TTFT
of each arm, the ratios (of the medians; ``llama/cached paired``: the median of each repeat's own
ratio, and its least), and the settle time after the turn. A machine shared with other work makes single timings noisy:
compare the paired medians, and say how loaded the machine was.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import specgen
from specgen.bench.prompts import load_prompt_sets, sharegpt_path


def user_turns(count: int) -> list[str]:
    names = ["sharegpt"] if sharegpt_path() is not None else ["builtin"]
    prompts = load_prompt_sets(names, count)
    if len(prompts) < count:
        sys.exit(f"only {len(prompts)} prompts in {names[0]}; ask for fewer --turns")
    return [p.prompt if isinstance(p.prompt, str) else p.prompt[-1]["content"] for p in prompts]


def llama_ttft(llm, ids: list[int], max_new: int) -> float:
    """llama-cpp-python's time to its first greedy token for ``ids``, reusing what its context holds;
    the reply is then generated to ``max_new`` tokens, so the next turn finds it there too."""
    start, ttft = time.perf_counter(), None
    for count, _ in enumerate(llm.generate(list(ids), top_k=0, top_p=1.0, min_p=0.0, temp=0.0,
                                           repeat_penalty=1.0, reset=True), start=1):
        ttft = time.perf_counter() - start if ttft is None else ttft
        if count >= max_new:
            break
    return ttft


def common_prefix(a: list[int], b: list[int]) -> int:
    size = 0
    while size < min(len(a), len(b)) and a[size] == b[size]:
        size += 1
    return size


def ideal_step(target, cache, ids: list[int], reply: list[int]) -> tuple[float, int]:
    """The time of one forward over what ``ids`` adds to their common prefix with what ``cache`` holds
    (at least its last token), on ``cache`` holding that prefix; then ``reply`` is fed too (untimed), so
    the handle holds the turn's prompt and reply for the next -> (seconds, new tokens)."""
    keep = min(common_prefix(cache.tokens, ids), len(ids) - 1)
    cache.crop(keep)
    start = time.perf_counter()
    target.forward(cache, ids[keep:], keep=1)
    seconds = time.perf_counter() - start
    if reply:
        target.forward(cache, reply, keep=1)
    return seconds, len(ids) - keep


def run_conversation(arms: dict, turns: list[str], max_new: int, times: dict, reused: dict, lengths: dict,
                     new: dict, llm=None, typing: bool = False) -> None:
    """Every turn on both arms (alternating which goes first), then on llama.cpp's own API when
    ``llm``, then the ideal prefill; records each arm's TTFT per turn (and the cached arm's settle).
    ``typing``: the cached arm first prepares each message as typed (``Pipeline.prepare``) and waits."""
    messages: list[dict] = []
    target = arms["fresh"].target
    ideal = target.new_cache()
    for index, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        order = list(arms) if index % 2 == 0 else list(reversed(arms))
        replies = {}
        for name in order:
            if typing and name == "cached":  # the message typed but for its last word, in the typist's pauses
                start = time.perf_counter()
                arms[name].prepare(list(messages), chat=True)
                arms[name].prefix_cache.wait_settled()
                times.setdefault("cached typing", {}).setdefault(index, []).append(time.perf_counter() - start)
            gen = arms[name].generate(list(messages), chat=True, max_new_tokens=max_new)
            replies[name] = gen
            times[name].setdefault(index, []).append(gen.stats.ttft)
            cache = arms[name].prefix_cache
            before = cache.stats.settle_seconds
            cache.wait_settled()  # the user's think time: nothing else runs while it settles
            times.setdefault(f"{name} settle", {}).setdefault(index, []).append(cache.stats.settle_seconds - before)
        cached, fresh = replies["cached"], replies["fresh"]
        if cached.token_ids != fresh.token_ids:
            sys.exit(f"turn {index + 1}: the cached arm's reply differs from the fresh arm's")
        if llm is not None:
            times["llama.cpp"].setdefault(index, []).append(llama_ttft(llm, cached.prompt_ids, max_new))
        seconds, new[index] = ideal_step(target, ideal, cached.prompt_ids, cached.token_ids)
        times["ideal"].setdefault(index, []).append(seconds)
        reused.setdefault(index, []).append(cached.stats.prefill_reused)
        lengths[index] = cached.stats.prompt_tokens
        messages.append({"role": "assistant", "content": fresh.text})
    ideal.release()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--llama-cpp", action="store_true", help="also time llama-cpp-python's own API (GGUF targets)")
    parser.add_argument("--typing", action="store_true",
                        help="the cached arm prepares each message but its last word first, as specgen-chat does while it is typed")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    overrides = ["threads=1", *args.overrides]
    arms = {"cached": specgen.pipeline(*overrides, progress=False),
            "fresh": specgen.pipeline(*overrides, "prefix_cache.entries=0", progress=False)}
    llm = None
    if args.llama_cpp:
        from specgen.bench.llama_baselines import llama_for, llama_unavailable

        if (reason := llama_unavailable(arms["fresh"])) is not None:
            sys.exit(f"--llama-cpp: {reason}")
        llm = llama_for(arms["fresh"])
    turns = user_turns(args.turns)
    times: dict = {name: {} for name in [*arms, "llama.cpp", "ideal"]}
    reused: dict = {}
    lengths: dict = {}
    new: dict = {}
    for _ in range(args.repeats):
        arms["cached"].prefix_cache.clear()
        if llm is not None:
            llm.reset()
        run_conversation(arms, turns, args.max_new_tokens, times, reused, lengths, new, llm, args.typing)
    target = arms["fresh"].target
    print(f"# {target.name} on {target.backend}, {' '.join(overrides)}, guarantee {arms['cached'].guarantee.label()}; "
          f"{args.repeats} repeats, medians; both arms gave the same tokens on every turn")
    print("turn  prompt  cached  new  ttft_cached_ms  ttft_fresh_ms  ideal_ms  fresh/cached  cached/ideal  settle_ms"
          + ("  typed_ms" if args.typing else "")
          + ("  ttft_llama_ms  llama/cached  paired (least)" if llm is not None else ""))
    for index in range(args.turns):
        on, off, settle, seconds = (statistics.median(times[name][index])
                                    for name in ("cached", "fresh", "cached settle", "ideal"))
        row = (f"{index + 1:>4}  {lengths[index]:>6}  {statistics.median(reused[index]):>6.0f}  {new[index]:>3}  "
               f"{1e3 * on:>14.1f}  {1e3 * off:>13.1f}  {1e3 * seconds:>8.1f}  {off / on:>12.2f}  {on / seconds:>12.2f}"
               f"  {1e3 * settle:>9.1f}")
        if args.typing:
            row += f"  {1e3 * statistics.median(times['cached typing'][index]):>8.1f}"
        if llm is not None:
            theirs = statistics.median(times["llama.cpp"][index])
            paired = [a / b for a, b in zip(times["llama.cpp"][index], times["cached"][index])]
            row += f"  {1e3 * theirs:>13.1f}  {theirs / on:>12.2f}  {statistics.median(paired):>6.2f} ({min(paired):.2f})"
        print(row)


if __name__ == "__main__":
    main()
