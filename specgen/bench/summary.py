"""Pure functions from per-prompt samples to per-cell rows.

A *sample* is one timed generation: a dict with at least ``task``,
``temperature``, ``gamma`` (None for methods without one), ``method``,
``prompt_index``, ``new_tokens`` and ``wall`` (seconds). specgen samples also
carry the engine's counters (``rounds``, ``target_calls``, ``drafted``,
``accepted``, ``proposed_per_position``, ``accepted_per_position``,
``timings``, ...).

A *cell* is one (task, temperature, gamma, method). Its row holds medians and
spread over prompts, and speedups as **paired** ratios: for each prompt, this
method's tokens/s divided by the reference method's tokens/s on the same
prompt (run next to it, so machine drift cancels), then the median over prompts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from specgen.bench.calibrate import verify_ratio
from specgen.stats import percentile

#: Methods that are references for every cell of a (task, temperature).
PLAIN, HF_GENERATE, LLAMA_CPP = "plain", "hf_generate", "llama_cpp"
#: Row order within a (task, temperature).
METHOD_ORDER = ("specgen", PLAIN, LLAMA_CPP, "llama_cpp_lookup", HF_GENERATE, "hf_assisted", "hf_prompt_lookup")
#: Stages of the time split; "grammar" (mask work, out of draft and process) is 0 without a grammar.
STAGES = ("draft", "verify", "process", "grammar", "commit")


def spread(values: Iterable[float | None]) -> dict | None:
    """median, quartiles, min, max and count of the non-None values (None when there are none)."""
    data = np.array([v for v in values if v is not None], dtype=float)
    if data.size == 0:
        return None
    p25, median, p75 = np.percentile(data, [25, 50, 75])
    return {"median": float(median), "p25": float(p25), "p75": float(p75),
            "min": float(data.min()), "max": float(data.max()), "n": int(data.size)}


def tokens_per_s(sample: Mapping) -> float | None:
    return sample["new_tokens"] / sample["wall"] if sample["wall"] > 0 and sample["new_tokens"] else None


def cell_key(sample: Mapping) -> tuple:
    return sample["task"], sample["temperature"], sample["gamma"], sample["method"]


def paired_ratios(samples: Sequence[Mapping], reference: Sequence[Mapping], speed=tokens_per_s) -> list[float]:
    """speed(sample) over speed(the reference sample of the same prompt_index and repeat), for each sample."""
    by_prompt = {(s["prompt_index"], s.get("repeat", 0)): speed(s) for s in reference}
    ratios = []
    for sample in samples:
        ref, mine = by_prompt.get((sample["prompt_index"], sample.get("repeat", 0))), speed(sample)
        if ref and mine is not None:
            ratios.append(mine / ref)
    return ratios


def decode_speed(sample: Mapping) -> float | None:
    """Tokens/s after the first token (1 / TPOT): the decode phase without the prompt's prefill."""
    return 1.0 / sample["tpot"] if sample.get("tpot") else None


def _decode_part(sample: Mapping) -> dict:
    """The sample's counters after its first round (which prefilled the prompt); all of them without one."""
    first = sample.get("first_round") or {}
    timings = first.get("timings") or {}
    return {
        "rounds": sample["rounds"] - first.get("rounds", 0),
        "new_tokens": sample["new_tokens"] - first.get("new_tokens", 0),
        "drafted": sample["drafted"] - first.get("drafted", 0),
        "wall": sample["wall"] - first.get("seconds", 0.0),
        "timings": {stage: sample["timings"].get(stage, 0.0) - timings.get(stage, 0.0) for stage in STAGES},
    }


