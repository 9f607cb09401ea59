"""The bench's batch dimension (``bench.batch_sizes=[1,4,8]``): many prompts at once.

For each temperature and batch size B the same prompt list runs through three
methods, each repeat and batch size in another order of runner.balanced_order's design (so no
method always runs first, or right after the same other):

``plain``        specgen's ``generate_batch(..., speculative=False)`` (continuous batching);
``specgen``      ``generate_batch`` with the pipeline's drafter and γ (``batchable`` drafters only);
                 at B = 1 both run the prompts one after another on ``pipe.generate`` (the
                 single-request engine), which is what one request at a time means to a user;
``hf_generate``  HF ``generate()`` on the same weights, the prompts in padded batches of B
                 (left padding, attention mask), chunk after chunk, on ``bench.hf_kernels``.

A sample is one method over the whole list: its tokens/s (all new tokens over the
wall time) and every prompt's latency (from the start of the list to that prompt's
last token: the wait for a free row included, as a server's queue would see it).
Greedy batched outputs are compared with the plain B = 1 outputs of the same repeat
(specgen's B = 1 outputs when ``bench.baselines`` leaves plain out).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from specgen.bench.baselines import hf_kernels, hf_unavailable
from specgen.drafters import batch_refusal
from specgen.errors import ConfigError
from specgen.events import FinishEvent
from specgen.config.options import RequestOptions

BATCH_METHODS = ("plain", "specgen", "hf_generate")


def batch_methods(pipe, baselines: Sequence[str]) -> tuple[list[str], list[str]]:
    """The methods this pipeline can batch, and a note for each it cannot: plain and
    hf_generate when ``baselines`` names them, specgen when the pipeline speculates with a
    batchable drafter (:func:`specgen.drafters.batch_refusal`). ConfigError when that leaves nothing to run."""
    methods, notes = ["plain"] if "plain" in baselines else [], []
    why = batch_refusal(pipe.drafter) if pipe.speculative else None
    if pipe.speculative and why is None:
        methods.append("specgen")
    elif pipe.speculative:
        notes.append(f"batched specgen skipped: {why}")
    if "hf_generate" in baselines:
        reason = hf_unavailable(pipe)
        if reason:
            notes.append(f"hf_generate skipped: {reason}")
        else:
            methods.append("hf_generate")
    if not methods:
        raise ConfigError("bench.batch_sizes: no method to batch (this pipeline does not speculate with a chain "
                          "drafter and bench.baselines names neither plain nor hf_generate)")
    return methods, notes


def run_specgen(pipe, prompts: list[list[int]], batch_size: int, *, speculative: bool, max_new: int, seed: int,
                clock: Callable[[], float]) -> dict:
    """All ``prompts`` (token ids) through ``stream_batch``, or at batch size 1 one after
    another through ``pipe.generate`` (the single-request engine: what a user running one
    request at a time gets, e.g. the CLI's ``batch_size=1``); prompt i uses seed + i."""
    from specgen.batch import stream_batch

    options = RequestOptions(max_new_tokens=max_new, speculative=speculative)
    rows = [{"prompt_ids": ids, "seed": seed + i} for i, ids in enumerate(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    latency = [0.0] * len(prompts)
    start = clock()
    if batch_size == 1:
        for i, ids in enumerate(prompts):
            outputs[i] = list(pipe.generate(prompt_ids=ids, options=replace(options, seed=seed + i)).token_ids)
            latency[i] = clock() - start
        return {"outputs": outputs, "wall": clock() - start, "latency": latency}
    for index, event in stream_batch(pipe, rows, batch_size=batch_size, options=options):
        if isinstance(event, FinishEvent):
            outputs[index] = list(event.generation.token_ids)
            latency[index] = clock() - start
    return {"outputs": outputs, "wall": clock() - start, "latency": latency}


def run_hf_batches(model: torch.nn.Module, prompts: list[list[int]], batch_size: int, kwargs: Mapping, *,
                   pad_id: int, seed: int, clock: Callable[[], float], kernels: str = "stock") -> dict:
    """All ``prompts`` through HF ``generate()`` in left-padded chunks of ``batch_size``.

    kernels: see :func:`specgen.bench.baselines.hf_kernels` (switched before the clock starts)."""
    device = next(model.parameters()).device
    outputs: list[list[int]] = []
    latency: list[float] = []
    torch.manual_seed(seed)
    with hf_kernels((model,), kernels):
        start = clock()
        for first in range(0, len(prompts), batch_size):
            chunk = prompts[first: first + batch_size]
            width = max(len(ids) for ids in chunk)
            ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in chunk], device=device)  # [b, width]
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)  # [b, width]
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)  # [b, width + new]
            done = clock() - start
            outputs += [row[width:].tolist() for row in out]
            latency += [done] * len(chunk)
        wall = clock() - start
    return {"outputs": outputs, "wall": wall, "latency": latency}


