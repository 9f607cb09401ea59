"""The benchmark loop: build, warm up, then run every method prompt by prompt.

For each temperature one pipeline is built (the processor stack depends on
it); every *arm* -- a method and, where it has one, a gamma -- then runs on
prompt 0, prompt 1, ... in turn, so all arms see the same machine state and
paired ratios cancel drift. The arm order changes each prompt as a Williams design
(:func:`balanced_order`): every arm runs at every place and right after every other
arm equally often over a cycle of orders, so what one method leaves behind in the
machine (a CPU runs the next forwards slower after other work) weighs on every method
alike. Warm-up runs are not recorded. After the first warm-up the
model costs of the speed model are measured once (calibrate.py). Timings use a
clock that synchronises CUDA before each reading.

Arms: ``specgen`` (speculative, one per gamma), ``plain`` (specgen with
speculation off), ``hf_generate``, ``hf_assisted`` (one per gamma; needs a
draft model) and ``hf_prompt_lookup`` (one per gamma).
"""

from __future__ import annotations

import copy
import gc
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf

from specgen.bench.baselines import HF_METHODS, generate_kwargs, hf_unavailable, run_hf
from specgen.bench.llama_baselines import LLAMA_METHODS, llama_unavailable, run_llama_arm
from specgen.bench.batching import batch_methods, run_hf_batches, run_specgen
from specgen.bench.calibrate import from_cost_table
from specgen.bench.prompts import BenchPrompt, load_prompt_sets
from specgen.bench.settings import Settings
from specgen.drafters import HFAssistant
from specgen.errors import ConfigError
from specgen.models.target import hf_model_of
from specgen.planning.observed import describe_observed
from specgen.planning.cost_cache import describe
from specgen.planning import AUTO
from specgen.config.options import RequestOptions, parse_bool, parse_int, parse_seed
from specgen.events import FinishEvent
from specgen.stats import Clock, Stats

WARMUP_TOKENS = 16


@dataclass(frozen=True)
class Arm:
    method: str
    gamma: int | None = None


@dataclass
class BenchRun:
    """samples: one dict per timed generation (see summary.py); notes: what was skipped and why.

    interrupted: Ctrl-C stopped the matrix; ``samples`` then holds the prompts measured before it.
    """

    interrupted: bool = False
    samples: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hf_spec_method: str | None = None
    environment: dict = field(default_factory=dict)
    calibration: dict | None = None
    batch_samples: list[dict] = field(default_factory=list)


def plan_arms(pipe, settings: Settings) -> tuple[list[Arm], list[str]]:
    """The arms this pipeline can run, and a note for each requested one it cannot."""
    arms, notes = [], []
    if pipe.speculative:
        arms += [Arm("specgen", g) for g in settings.gammas]
    else:
        notes.append(f"specgen speculative rows skipped: {pipe.guarantee}")
    hf_reason = hf_unavailable(pipe)
    llama_reason = llama_unavailable(pipe) if set(LLAMA_METHODS) & set(settings.baselines) else None
    for name in settings.baselines:
        if name == "plain":
            arms.append(Arm("plain"))
        elif name in LLAMA_METHODS and llama_reason:
            notes.append(f"{name} skipped: {llama_reason}")
        elif name == "llama_cpp":
            arms.append(Arm(name))
        elif name == "llama_cpp_lookup":
            arms += [Arm(name, g) for g in settings.gammas if g != AUTO]
        elif hf_reason:
            notes.append(f"{name} skipped: {hf_reason}")
        elif name == "hf_generate":
            arms.append(Arm("hf_generate"))
        elif name == "hf_assisted" and _assistant(pipe, "hf_assisted") is None:
            notes.append("hf_assisted skipped: the drafter has no draft model (use drafter=small_model or similar)")
        elif name in ("hf_assisted", "hf_prompt_lookup"):
            arms += [Arm(name, g) for g in settings.gammas if g != AUTO]
    return arms, notes


def _assistant(pipe, method: str | None = None) -> HFAssistant | None:
    """The drafter's HF counterpart (of ``method``, when given), or None."""
    view = pipe.drafter.hf_assistant if pipe.drafter is not None else None
    return view if view is not None and method in (None, view.method) else None


def hf_spec_method(pipe) -> str | None:
    """HF's counterpart of the pipeline's drafter: assisted generation or prompt lookup."""
    view = _assistant(pipe)
    return None if view is None else view.method


