"""The validated ``bench`` config group (conf/bench/default.yaml) and the baselines it may name."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from specgen.bench.baselines import HF_KERNELS
from specgen.bench.llama_baselines import LLAMA_METHODS
from specgen.bench.quality import PATHS, parse_paths
from specgen.errors import ConfigError
from specgen.config.options import SEED_MAX, check_temperature, parse_batch_size, parse_bool, parse_int, parse_seed
from specgen.planning import AUTO

BASELINES = ("plain", "hf_generate", "hf_assisted", "hf_prompt_lookup", *LLAMA_METHODS)


@dataclass
class Settings:
    """The validated ``bench`` config group (see conf/bench/default.yaml).

    :meth:`from_config` raises ConfigError naming the first bad ``bench.*`` key.
    """

    prompts: object
    num_prompts: int | None
    max_prompt_tokens: int
    max_new_tokens: int
    gammas: list[int]
    temperatures: list[float]
    baselines: list[str]
    warmup: int = 1
    repeats: int = 1
    ignore_eos: bool = True
    seed: int = 0
    calibration_repeats: int = 3
    remeasure_costs: bool = False
    batch_sizes: list[int] = field(default_factory=list)
    batch_repeats: int = 2
    hf_kernels: str = "stock"
    quality: bool = False
    quality_paths: list[str] = field(default_factory=lambda: list(PATHS))

    @classmethod
    def from_config(cls, bench: Mapping) -> Settings:
        names = ("prompts", "num_prompts", "max_prompt_tokens", "max_new_tokens", "gammas", "temperatures",
                 "baselines", "warmup", "repeats", "ignore_eos", "seed", "calibration_repeats", "remeasure_costs",
                 "batch_sizes", "batch_repeats", "hf_kernels", "quality", "quality_paths")
        settings = cls(**{name: bench[name] for name in names if name in bench})
        settings.batch_sizes = sorted({parse_batch_size(b, "bench.batch_sizes")
                                       for b in _as_list(settings.batch_sizes or [])})
        settings.batch_repeats = parse_int(settings.batch_repeats, "bench.batch_repeats", minimum=1)
        settings.gammas = [AUTO if str(g).strip().lower() == AUTO else parse_int(g, "bench.gammas", minimum=1)
                           for g in _as_list(settings.gammas)]
        settings.temperatures = [_temperature(t) for t in _as_list(settings.temperatures)]
        settings.baselines = [str(b) for b in _as_list(settings.baselines)]
        unknown = sorted(set(settings.baselines) - set(BASELINES))
        if unknown:
            raise ConfigError(f"bench.baselines: unknown {unknown}; choose from {list(BASELINES)}")
        for name, example in (("gammas", "[2,4]"), ("temperatures", "[0,0.7]")):
            if not getattr(settings, name):
                raise ConfigError(f"bench.{name} needs at least one value, e.g. bench.{name}={example}")
        if settings.num_prompts is not None and (isinstance(settings.num_prompts, bool)
                                                 or not isinstance(settings.num_prompts, int)
                                                 or settings.num_prompts < 1):
            raise ConfigError(f"bench.num_prompts must be a positive integer (or null = every prompt), "
                              f"got {settings.num_prompts!r}")
        settings.max_prompt_tokens = parse_int(settings.max_prompt_tokens, "bench.max_prompt_tokens", minimum=1)
        settings.max_new_tokens = parse_int(settings.max_new_tokens, "bench.max_new_tokens", minimum=1)
        settings.warmup = parse_int(settings.warmup, "bench.warmup", minimum=0)
        settings.repeats = parse_int(settings.repeats, "bench.repeats", minimum=1)
        settings.calibration_repeats = parse_int(settings.calibration_repeats, "bench.calibration_repeats", minimum=0)
        settings.seed = parse_seed(settings.seed, "bench.seed")
        settings.ignore_eos = parse_bool(settings.ignore_eos, "bench.ignore_eos")
        settings.remeasure_costs = parse_bool(settings.remeasure_costs, "bench.remeasure_costs")
        settings.hf_kernels = str(settings.hf_kernels).strip().lower()
        if settings.hf_kernels not in HF_KERNELS:
            raise ConfigError(f"bench.hf_kernels: unknown {settings.hf_kernels!r}; choose from {list(HF_KERNELS)}")
        settings.quality = parse_bool(settings.quality, "bench.quality")
        settings.quality_paths = parse_paths(settings.quality_paths)
        return settings

    def check_seeds(self, prompts: int) -> None:
        """ConfigError when the seed of the last of ``prompts`` prompts (prompt i runs with bench.seed + i)
        would pass the largest seed: checked once the prompts are read, before any model loads."""
        if self.seed + prompts - 1 > SEED_MAX:
            raise ConfigError(f"bench.seed={self.seed}: prompt i runs with bench.seed + i, past the largest seed "
                              f"{SEED_MAX} for {prompts} prompts; give bench.seed={SEED_MAX - prompts + 1} or less")


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]


def _temperature(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"bench.temperatures must hold finite numbers >= 0 (0 = greedy), got {value!r}")
    return check_temperature(float(value), "bench.temperatures")