def summarise_batches(samples: Sequence[Mapping]) -> list[dict]:
    """One row per (temperature, method, batch size): median tok/s over repeats, ×(the same
    method at batch size 1), ×(plain at the same batch size), latency p50/p99 over every
    prompt of every repeat, and whether greedy outputs equalled plain B = 1.

    ``paired``: this method's tok/s over plain's in the same repeat, per repeat (the two ran
    minutes apart at most, so a machine's slow drift cancels; the ratio of medians does not
    pair them), and ``x_plain_paired`` their median."""
    keys = sorted({(s["temperature"], s["method"], s["batch_size"]) for s in samples},
                  key=lambda k: (k[0], BATCH_METHODS.index(k[1]), k[2]))
    rate = {}
    for key in keys:
        rate[key] = statistics.median(s["tok_s"] for s in samples if _key(s) == key)
    rows = []
    for key in keys:
        temperature, method, size = key
        latencies = sorted(x for s in samples if _key(s) == key for x in s["latency"])
        same = [s["matches_single"] for s in samples if _key(s) == key and s["matches_single"] is not None]
        one, plain = rate.get((temperature, method, 1)), rate.get((temperature, "plain", size))
        paired = _paired(samples, key) if method != "plain" else []
        rows.append({"temperature": temperature, "method": method, "batch_size": size, "tok_s": rate[key],
                     "x_batch1": rate[key] / one if one else None, "x_plain": rate[key] / plain if plain else None,
                     "latency_p50": _quantile(latencies, 0.5), "latency_p99": _quantile(latencies, 0.99),
                     "matches_single": all(same) if same else None, "repeats": sum(_key(s) == key for s in samples),
                     "paired": paired, "x_plain_paired": statistics.median(paired) if paired else None})
    return rows


def _paired(samples: Sequence[Mapping], key: tuple) -> list[float]:
    """tok/s of ``key``'s samples over plain's at the same temperature, batch size and repeat,
    in repeat order (repeats without both are left out)."""
    temperature, _, size = key
    plain = {s.get("repeat"): s["tok_s"] for s in samples if _key(s) == (temperature, "plain", size)}
    return [s["tok_s"] / plain[s.get("repeat")] for s in sorted(
        (s for s in samples if _key(s) == key), key=lambda s: s.get("repeat", 0)) if s.get("repeat") in plain]


def batch_markdown(rows: Sequence[Mapping]) -> str:
    lines = ["| T | method | batch | tok/s | ×batch 1 | ×plain (same batch) | ×plain per repeat: median [min–max] "
             "| latency p50 s | p99 s | = single |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "" if r["matches_single"] is None else ("yes" if r["matches_single"] else "no")
        paired = r.get("paired") or []
        spread = f"{r['x_plain_paired']:.2f} [{min(paired):.2f}–{max(paired):.2f}]" if paired else "–"
        lines.append(f"| {r['temperature']:g} | {r['method']} | {r['batch_size']} | {r['tok_s']:.1f} | "
                     f"{_x(r['x_batch1'])} | {_x(r['x_plain'])} | {spread} | {r['latency_p50']:.2f} | "
                     f"{r['latency_p99']:.2f} | {same} |")
    return "\n".join(lines) + "\n"


def _key(sample: Mapping) -> tuple:
    return sample["temperature"], sample["method"], sample["batch_size"]


def _x(value) -> str:
    return "–" if value is None else f"{value:.2f}"


def _quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile of sorted ``values`` (0.0 when empty)."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]