def build_variant(cfg: DictConfig, temperature: float, settings: Settings, progress: bool):
    """The pipeline for one temperature (EOS masked until max_new_tokens when ignore_eos), with its
    prefix cache off: arms run the same prompts in turn, and a cached prompt would give every arm
    after the first a prefill the baselines pay in full."""
    from specgen.engine.assemble import build_pipeline

    variant = copy.deepcopy(cfg)
    OmegaConf.update(variant, "sampling.temperature", float(temperature))
    OmegaConf.update(variant, "prefix_cache.entries", 0, force_add=True)
    if settings.ignore_eos:
        OmegaConf.update(variant, "sampling.min_new_tokens", settings.max_new_tokens)
    return build_pipeline(variant, progress=progress)


def encode_prompts(pipe, prompts: Sequence[BenchPrompt], settings: Settings, notes: list[str]) -> list[tuple]:
    """(prompt, ids) pairs that fit bench.max_prompt_tokens and the model's context."""
    kept, skipped = [], 0
    for prompt in prompts:
        ids = pipe.encode(prompt.prompt)
        fits = len(ids) + settings.max_new_tokens <= pipe.target.context_length
        if len(ids) <= settings.max_prompt_tokens and fits:
            kept.append((prompt, ids))
        else:
            skipped += 1
    if skipped:
        notes.append(f"{skipped} prompt(s) skipped: longer than bench.max_prompt_tokens={settings.max_prompt_tokens} "
                     "or the model's context")
    if not kept:
        raise ConfigError("no prompt fits bench.max_prompt_tokens and the model's context")
    return kept


def run_arm(pipe, arm: Arm, ids: list[int], *, max_new: int, seed: int, hf_kwargs: Mapping,
            clock: Callable[[], float], hf_kernels: str = "stock") -> dict:
    """One timed generation; returns the sample (with ``token_ids``, dropped before storing).

    hf_kwargs: ``generate()`` arguments for the HF methods, for the same ``max_new``;
    hf_kernels: the kernels they run on (``bench.hf_kernels``).
    specgen samples also carry ``first_round``: the engine's live counters when the
    first token arrived (the round that prefilled the prompt), so summaries can
    report the decode phase on its own, and ``mask_us``: under a grammar, the mask
    time of every masked position in microseconds (empty without one).
    """
    if arm.method in LLAMA_METHODS:
        return run_llama_arm(pipe, arm.method, ids, arm.gamma, max_new=max_new, seed=seed, clock=clock)
    if arm.method in HF_METHODS:
        assisted, lookup = _assistant(pipe, "hf_assisted"), _assistant(pipe, "hf_prompt_lookup")
        result = run_hf(arm.method, hf_model_of(pipe.target), ids, hf_kwargs, clock=clock, seed=seed, gamma=arm.gamma,
                        assistant=assisted and assisted.model, max_ngram=lookup.max_ngram if lookup else 3,
                        kernels=hf_kernels)
        memory = pipe.drafter.extra_memory_bytes if arm.method == "hf_assisted" else 0  # the same draft weights
        return dict(result, drafter_memory_bytes=memory)
    speculative = arm.method == "specgen"
    stats, first, gen = Stats(), None, None
    start = clock()
    options = RequestOptions(max_new_tokens=max_new, seed=seed, speculative=speculative, stats=stats,
                             num_tokens=arm.gamma if speculative else None)
    for event in pipe.stream(prompt_ids=ids, options=options):
        if first is None:
            first = {"seconds": clock() - start, "rounds": stats.rounds, "new_tokens": stats.new_tokens,
                     "drafted": stats.drafted, "timings": asdict(stats.timings)}
        if isinstance(event, FinishEvent):
            gen = event.generation
    end = clock()
    return {
        "token_ids": list(gen.token_ids), "wall": end - start, "ttft": first["seconds"], "first_round": first,
        "rounds": stats.rounds, "target_calls": stats.target_calls, "drafted": stats.drafted,
        "accepted": stats.accepted, "proposed_per_position": list(stats.proposed_per_position),
        "accepted_per_position": list(stats.accepted_per_position), "timings": asdict(stats.timings),
        "draft_size_counts": list(stats.draft_size_counts), "tree": pipe.drafter is not None and pipe.drafter.tree_width > 1,
        "drafter_memory_bytes": stats.drafter_memory_bytes, "guarantee": str(gen.guarantee),
        "finish_reason": gen.finish_reason, "mask_us": [round(1e6 * s, 2) for s in stats.mask_seconds],
    }


