"""Quality of each numerical path against the float32 reference (``specgen-bench bench.quality=true``).

The measured text is the reference's own greedy continuation of each held-out prompt
(``bench.max_new_tokens`` tokens; the prompt itself is context, not scored). Every path
scores that whole sequence in one teacher-forced forward through the :class:`Target`
protocol (raw logits, no processor or temperature), and at each generated position the
report takes the path's negative log-likelihood of the token, KL(reference || path) and
whether its argmax equals the reference's. The reference row is measured too (a second
forward of the same model), so its KL is 0 only when that forward repeats bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from omegaconf import OmegaConf

from specgen.errors import ConfigError
from specgen.models.target import Target

REFERENCE = "float32"
#: Path name -> the run config (``dtype``, ``backend``) that selects it.
PATHS: dict[str, dict[str, str]] = {
    "float32": {"dtype": "float32", "backend": "torch"},
    "bfloat16": {"dtype": "bfloat16", "backend": "torch"},
    "llama_cpp": {"dtype": "auto", "backend": "llama_cpp"},
    "int8": {"dtype": "int8", "backend": "torch"},
    "int4": {"dtype": "int4", "backend": "torch"},
    "w8a8": {"dtype": "w8a8", "backend": "torch"},
}


def parse_paths(value, key: str = "bench.quality_paths") -> list[str]:
    """The path names of ``value`` (a name or a list), the reference first and each once;
    ConfigError naming an unknown name (checked before any model loads)."""
    names = [str(v).strip() for v in (list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value)
                                      else [value])]
    unknown = [name for name in names if name not in PATHS]
    if unknown:
        raise ConfigError(f"{key}: unknown {unknown}; choose from {list(PATHS)}")
    return list(dict.fromkeys([REFERENCE, *names]))


@dataclass(frozen=True)
class ReferenceText:
    """The measured text: ``sequences[i]`` is prompt i's ids followed by its ``scored[i]``
    generated tokens; ``logprobs[i]`` the reference's log-softmax at the positions predicting
    them, [scored[i], vocab] float64."""

    sequences: list[list[int]]
    scored: list[int]
    logprobs: list[torch.Tensor]


@dataclass(frozen=True)
class PathQuality:
    """Means over every scored position: ``nll`` (nats per token), ``kl`` (KL(reference || path),
    nats), ``top1`` (share of positions whose argmax equals the reference's)."""

    nll: float
    kl: float
    top1: float
    positions: int


def greedy_continuation(target: Target, ids: Sequence[int], new_tokens: int) -> list[int]:
    """``ids`` followed by ``target``'s ``new_tokens`` greedy tokens (argmax of its raw logits)."""
    out = list(ids)
    cache = target.new_cache()
    try:
        row = target.forward(cache, out, keep=1)  # [1, vocab]
        for step in range(new_tokens):
            out.append(int(row[-1].argmax()))
            if step + 1 < new_tokens:
                row = target.forward(cache, out[-1:], keep=1)
    finally:
        cache.release()
    return out


def teacher_forced(target: Target, sequence: Sequence[int], scored: int) -> torch.Tensor:
    """Log-softmax (float64) of ``target``'s raw logits at the positions predicting the last
    ``scored`` tokens of ``sequence``, from one forward over it: [scored, vocab]."""
    cache = target.new_cache()
    try:
        raw = target.forward(cache, list(sequence[:-1]), keep=scored)  # [scored, vocab]
    finally:
        cache.release()
    return raw.double().log_softmax(-1)


def reference_text(reference: Target, prompts: Sequence[Sequence[int]], new_tokens: int) -> ReferenceText:
    """The reference's greedy continuations of ``prompts`` and its own scores of them."""
    sequences = [greedy_continuation(reference, ids, new_tokens) for ids in prompts]
    scored = [new_tokens] * len(sequences)
    return ReferenceText(sequences, scored, [teacher_forced(reference, s, n) for s, n in zip(sequences, scored)])


def measure(target: Target, text: ReferenceText) -> PathQuality:
    """``target``'s quality on ``text`` against the reference that produced it."""
    nll, kl, top1 = [], [], []
    for sequence, scored, expected in zip(text.sequences, text.scored, text.logprobs):
        got = teacher_forced(target, sequence, scored)  # [scored, vocab]
        if got.shape != expected.shape:
            raise ConfigError(f"{target.name}: logits {tuple(got.shape)} differ from the reference's "
                              f"{tuple(expected.shape)}; the paths do not share a vocabulary")
        tokens = torch.tensor(sequence[-scored:], dtype=torch.long)  # [scored]
        nll.append(-got.gather(-1, tokens[:, None])[:, 0])
        kl.append((expected.exp() * (expected - got)).sum(-1))
        top1.append((expected.argmax(-1) == got.argmax(-1)).double())
    nll_all, kl_all, top1_all = torch.cat(nll), torch.cat(kl), torch.cat(top1)
    return PathQuality(float(nll_all.mean()), float(kl_all.mean()), float(top1_all.mean()), int(nll_all.numel()))


def path_config(cfg, path: str):
    """A copy of the run config ``cfg`` whose target loads on ``path``, alone (no drafter, no prefix cache)."""
    variant = copy.deepcopy(cfg)
    for key, value in {**PATHS[path], "speculative": False, "prefix_cache.entries": 0}.items():
        OmegaConf.update(variant, key, value, force_add=True)
    return variant


def run_quality(cfg, paths: Sequence[str], prompts: Sequence, new_tokens: int,
                notice: Callable[[str], None], progress: bool = False) -> dict[str, PathQuality]:
    """{path: quality} for each of ``paths`` (the reference first) over the reference's greedy
    continuations of ``prompts`` (prompt strings or chat messages, encoded as each run would);
    paths are loaded one at a time; one that cannot load on this machine is skipped with a notice."""
    from specgen.engine.assemble import build_pipeline

    reference = build_pipeline(path_config(cfg, REFERENCE), progress=progress)
    ids = [reference.encode(p) for p in prompts]
    fits = [i for i in ids if len(i) + new_tokens <= reference.target.context_length]
    if len(fits) < len(ids):
        notice(f"{len(ids) - len(fits)} prompt(s) skipped: longer than the model's context")
    with torch.no_grad():  # not inference_mode: paths load inside, and packed weights track versions
        text = reference_text(reference.target, fits, new_tokens)
        results = {REFERENCE: measure(reference.target, text)}
        del reference
        for path in paths:
            if path in results:
                continue
            try:
                pipe = build_pipeline(path_config(cfg, path), progress=progress)
            except ConfigError as error:
                notice(f"quality: path {path} skipped: {error}")
                continue
            results[path] = measure(pipe.target, text)
            del pipe
    return results


def quality_markdown(results: Mapping[str, PathQuality]) -> str:
    """The report's table: a row per path, ΔNLL and KL against the reference row."""
    base = results[REFERENCE].nll
    lines = ["| path | mean NLL (nats/token) | perplexity | ΔNLL vs float32 | mean KL(float32 ‖ path) "
             "| top-1 agreement | positions |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for path, q in results.items():
        lines.append(f"| {path} | {q.nll:.4f} | {torch.tensor(q.nll).exp().item():.3f} | {q.nll - base:+.4f} "
                     f"| {q.kl:.5f} | {q.top1:.3f} | {q.positions} |")
    return "\n".join(lines) + "\n"


def quality_title(target: str, sets: Sequence[str], num_prompts: int, new_tokens: int, threads) -> str:
    """What the table measured, in one header line (``sets``: the prompt sets' names)."""
    return (f"## Quality of each path: {target}, the float32 path's greedy continuations of {num_prompts} "
            f"held-out prompts ({', '.join(sets)}) x {new_tokens} tokens (prompts are context, not scored), "
            f"teacher-forced raw logits, threads={threads}")