def engine_counters(samples: Sequence[Mapping]) -> dict | None:
    """Engine counters summed over prompts, and what follows from them (None without counters).

    tau, acceptance and calls per token cover whole requests; per-round times,
    seconds per token and the speed-model inputs cover the decode phase only
    (after each request's first round, see ``first_round`` in runner.run_arm).
    """
    with_stats = [s for s in samples if s.get("rounds")]
    if not with_stats:
        return None
    total = {key: sum(s[key] for s in with_stats) for key in ("target_calls", "drafted", "accepted", "new_tokens")}
    width = max(len(s.get("proposed_per_position") or []) for s in with_stats)
    proposed, accepted = [0] * width, [0] * width
    for s in with_stats:
        for i, (p, a) in enumerate(zip(s.get("proposed_per_position") or [], s.get("accepted_per_position") or [])):
            proposed[i] += p
            accepted[i] += a
    rounds_total = sum(s["rounds"] for s in with_stats)
    at_least = [rounds_total, *proposed, 0]  # rounds with >= k draft positions, k = 0, 1, ...
    size_counts = _summed([s.get("draft_size_counts") for s in with_stats])
    parts = [_decode_part(s) for s in with_stats]
    decode = {key: sum(part[key] for part in parts) for key in ("rounds", "new_tokens", "drafted", "wall")}
    stage_time = {stage: sum(part["timings"][stage] for part in parts) for stage in STAGES}
    rounds = max(decode["rounds"], 1)
    per_round_ms = {stage: 1e3 * t / rounds for stage, t in stage_time.items()}
    per_round_ms["other"] = 1e3 * (decode["wall"] - sum(stage_time.values())) / rounds
    return {
        "rounds": rounds_total,
        "draft_length_counts": size_counts or [at_least[k] - at_least[k + 1] for k in range(width + 1)],
        "tree": any(s.get("tree") for s in with_stats),
        "tau": total["new_tokens"] / total["target_calls"],
        "target_calls_per_token": total["target_calls"] / total["new_tokens"],
        "acceptance_rate": total["accepted"] / total["drafted"] if total["drafted"] else None,
        "acceptance_per_position": [a / p if p else None for a, p in zip(accepted, proposed)],
        "decode_tokens_per_round": decode["new_tokens"] / rounds,
        "mean_draft_length": decode["drafted"] / rounds,
        "per_round_ms": per_round_ms,
        "seconds_per_token": decode["wall"] / max(decode["new_tokens"], 1),
        "draft_seconds_per_draft_token": stage_time["draft"] / decode["drafted"] if decode["drafted"] else None,
        "verify_seconds_per_round": stage_time["verify"] / rounds,
    }


def grammar_counters(samples: Sequence[Mapping]) -> dict | None:
    """Grammar cost of a cell's constrained runs (None when no sample has a grammar).

    share: grammar seconds over wall seconds, summed over whole requests (prefill
    round included); mask_p50_us / mask_p99_us: nearest-rank percentiles of the mask
    time per position, pooled over the cell's samples (target and drafter sides);
    positions: how many positions were masked.
    """
    constrained = [s for s in samples if s.get("mask_us") or (s.get("timings") or {}).get("grammar")]
    if not constrained:
        return None
    seconds = sum(s["timings"].get("grammar", 0.0) for s in constrained)
    wall = sum(s["wall"] for s in constrained)
    pooled = [us for s in constrained for us in s.get("mask_us") or ()]
    return {"share": seconds / wall if wall > 0 else None, "seconds": seconds,
            "mask_p50_us": percentile(pooled, 0.5), "mask_p99_us": percentile(pooled, 0.99),
            "positions": len(pooled)}


def _summed(lists: Sequence[list | None]) -> list[int] | None:
    """Element-wise sum of histograms; None when any is missing (samples from before they were recorded)."""
    if not lists or any(not values for values in lists):
        return None
    out = [0] * max(len(values) for values in lists)
    for values in lists:
        for i, count in enumerate(values):
            out[i] += count
    return out


def speed_model(spec: Mapping, plain: Mapping, calibration: Mapping | None = None) -> dict:
    """Predicted speedup = E[K] * (1 + o_plain) / (v + gamma*c + o), in units of one target forward of 1 token.

    All terms describe the decode phase (after the round that prefilled the prompt).
    E[K]: tokens committed per round; gamma: mean draft tokens per round; v: a
    verify forward of k + 1 tokens, averaged over the rounds' verified draft
    tokens k -- a tree's node count |T|, not its depth, priced from the tree
    table (verify cost is not linear in k); c: one draft token; o / o_plain: the rest
    of a speculative round / of a plain step (process, grammar, commit, loop). With
    ``calibration`` (see calibrate.py) v, c and the unit come from separate forward
    measurements; without it, from the request timings, and then ``predicted``
    equals ``measured`` by construction (the terms only split it). ``measured``:
    plain over speculative decode seconds per token.
    """
    gamma = spec["mean_draft_length"]
    draft_c = spec["draft_seconds_per_draft_token"] or 0.0
    if calibration:
        unit = calibration["step_s"]
        counts = spec.get("draft_length_counts") or [0, 1]
        table = calibration["v_tree"] if spec.get("tree") and calibration.get("v_tree") else calibration["v"]
        v = sum(n * verify_ratio(table, k + 1) for k, n in enumerate(counts)) / max(sum(counts), 1)
        c = calibration["c"] if calibration.get("c") is not None else draft_c / unit
    else:
        unit = plain["verify_seconds_per_round"]
        v = spec["verify_seconds_per_round"] / unit
        c = draft_c / unit
    o = _rest_ms(spec) / 1e3 / unit
    o_plain = _rest_ms(plain) / 1e3 / unit
    e_k = spec["decode_tokens_per_round"]
    predicted = e_k * (1 + o_plain) / (v + gamma * c + o)
    return {"E_K": e_k, "v": v, "c": c, "gamma": gamma, "o": o, "o_plain": o_plain,
            "predicted": predicted, "measured": plain["seconds_per_token"] / spec["seconds_per_token"],
            "calibrated": bool(calibration)}