def run_matrix(cfg: DictConfig, settings: Settings, *, progress: bool = True) -> BenchRun:
    """Run the whole matrix described by ``cfg`` (specgen config + bench settings).

    Ctrl-C ends the run early with ``interrupted`` set; every prompt measured by
    all arms before it is kept.
    """
    from tqdm.auto import tqdm

    from specgen.bench.report import environment

    run = BenchRun()
    prompts = load_prompt_sets(settings.prompts, settings.num_prompts, run.notes.append)
    settings.check_seeds(len(prompts))
    bar = tqdm(total=0, desc="specgen-bench", unit="gen", disable=not progress, leave=False)
    encoded = None
    try:
        for temperature in settings.temperatures:
            pipe = build_variant(cfg, temperature, settings, progress)
            if encoded is None:
                encoded = encode_prompts(pipe, prompts, settings, run.notes)
                arms, notes = plan_arms(pipe, settings)
                run.notes += notes
                batched = batch_methods(pipe, settings.baselines)[0] if settings.batch_sizes else []
                hf_runs = ("hf_generate" in batched if settings.batch_sizes
                           else any(arm.method in HF_METHODS for arm in arms))
                if hf_runs:
                    run.notes.append(f"HF methods ran on {settings.hf_kernels} kernels (bench.hf_kernels)")
                run.hf_spec_method = hf_spec_method(pipe) if pipe.speculative else None
                run.environment = environment(pipe)
                bar.total = len(settings.temperatures) * (
                    len(settings.batch_sizes) * len(batched) * (settings.batch_repeats + settings.warmup)
                    if settings.batch_sizes else len(arms) * (settings.warmup + settings.repeats * len(encoded)))
                bar.refresh()
            clock = Clock(pipe.device)
            if settings.batch_sizes:  # the batch dimension replaces the per-prompt arms
                _measure_batches(pipe, encoded, temperature, settings, clock, run, bar)
                del pipe
                gc.collect()
                continue
            if pipe.speculative:  # the planner's and the speed model's costs: measured once, before warm-up
                bar.set_postfix_str("cost table")
                costs = pipe.cost_table(refresh=settings.remeasure_costs and run.calibration is None)
                if run.calibration is None and settings.calibration_repeats > 0:
                    run.calibration = from_cost_table(costs)
                    run.notes.append(describe(costs).replace("\n", ";"))
            _warm_up(pipe, arms, encoded[0][1], temperature, settings, clock, bar)
            _measure(pipe, arms, encoded, temperature, settings, clock, run.samples, bar)
            if pipe.observed is not None:
                run.notes.append(f"T={temperature:g}: {describe_observed(pipe.observed)}")
            del pipe
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        run.interrupted = True
    finally:
        bar.close()
    return run


def _hf_kwargs(pipe, temperature: float, settings: Settings, max_new: int) -> dict:
    return generate_kwargs(pipe.config.sampling, temperature=temperature, max_new_tokens=max_new,
                           ignore_eos=settings.ignore_eos, eos_ids=pipe.tokenizer.eos_ids)


def _warm_up(pipe, arms: list[Arm], ids: list[int], temperature: float, settings: Settings, clock, bar) -> None:
    max_new = min(WARMUP_TOKENS, settings.max_new_tokens)
    hf_kwargs = _hf_kwargs(pipe, temperature, settings, max_new)
    for _ in range(settings.warmup):
        for arm in arms:
            bar.set_postfix_str(f"T={temperature:g} warm-up {arm.method}")
            run_arm(pipe, arm, ids, max_new=max_new, seed=settings.seed, hf_kwargs=hf_kwargs, clock=clock,
                    hf_kernels=settings.hf_kernels)
            bar.update()


def balanced_order(n: int, index: int) -> list[int]:
    """The ``index``-th order of ``n`` arms in a Williams design: over ``n`` consecutive indices
    (``2n`` for odd ``n``) each arm takes each place equally often and each ordered pair of
    arms is adjacent equally often (once; twice for odd ``n``), which a cyclic rotation
    (where one arm always follows the same other) is not."""
    if n < 1:
        raise ValueError("balanced_order needs at least one arm")
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    rows = n if n % 2 == 0 else 2 * n
    row = index % rows
    order = [(arm + row) % n for arm in first]
    return order[::-1] if row >= n else order


