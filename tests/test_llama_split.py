"""The prefill split a GGUF model's prompts are decoded in (:mod:`specgen.models.llama_split`): the
narrowest width about as cheap per token as the cheapest, measured once and kept, and used by every
context of the model."""

from __future__ import annotations

import json

import pytest
from conftest import TINY

import specgen
from specgen.models import llama_cpp, llama_split, load_llama_cpp
from specgen.models.llama_cpp import LlamaCppLM

pytestmark = pytest.mark.skipif(not llama_cpp.available(), reason="llama-cpp-python is not installed")

TINY_SOURCE = dict(kind="tiny", seed=0, vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   context_length=512, init_scale=1.0)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))


def test_the_narrowest_width_within_the_slack_of_the_cheapest_is_chosen():
    assert llama_split.choose_width({32: 1.00, 64: 0.97, 128: 0.95}) == 32  # flat: the narrow split
    assert llama_split.choose_width({32: 1.27, 64: 1.00, 128: 0.99}) == 64  # the wide kernels pay up to 64
    assert llama_split.choose_width({32: 2.00, 64: 1.50, 128: 1.00}) == 128
    slack = llama_split.PREFILL_SLACK
    assert llama_split.choose_width({32: slack, 64: 1.0}) == 32  # at the bound, narrow
    assert llama_split.choose_width({32: slack * 1.01, 64: 1.0}) == 64


def test_a_kept_width_is_read_back_and_other_facts_or_a_torn_file_measure_again():
    measured = []

    def measure(costs):
        def measure_now():
            measured.append(costs)
            return costs
        return measure_now

    lines = []
    assert llama_split.prefill_width({"model": "a"}, measure({32: 2.0, 64: 1.0, 128: 1.0}), lines.append) == 64
    assert llama_split.prefill_width({"model": "a"}, measure({32: 1.0, 64: 1.0, 128: 1.0}), lines.append) == 64
    assert len(measured) == 1 and lines == ["started", "64 tokens per decode"]  # the second was kept
    assert llama_split.prefill_width({"model": "b"}, measure({32: 1.0, 64: 1.0, 128: 1.0})) == 32
    assert len(measured) == 2
    (kept,) = [path for path in (llama_split.cache_root() / "llama").iterdir()
               if json.loads(path.read_text())["facts"] == {"model": "a"}]
    kept.write_text('{"width": ')  # torn
    assert llama_split.prefill_width({"model": "a"}, measure({32: 1.0, 64: 1.0, 128: 3.0})) == 32
    kept.write_text('{"width": 100}')  # not a width this version chooses from
    assert llama_split.prefill_width({"model": "a"}, measure({32: 3.0, 64: 3.0, 128: 1.0})) == 128
    assert len(measured) == 4


def test_an_auto_split_is_measured_once_on_the_model_and_every_context_decodes_prompts_in_it(monkeypatch):
    """The real measurement on a tiny GGUF, with a clock that makes a decode of 32 / 64 / 128 tokens cost
    2 / 1 / 0.95 a token: 64 is chosen, and every context splits prompts at it, the first one (opened
    with room for the widest before the measurement) too."""
    path = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm.path  # the tiny model's GGUF
    calls, real = [], llama_split.measure_costs

    def readings():
        now = 0.0
        while True:
            for width, per_token in zip(llama_split.PREFILL_WIDTHS, (2.0, 1.0, 0.95), strict=True):
                yield now
                now += width * per_token
                yield now

    def counted(open_context, vocab_size, **kwargs):
        calls.append(vocab_size)
        return real(open_context, vocab_size, clock=readings().__next__, **kwargs)

    monkeypatch.setattr(llama_cpp, "measure_costs", counted)
    lm = LlamaCppLM(path, vocab_size=16, name="t", threads=1, context_length=512, prefill_split="auto")
    assert lm.prefill_width == 64 and calls == [16]
    assert [context.prefill_tokens for context in lm.pool.contexts()] == [64]
    sizes = []
    cache = lm.new_cache()
    decode = cache.context._decode
    monkeypatch.setattr(cache.context, "_decode", lambda entries: (sizes.append(len(entries)), decode(entries)))
    lm.forward(cache, list(range(1, 16)) * 20, keep=1)
    assert sizes == [64, 64, 64, 64, 44]
    assert lm.new_batch(2, row_context=512).prefill_chunk == 64
    again = LlamaCppLM(path, vocab_size=16, name="t", threads=1, context_length=512, prefill_split="auto")
    assert again.prefill_width == 64 and calls == [16]  # kept: not measured again
    fixed = LlamaCppLM(path, vocab_size=16, name="t", threads=1, context_length=512, prefill_split=32)
    assert fixed.prefill_width == 32 and fixed.new_cache().context.prefill_tokens == 32 and calls == [16]


def test_the_setting_reaches_the_model_and_a_tiny_model_keeps_the_fixed_split():
    pipe = specgen.pipeline(*TINY, "backend=llama_cpp", "drafter=none", "llama_cpp.prefill_split=64", progress=False)
    assert pipe.target.prefill_width == 64
    plain = specgen.pipeline(*TINY, "backend=llama_cpp", "drafter=none", progress=False)
    assert plain.target.prefill_width == llama_split.PREFILL_WIDTHS[0] == 32
