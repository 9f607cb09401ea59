"""Direct measurements of the speed model's cost terms, free of prefill.

A request's stage timings include the first round, which also prefills the
prompt into the target (and a draft model), so averages over a short
generation overstate the per-round cost of verification and drafting. Here the
costs are measured on their own, after a prefill that is not timed:

``step_s``   one target forward of 1 token at the prompt's context length;
``v[n]``     a target forward of n tokens (n = gamma + 1 candidates) over ``step_s``;
``c``        one draft-model forward of 1 token over ``step_s`` (None without a draft model).

The sizes are measured interleaved (1, 2, ..., gamma+1 tokens, a draft token,
then again), so load from other processes hits them alike, and each figure is
the *minimum* over ``repeats`` rounds (noise only adds time), after one untimed
round. The KV cache is cropped back after every forward so each one sees the
same context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _prefilled(lm, prefix: Sequence[int]):
    cache = lm.new_cache()
    lm.forward(cache, list(prefix), keep=1)
    return cache


def _timed_forward(lm, cache, prefix: Sequence[int], num_new: int, clock: Callable[[], float]) -> float:
    base = len(cache)
    feed = [prefix[i % len(prefix)] for i in range(num_new)]
    start = clock()
    lm.forward(cache, feed, keep=num_new)
    elapsed = clock() - start
    cache.crop(base)
    return elapsed


def calibrate(pipe, prompt_ids: Sequence[int], max_gamma: int, clock: Callable[[], float], repeats: int = 3) -> dict:
    """``{step_s, v: {n: ratio} for n in 1..max_gamma+1, c, context_tokens}`` for this pipeline's models."""
    draft_lm = getattr(pipe.drafter, "lm", None)
    target_cache = _prefilled(pipe.target, prompt_ids)
    draft_cache = _prefilled(draft_lm, prompt_ids) if draft_lm is not None else None
    sizes = range(1, max_gamma + 2)
    target_times: dict[int, list[float]] = {n: [] for n in sizes}
    draft_times: list[float] = []
    for _ in range(repeats + 1):
        for num_new in sizes:
            target_times[num_new].append(_timed_forward(pipe.target, target_cache, prompt_ids, num_new, clock))
        if draft_lm is not None:
            draft_times.append(_timed_forward(draft_lm, draft_cache, prompt_ids, 1, clock))
    best = {n: min(times[1:]) for n, times in target_times.items()}
    step = best[1]
    return {"step_s": step, "v": {n: t / step for n, t in best.items()},
            "c": min(draft_times[1:]) / step if draft_times else None, "context_tokens": len(prompt_ids)}


def verify_ratio(v: dict, num_tokens: float) -> float:
    """v at a fractional number of verified tokens, by linear interpolation (clamped to the measured range)."""
    table = {int(n): float(ratio) for n, ratio in v.items()}
    sizes = sorted(table)
    num_tokens = min(max(num_tokens, sizes[0]), sizes[-1])
    low = max(n for n in sizes if n <= num_tokens)
    high = min(n for n in sizes if n >= num_tokens)
    if low == high:
        return table[low]
    weight = (num_tokens - low) / (high - low)
    return table[low] * (1 - weight) + table[high] * weight