def _measure(pipe, arms: list[Arm], encoded: list[tuple], temperature: float, settings: Settings, clock,
             samples: list[dict], bar) -> None:
    """Every arm on every prompt, ``bench.repeats`` passes over the prompt list; the arm orders
    continue one :func:`balanced_order` sequence across prompts and passes."""
    measured = _hf_kwargs(pipe, temperature, settings, settings.max_new_tokens)
    for repeat, (index, (prompt, ids)) in itertools.product(range(settings.repeats), enumerate(encoded)):
        results = {}
        for arm in [arms[i] for i in balanced_order(len(arms), repeat * len(encoded) + index)]:
            bar.set_postfix_str(f"T={temperature:g} {prompt.task} #{index} {arm.method}"
                                + (f" gamma={arm.gamma}" if arm.gamma else ""))
            results[arm] = run_arm(pipe, arm, ids, max_new=settings.max_new_tokens, seed=settings.seed + index,
                                   hf_kwargs=measured, clock=clock, hf_kernels=settings.hf_kernels)
            bar.update()
        plain_ids = results[Arm("plain")]["token_ids"] if Arm("plain") in results and temperature == 0 else None
        for arm, result in results.items():
            samples.append(dict(_sample(arm, result, prompt, index, ids, temperature, plain_ids), repeat=repeat))


def _measure_batches(pipe, encoded: list[tuple], temperature: float, settings: Settings, clock, run: BenchRun,
                     bar) -> None:
    """The batch section for one temperature: every batch size × method over the whole prompt
    list, ``bench.batch_repeats`` times with the methods in a :func:`balanced_order` (after ``bench.warmup``
    untimed passes at the smallest size)."""
    methods, notes = batch_methods(pipe, settings.baselines)
    run.notes += [note for note in notes if note not in run.notes]  # plan_arms may have said it already
    prompts = [ids for _, ids in encoded]
    hf_kwargs = _hf_kwargs(pipe, temperature, settings, settings.max_new_tokens)
    pad_id = (pipe.tokenizer.eos_ids or [0])[0]

    def once(method: str, size: int) -> dict:
        bar.set_postfix_str(f"T={temperature:g} batch {size} {method}")
        if method == "hf_generate":
            return run_hf_batches(hf_model_of(pipe.target), prompts, size, hf_kwargs, pad_id=pad_id, seed=settings.seed,
                                  clock=clock, kernels=settings.hf_kernels)
        return run_specgen(pipe, prompts, size, speculative=method == "specgen", max_new=settings.max_new_tokens,
                           seed=settings.seed, clock=clock)

    if "specgen" in methods:  # the planner's tables: measured (or read from the cache) before any timing
        from specgen.batch.drafting import batch_costs
        from specgen.planning.measure import table_size
        from specgen.planning.cost_cache import describe_batch

        pipe.cost_table(refresh=settings.remeasure_costs)
        refreshed: set[int] = set()
        for size in settings.batch_sizes:
            key = table_size(size)  # one table serves every batch size: measure it again once
            note = describe_batch(batch_costs(pipe, size, refresh=settings.remeasure_costs and key not in refreshed))
            refreshed.add(key)
            if temperature == settings.temperatures[0] and note not in run.notes:
                run.notes.append(note)
    for _ in range(settings.warmup):
        for method in methods:
            once(method, settings.batch_sizes[0])
            bar.update(len(settings.batch_sizes))
    for repeat in range(settings.batch_repeats):
        single = None
        for size in settings.batch_sizes:
            results = {}
            for method in [methods[i] for i in balanced_order(len(methods), repeat + size)]:
                results[method] = once(method, size)
                bar.update()
            if size == 1 and temperature == 0:
                single = results.get("plain", results.get("specgen", {})).get("outputs")
            for method, result in results.items():
                tokens = sum(len(o) for o in result["outputs"])
                matches = None if single is None or temperature != 0 else result["outputs"] == single
                run.batch_samples.append({"temperature": temperature, "method": method, "batch_size": size,
                                          "repeat": repeat, "tokens": tokens, "wall": result["wall"],
                                          "tok_s": tokens / result["wall"], "latency": result["latency"],
                                          "matches_single": matches})


def _sample(arm: Arm, result: dict, prompt: BenchPrompt, index: int, ids: list[int], temperature: float,
            plain_ids: list[int] | None) -> dict:
    token_ids = result.pop("token_ids")
    new_tokens = len(token_ids)
    ttft = result.get("ttft")
    tpot = (result["wall"] - ttft) / (new_tokens - 1) if ttft is not None and new_tokens > 1 else None
    matches = None if plain_ids is None or arm.method == "plain" else token_ids == plain_ids
    return dict(result, task=prompt.task, prompt_index=index, prompt_id=prompt.source_id, temperature=temperature,
                gamma=arm.gamma, method=arm.method, prompt_tokens=len(ids), new_tokens=new_tokens, tpot=tpot,
                matches_plain=matches)
