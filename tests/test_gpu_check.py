"""The CUDA-path checks of scripts/gpu_check.sh, runnable on any device.

The device comes from ``SPECGEN_CHECK_DEVICE`` (default ``cpu``, so CI runs these
on the CPU); ``scripts/gpu_check.sh`` sets it to ``cuda``. Everything uses the
tiny models built in code: tree forward vs per-path forwards, greedy equality for
every drafter kind, learned heads in bfloat16, statistical exactness, and token
identity of the float32 verify pass with single-token steps (TF32 off).
"""

from __future__ import annotations

import os

import pytest
import torch

import specgen
from conftest import check_tree_forward_matches_each_path
from exact import exact_distribution, goodness_of_fit, sample_counts
from specgen.heads import HeadConfig, build_head, save_head, target_fingerprint

DEVICE = os.environ.get("SPECGEN_CHECK_DEVICE", "cpu")
BASE = ("target=tiny", "threads=1", f"device={DEVICE}")
PROMPTS = ([1, 2, 3], [5, 4, 7, 1], [9, 9, 2, 6])

if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"SPECGEN_CHECK_DEVICE={DEVICE} but no CUDA device", allow_module_level=True)


def _pipe(*overrides):
    return specgen.pipeline(*BASE, *overrides, progress=False)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """{kind: head override} for the tiny target; {(kind, 8): ...} for its vocab-8 variant."""
    base = tmp_path_factory.mktemp("check-heads")
    out = {}
    for vocab in (16, 8):
        model = _pipe("dtype=float32", "drafter=none", f"target.source.vocab_size={vocab}").target.model
        d = model.config.hidden_size
        for kind in ("eagle", "medusa", "mtp", "dspark"):
            torch.manual_seed(1)
            head = build_head(HeadConfig(kind=kind, hidden_size=d, draft_vocab_size=vocab - 2,
                                         intermediate_size=2 * d, num_heads=4), torch.arange(vocab - 2))
            with torch.no_grad():
                for param in head.parameters():
                    param.normal_(0.0, 0.3)
            path = save_head(base / f"{kind}{vocab}.safetensors", head, target_fingerprint(model))
            out[kind if vocab == 16 else (kind, vocab)] = f"drafter.head_file={path}"
    return out


def _drafter(kind, heads, vocab: int = 16):
    key = kind if vocab == 16 else (kind, vocab)
    return (f"drafter={kind}", "drafter.num_tokens=3", *([heads[key]] if key in heads else []))


def test_tree_forward_matches_each_path_on_device():
    check_tree_forward_matches_each_path(_pipe("dtype=float32", "drafter=none").target)


@pytest.mark.parametrize("kind", ["ngram", "tiny", "eagle", "medusa", "mtp", "dspark"])
def test_greedy_equals_plain_on_device(kind, heads):
    pipe = _pipe("dtype=float32", "invariant_verify=true", *_drafter(kind, heads), "sampling.temperature=0",
                 "sampling.repetition_penalty=1.3")  # the configuration whose verify pass is measured exact
    assert pipe.guarantee.kind == "greedy"
    for prompt in PROMPTS:
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=24, seed=0)
        assert spec.token_ids == pipe.generate(prompt_ids=prompt, max_new_tokens=24, speculative=False).token_ids


@pytest.mark.parametrize("kind", ["eagle", "medusa", "mtp", "dspark"])
def test_learned_heads_in_bfloat16_on_device(kind, heads):
    for target_dtype, drafter_dtype in (("bfloat16", "null"), ("float32", "bfloat16")):
        pipe = _pipe(f"dtype={target_dtype}", *_drafter(kind, heads), f"drafter.dtype={drafter_dtype}",
                     "sampling.temperature=0.8")
        assert next(pipe.drafter.head.parameters()).dtype == torch.bfloat16
        drafted = sum(pipe.generate(prompt_ids=p, max_new_tokens=12, seed=0).stats.drafted for p in PROMPTS)
        assert drafted > 0


@pytest.mark.skipif(DEVICE == "cpu", reason="on the CPU, tests/test_exactness.py and test_learned_drafters.py cover it")
@pytest.mark.parametrize("kind", ["tiny", "ngram", "eagle", "mtp"])
def test_exactness_on_device(kind, heads):
    vocab8 = ("target.source.vocab_size=8", *(("drafter.source.vocab_size=8",) if kind == "tiny" else ()))
    pipe = _pipe("dtype=float32", *_drafter(kind, heads, 8), *vocab8, "sampling.temperature=1.0")
    expected = exact_distribution(pipe, [1, 2, 1, 2], 3)
    counts = sample_counts(pipe, [1, 2, 1, 2], 3, 2000)
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"{kind} on {DEVICE}: chi-square p={p_value:.2e}, TV={tv:.3f}"


def test_float32_verify_pass_matches_single_token_steps():
    """Greedy identity: the argmax of every row of one multi-token verify pass equals the argmax
    of single-token steps over the same tokens (on CUDA: TF32 off, as the build sets it)."""
    pipe = _pipe("dtype=float32", "drafter=none", "target.source.init_scale=0.2")
    lm = pipe.target
    tokens = torch.randint(0, 16, (96,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = lm.new_cache()
    lm.forward(cache, tokens[:8], keep=1)
    mismatches = 0
    for start in range(8, 88, 8):
        block = tokens[start: start + 8]
        verify = lm.forward(cache, block, keep=8).argmax(-1).tolist()  # [8]
        cache.crop(start)
        steps = [lm.forward(cache, [token], keep=1)[0].argmax().item() for token in block]
        mismatches += sum(a != b for a, b in zip(verify, steps, strict=True))
    assert mismatches == 0, f"{mismatches} of 80 positions differ between the verify pass and single steps"


@pytest.mark.skipif(DEVICE != "cpu", reason="the script runs this module on the device itself")
def test_gpu_check_script_runs_its_cpu_safe_parts():
    import pathlib
    import subprocess

    script = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    done = subprocess.run(["bash", str(script), "--device", "cpu", "--quick"], capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "reads/round" in done.stdout and "greedy identical: True" in done.stdout
    batch_lines = [line for line in done.stdout.splitlines() if " batch 8 " in line]
    assert len(batch_lines) == 2 and all("rows = single: True" in line for line in batch_lines)
    assert "gpu_check bench: ok" in done.stdout
