"""The benchmark loop: build, warm up, then run every method prompt by prompt.

For each temperature one pipeline is built (the processor stack depends on
it); every *arm* -- a method and, where it has one, a gamma -- then runs on
prompt 0, prompt 1, ... in turn, so all arms see the same machine state and
paired ratios cancel drift. The arm order rotates by one each prompt so no arm
always runs first. Warm-up runs are not recorded. After the first warm-up the
model costs of the speed model are measured once (calibrate.py). Timings use a
clock that synchronises CUDA before each reading.

Arms: ``specgen`` (speculative, one per gamma), ``plain`` (specgen with
speculation off), ``hf_generate``, ``hf_assisted`` (one per gamma; needs a
draft model) and ``hf_prompt_lookup`` (one per gamma).
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf

from specgen.bench.baselines import HF_METHODS, generate_kwargs, run_hf, unsupported_sampling
from specgen.bench.calibrate import calibrate
from specgen.bench.prompts import BenchPrompt, load_prompt_sets
from specgen.errors import ConfigError
from specgen.events import FinishEvent
from specgen.stats import Clock, Stats

BASELINES = ("plain", "hf_generate", "hf_assisted", "hf_prompt_lookup")
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class Arm:
    method: str
    gamma: int | None = None


@dataclass
class Settings:
    """The validated ``bench`` config group (see conf/bench/default.yaml)."""

    prompts: object
    num_prompts: int | None
    max_prompt_tokens: int
    max_new_tokens: int
    gammas: list[int]
    temperatures: list[float]
    baselines: list[str]
    warmup: int = 1
    ignore_eos: bool = True
    seed: int = 0
    calibration_repeats: int = 3

    @classmethod
    def from_config(cls, bench: Mapping) -> Settings:
        names = ("prompts", "num_prompts", "max_prompt_tokens", "max_new_tokens", "gammas", "temperatures",
                 "baselines", "warmup", "ignore_eos", "seed", "calibration_repeats")
        settings = cls(**{name: bench[name] for name in names if name in bench})
        settings.gammas = [_positive_int(g, "bench.gammas") for g in _as_list(settings.gammas)]
        settings.temperatures = [float(t) for t in _as_list(settings.temperatures)]
        settings.baselines = [str(b) for b in _as_list(settings.baselines)]
        unknown = sorted(set(settings.baselines) - set(BASELINES))
        if unknown:
            raise ConfigError(f"bench.baselines: unknown {unknown}; choose from {list(BASELINES)}")
        if any(t < 0 for t in settings.temperatures) or not settings.temperatures or not settings.gammas:
            raise ConfigError("bench.temperatures (>= 0) and bench.gammas need at least one value each")
        settings.max_new_tokens = _positive_int(settings.max_new_tokens, "bench.max_new_tokens")
        return settings


@dataclass
class BenchRun:
    """samples: one dict per timed generation (see summary.py); notes: what was skipped and why."""

    samples: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    hf_spec_method: str | None = None
    environment: dict = field(default_factory=dict)
    calibration: dict | None = None


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]


def _positive_int(value, what: str) -> int:
    if int(value) != value or int(value) < 1:
        raise ConfigError(f"{what} must hold positive integers, got {value}")
    return int(value)


def plan_arms(pipe, settings: Settings) -> tuple[list[Arm], list[str]]:
    """The arms this pipeline can run, and a note for each requested one it cannot."""
    arms, notes = [], []
    if pipe.speculative:
        arms += [Arm("specgen", g) for g in settings.gammas]
    else:
        notes.append(f"specgen speculative rows skipped: {pipe.guarantee}")
    grammar = (pipe.config.get("grammar") or {}).get("kind", "none")
    hf_reason = unsupported_sampling(pipe.config["sampling"])
    if grammar != "none":
        hf_reason = f"HF generate() has no equivalent of grammar={grammar}"
    for name in settings.baselines:
        if name == "plain":
            arms.append(Arm("plain"))
        elif hf_reason:
            notes.append(f"{name} skipped: {hf_reason}")
        elif name == "hf_generate":
            arms.append(Arm("hf_generate"))
        elif name == "hf_assisted" and draft_model(pipe) is None:
            notes.append("hf_assisted skipped: the drafter has no draft model (use drafter=small_model or similar)")
        elif name in ("hf_assisted", "hf_prompt_lookup"):
            arms += [Arm(name, g) for g in settings.gammas]
    return arms, notes


def draft_model(pipe) -> torch.nn.Module | None:
    """The HF model of a small-model drafter, else None."""
    lm = getattr(pipe.drafter, "lm", None)
    return getattr(lm, "model", None)


def hf_spec_method(pipe) -> str | None:
    """HF's counterpart of the pipeline's drafter: assisted generation or prompt lookup."""
    if draft_model(pipe) is not None:
        return "hf_assisted"
    if getattr(pipe.drafter, "name", None) == "ngram":
        return "hf_prompt_lookup"
    return None


def build_variant(cfg: DictConfig, temperature: float, settings: Settings, progress: bool):
    """The pipeline for one temperature (EOS masked until max_new_tokens when ignore_eos)."""
    from specgen.build import build_pipeline

    variant = copy.deepcopy(cfg)
    OmegaConf.update(variant, "sampling.temperature", float(temperature))
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
            clock: Callable[[], float]) -> dict:
    """One timed generation; returns the sample (with ``token_ids``, dropped before storing).

    hf_kwargs: ``generate()`` arguments for the HF methods, for the same ``max_new``.
    specgen samples also carry ``first_round``: the engine's live counters when the
    first token arrived (the round that prefilled the prompt), so summaries can
    report the decode phase on its own.
    """
    if arm.method in HF_METHODS:
        result = run_hf(arm.method, pipe.target.model, ids, hf_kwargs, clock=clock, seed=seed, gamma=arm.gamma,
                        assistant=draft_model(pipe), max_ngram=getattr(pipe.drafter, "max_ngram", 3))
        memory = pipe.drafter.extra_memory_bytes if arm.method == "hf_assisted" else 0  # the same draft weights
        return dict(result, drafter_memory_bytes=memory)
    speculative = arm.method == "specgen"
    stats, first, gen = Stats(), None, None
    start = clock()
    for event in pipe.stream(prompt_ids=ids, max_new_tokens=max_new, seed=seed, speculative=speculative,
                             stats=stats, num_tokens=arm.gamma if speculative else None):
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
        "drafter_memory_bytes": stats.drafter_memory_bytes, "guarantee": gen.guarantee,
        "finish_reason": gen.finish_reason,
    }


def run_matrix(cfg: DictConfig, settings: Settings, *, progress: bool = True) -> BenchRun:
    """Run the whole matrix described by ``cfg`` (specgen config + bench settings)."""
    from tqdm.auto import tqdm

    from specgen.bench.report import environment

    run = BenchRun()
    prompts = load_prompt_sets(settings.prompts, settings.num_prompts, run.notes.append)
    bar = tqdm(total=0, desc="specgen-bench", unit="gen", disable=not progress, leave=False)
    encoded = None
    try:
        for temperature in settings.temperatures:
            pipe = build_variant(cfg, temperature, settings, progress)
            if encoded is None:
                encoded = encode_prompts(pipe, prompts, settings, run.notes)
                arms, notes = plan_arms(pipe, settings)
                run.notes += notes
                run.hf_spec_method = hf_spec_method(pipe) if pipe.speculative else None
                run.environment = environment(pipe)
                bar.total = len(settings.temperatures) * len(arms) * (settings.warmup + len(encoded))
                bar.refresh()
            clock = Clock(pipe.device)
            _warm_up(pipe, arms, encoded[0][1], temperature, settings, clock, bar)
            if run.calibration is None and settings.calibration_repeats > 0:
                bar.set_postfix_str("calibrating forward costs")
                run.calibration = calibrate(pipe, calibration_context(encoded, settings.max_new_tokens),
                                            max(settings.gammas), clock, settings.calibration_repeats)
            _measure(pipe, arms, encoded, temperature, settings, clock, run.samples, bar)
            del pipe
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        bar.close()
    return run


def calibration_context(encoded: list[tuple], max_new_tokens: int) -> list[int]:
    """A typical decoding context: the median-length prompt plus half the new tokens (repeating it)."""
    ids = sorted((ids for _, ids in encoded), key=len)[len(encoded) // 2]
    extra = max_new_tokens // 2
    return list(ids) + [ids[i % len(ids)] for i in range(extra)]


def _hf_kwargs(pipe, temperature: float, settings: Settings, max_new: int) -> dict:
    return generate_kwargs(pipe.config["sampling"], temperature=temperature, max_new_tokens=max_new,
                           ignore_eos=settings.ignore_eos, eos_ids=pipe.tokenizer.eos_ids)


def _warm_up(pipe, arms: list[Arm], ids: list[int], temperature: float, settings: Settings, clock, bar) -> None:
    max_new = min(WARMUP_TOKENS, settings.max_new_tokens)
    hf_kwargs = _hf_kwargs(pipe, temperature, settings, max_new)
    for _ in range(settings.warmup):
        for arm in arms:
            bar.set_postfix_str(f"T={temperature:g} warm-up {arm.method}")
            run_arm(pipe, arm, ids, max_new=max_new, seed=settings.seed, hf_kwargs=hf_kwargs, clock=clock)
            bar.update()


def _measure(pipe, arms: list[Arm], encoded: list[tuple], temperature: float, settings: Settings, clock,
             samples: list[dict], bar) -> None:
    measured = _hf_kwargs(pipe, temperature, settings, settings.max_new_tokens)
    for index, (prompt, ids) in enumerate(encoded):
        shift = index % len(arms)
        results = {}
        for arm in arms[shift:] + arms[:shift]:
            bar.set_postfix_str(f"T={temperature:g} {prompt.task} #{index} {arm.method}"
                                + (f" gamma={arm.gamma}" if arm.gamma else ""))
            results[arm] = run_arm(pipe, arm, ids, max_new=settings.max_new_tokens, seed=settings.seed + index,
                                   hf_kwargs=measured, clock=clock)
            bar.update()
        plain_ids = results[Arm("plain")]["token_ids"] if Arm("plain") in results and temperature == 0 else None
        for arm, result in results.items():
            samples.append(_sample(arm, result, prompt, index, ids, temperature, plain_ids))


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
