"""cfg -> Pipeline: instantiate the components, check alignment, declare the guarantee.

The :class:`~specgen.guarantee.Guarantee` is decided here, once, before any generation:

* ``off: <reason>`` -- speculation disabled (by the user, no drafter, or p and q
  cannot be aligned: different tokenizers, an impure processor);
* ``greedy`` -- temperature 0: output equals plain greedy decoding token for token;
* ``exact`` -- sampling: every output sequence has exactly the target's distribution;
* ``approximate: <reason>`` -- speculation runs, but the target's verify pass does not
  compute the logits single-token steps compute (a reduced-precision dtype, or a
  measured gap), so near-ties can flip.

``greedy``/``exact`` are measured, never assumed: the target's ``verify_gap`` feeds the
chains (or trees) the run verifies and compares every position's logits with the same
positions fed one token at a time; any difference makes the run ``approximate``,
naming it. On CUDA in float32 the claim names its condition too (TF32 off, which the
build sets; see :func:`specgen.models.cuda_condition`): ``greedy: on CUDA float32 ...``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from specgen.config.checks import parse_threads
from specgen.config.run import RunConfig
from specgen.drafters import Drafter, DrafterRuntime
from specgen.engine.pipeline import Pipeline
from specgen.errors import ConfigError, SpecgenError
from specgen.guarantee import Guarantee
from specgen.models import (LoadedModel, cuda_condition, load_llama_cpp, load_model, load_quantized, resolve_device,
                            resolve_dtype)
from specgen.models.backends import auto_note, choose_backend, loads_on_llama_cpp, quantized_dtype, reads_features
from specgen.models.invariance import probe_tree
from specgen.models.quantized import QUANT_DTYPES
from specgen.models.target import Target
from specgen.models.threads import resolve_auto_threads
from specgen.config.options import MAX_NUM_TOKENS
from specgen.grammar import grammar_processor
from specgen.processors import build_stack


def set_threads(value, name: str = "threads") -> int:
    """Apply ``value`` (a positive int, or auto = the idle physical cores) to torch and return it.

    ConfigError naming ``name`` for anything else (``threads=abc``, ``0``).
    """
    parsed = parse_threads(value, name)
    threads = resolve_auto_threads() if parsed == "auto" else parsed
    torch.set_num_threads(threads)
    return threads


def _bad_words(entries: list, tokenizer) -> list[list[int]]:
    sequences = []
    for entry in entries or []:
        if isinstance(entry, str):
            variants = [ids for ids in tokenizer.token_ids(entry) if ids] if entry else []
            if not variants:
                raise ConfigError(f"sampling.bad_words entry {entry!r} has no tokens, so it would ban nothing")
            sequences.extend(variants)
        elif isinstance(entry, int):
            sequences.append([entry])
        else:
            sequences.append([int(t) for t in entry])
    return sequences


def processor_entries(processors: Sequence[Mapping], tokenizer) -> list[dict]:
    """The config's ``processors`` entries as build_stack entries (bad words resolved with ``tokenizer``)."""
    entries = []
    for entry in processors:
        entry = dict(entry)
        if entry.get("name") == "bad_words":
            entry["bad_words"] = _bad_words(entry.get("bad_words"), tokenizer)
        entries.append(entry)
    return entries


def _build_drafter(drafter: Mapping, runtime: DrafterRuntime) -> Drafter | None:
    from hydra.utils import instantiate

    spec = dict(drafter)
    if spec.get("kind") == "none" or not spec.get("_target_"):
        return None
    try:
        factory = instantiate(spec, _partial_=True, _convert_="all")
        return factory(runtime=runtime)
    except SpecgenError:
        raise
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, SpecgenError) else None
        if cause is not None:
            raise cause from exc
        raise ConfigError(f"cannot build drafter {spec.get('_target_')}: {exc}") from exc


REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def _decide_guarantee(speculative: bool, drafter: Drafter | None, target: LoadedModel, stack,
                      dtype: torch.dtype) -> tuple[Guarantee, Drafter | None]:
    if not speculative:
        return Guarantee.off("speculative=false"), None
    if drafter is None:
        return Guarantee.off("drafter=none"), None
    if drafter.tokenizer is not None:
        mismatch = target.tokenizer.mismatch(drafter.tokenizer)
        if mismatch:
            return Guarantee.off(f"drafter tokenizer does not match the target's ({mismatch})"), None
    impure = stack.impure
    if impure:
        names = ", ".join(p.name for p in impure)
        return Guarantee.off(f"processor {names} cannot be evaluated on hypothetical histories "
                             "(declare pure: true if it is)"), None
    if dtype in REDUCED_PRECISION:
        name = str(dtype).removeprefix("torch.")
        return Guarantee("approximate", f"{name} rounds a multi-token verify pass differently from single-token "
                         "steps, so near-ties can flip; exact/greedy need dtype=float32, measured at load"), drafter
    return Guarantee("greedy" if stack.greedy else "exact"), drafter