def _rest_ms(counters: Mapping) -> float:
    per_round = counters["per_round_ms"]
    return per_round["process"] + per_round.get("grammar", 0.0) + per_round["commit"] + per_round["other"]


def summarise(samples: Sequence[Mapping], hf_spec_method: str | None = None,
              calibration: Mapping | None = None) -> list[dict]:
    """One row per cell: tasks and temperatures in the order they first appear,
    then methods in METHOD_ORDER, then gamma.

    hf_spec_method: HF's counterpart of the drafter ("hf_assisted" or
    "hf_prompt_lookup"); speculative specgen rows get ``speedup_vs_hf_spec``
    against it at the same gamma. calibration: measured model costs for the speed model.
    """
    cells: dict[tuple, list] = defaultdict(list)
    for sample in samples:
        cells[cell_key(sample)].append(sample)
    rows = []
    for (task, temperature, gamma, method), group in cells.items():
        plain = cells.get((task, temperature, None, PLAIN), [])
        hf = cells.get((task, temperature, None, HF_GENERATE), [])
        llama = cells.get((task, temperature, None, LLAMA_CPP), [])
        row = {
            "task": task, "temperature": temperature, "gamma": gamma, "method": method,
            "num_prompts": len(group),
            "tokens_per_s": spread(tokens_per_s(s) for s in group),
            "speedup_vs_plain": spread(paired_ratios(group, plain)) if method != PLAIN else None,
            "speedup_vs_hf_generate": spread(paired_ratios(group, hf)) if method != HF_GENERATE else None,
            "speedup_vs_hf_spec": None,
            "speedup_vs_llama_cpp": spread(paired_ratios(group, llama)) if method != LLAMA_CPP else None,
            "decode_speedup_vs_plain": spread(paired_ratios(group, plain, decode_speed)) if method != PLAIN else None,
            "new_tokens": sum(s["new_tokens"] for s in group),
            "prompt_tokens": spread(s.get("prompt_tokens") for s in group),
            "wall_s": spread(s["wall"] for s in group),
            "ttft_ms": spread(1e3 * s["ttft"] if s.get("ttft") is not None else None for s in group),
            "tpot_ms": spread(1e3 * s["tpot"] if s.get("tpot") is not None else None for s in group),
            "matches_plain": _match_share(group),
            "guarantee": group[0].get("guarantee"),
            "drafter_memory_bytes": max((s.get("drafter_memory_bytes") or 0) for s in group),
            "engine": engine_counters(group),
            "grammar": grammar_counters(group),
            "speed_model": None,
        }
        if method == "specgen" and hf_spec_method:
            counterpart = cells.get((task, temperature, gamma, hf_spec_method), [])
            row["speedup_vs_hf_spec"] = spread(paired_ratios(group, counterpart))
        plain_counters = engine_counters(plain)
        if method == "specgen" and row["engine"] and plain_counters:
            row["speed_model"] = speed_model(row["engine"], plain_counters, calibration)
        rows.append(row)
    tasks = list(dict.fromkeys(s["task"] for s in samples))
    temperatures = list(dict.fromkeys(s["temperature"] for s in samples))

    def order(row):
        method = METHOD_ORDER.index(row["method"]) if row["method"] in METHOD_ORDER else len(METHOD_ORDER)
        gamma = row["gamma"]
        return (tasks.index(row["task"]), temperatures.index(row["temperature"]), method,
                (1, 0) if isinstance(gamma, str) else (0, gamma or 0))

    return sorted(rows, key=order)


def _match_share(group: Sequence[Mapping]) -> float | None:
    flags = [s["matches_plain"] for s in group if s.get("matches_plain") is not None]
    return sum(flags) / len(flags) if flags else None