def verify_shapes(drafter: Drafter) -> tuple[list[int], list[int] | None]:
    """What a run with ``drafter`` verifies: every chain width from 2 tokens (the last committed
    token and one draft) to ``max_tokens + 1``, and, where its rounds go through tree forwards
    (a tree drafter, or one that reads target features), the parents of a probe tree of the
    drafter's ``max_nodes`` (at most MAX_NUM_TOKENS) spread over ``max_tokens`` levels (None: chains)."""
    widths = list(range(2, drafter.max_tokens + 2))
    if drafter.shape != "tree" and drafter.feature_layers is None:
        return widths, None
    nodes = max(1, min(drafter.max_nodes, MAX_NUM_TOKENS))
    depth = max(1, drafter.max_tokens)
    return widths, probe_tree(-(-nodes // depth), depth)[:nodes]


def numerical_path(lm: Target) -> str:
    """The path ``lm``'s logits come from in words: its backend and what its numerics depend on
    (:meth:`Target.describe`'s ``dtype``), e.g. ``torch (float32)`` or ``llama_cpp (llama 135M Q4_1)``."""
    return f"{lm.backend} ({str(lm.describe()['dtype']).removeprefix('torch.')})"


def _measured(guarantee: Guarantee, lm: Target, drafter: Drafter, name: str) -> Guarantee:
    """An ``exact``/``greedy`` claim as measured on ``lm`` (:meth:`Target.verify_gap` over what the
    run verifies): kept where every verify pass's logits equal single-token logits bit for bit,
    else ``approximate`` naming the largest difference and where it occurs (``name``: the target's)."""
    if not guarantee.exact:
        return guarantee
    widths, parents = verify_shapes(drafter)
    gap, width = lm.verify_gap(widths) if parents is None else lm.verify_gap(widths, parents=parents)
    if gap == 0.0:
        return guarantee
    shape = f"{width}-token verify logits" if parents is None else f"tree verify logits ({width} tokens fed)"
    return Guarantee("approximate", f"{name} on {numerical_path(lm)} computes {shape} up to {gap:.2g} away "
                     "from single-token ones, so near-ties can flip")


def _repack(setting: str, name: str) -> str:
    """llama_cpp.repack for the model called ``name``: a draft model's q is whatever it computes,
    so it keeps repacked weights unless they are switched off."""
    return setting if name == "target" or setting == "off" else "on"


def build_pipeline(cfg: RunConfig | Mapping, *, progress: bool = True) -> Pipeline:
    """Instantiate everything the run config describes and decide the run's guarantee.

    ``cfg``: the run's :class:`~specgen.config.run.RunConfig` (an entry point builds it once), or a
    composed config (a DictConfig or its plain mapping), checked into one here. A bad value raises
    :class:`ConfigError` naming its key before any model is loaded.
    """
    run = RunConfig.from_cfg(cfg)
    checked = run.checked
    threads = set_threads(run.threads)
    device = resolve_device(run.device)
    backend = choose_backend(checked, device)
    quant = quantized_dtype(checked, device)  # the target's int8/int4 path; its logits (and draft models) are float32
    dtype = torch.float32 if quant else resolve_dtype(run.dtype, device, QUANT_DTYPES)
    extra_eos = tuple(run.target.get("eos_ids") or ())
    llama = run.llama_cpp

    def load(source, name="drafter", dtype=dtype, backend=backend, vocab_size=None):
        if quant and name == "target":
            return load_quantized(source, name=name, quant=quant, extra_eos=extra_eos, progress=progress,
                                  keep_model=reads_features(checked))
        if loads_on_llama_cpp(backend, source):
            return load_llama_cpp(source, name=name, threads=threads, extra_eos=extra_eos, progress=progress,
                                  sequences=llama.sequences, context=llama.context, tiny_type=llama.tiny_type,
                                  batch_row_context=llama.batch_row_context, flash_attention=llama.flash_attention,
                                  vocab_size=vocab_size, repack=_repack(llama.repack, name),
                                  prefill_split=llama.prefill_split)
        return load_model(source, name=name, dtype=dtype, device=device, extra_eos=extra_eos, progress=progress,
                          packed=run.packed_weights, vocab_size=vocab_size,
                          invariant=run.invariant_verify and name == "target")

    target = load(run.target["source"], name="target")
    if run.compile:
        target.lm.enable_compile()

    stack = build_stack(processor_entries(run.processors, target.tokenizer), greedy=run.sampling["temperature"] == 0.0,
                        eos_ids=target.tokenizer.eos_ids, vocab_size=target.tokenizer.vocab_size)
    grammar = grammar_processor(run.grammar or {"kind": "none"}, target.tokenizer)
    if grammar is not None:
        stack = stack.with_grammar(grammar)
    drafter = None
    if run.speculative:
        drafter = _build_drafter(run.drafter, DrafterRuntime(target=target, load=load))
    guarantee, drafter = _decide_guarantee(run.speculative, drafter, target, stack, dtype)
    guarantee = cuda_condition(guarantee, device, dtype)  # TF32 off before the measurement
    if drafter is not None:
        guarantee = _measured(guarantee, target.lm, drafter, str(run.target.get("name") or target.lm.name))
    note = auto_note(checked, device, backend)  # a run that backend=auto moved off llama.cpp says why
    guarantee = replace(guarantee, against=numerical_path(target.lm) + note)
    if note and guarantee.kind == "approximate":
        guarantee = replace(guarantee, reason=guarantee.reason + note)
    return Pipeline(target=target.lm, tokenizer=target.tokenizer, drafter=drafter, stack=stack,
                    guarantee=guarantee, config=run)
