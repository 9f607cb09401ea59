"""RequestOptions is the API: stream / generate / generate_batch take options and overrides by field name."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_pipeline
from specgen import RequestOptions
from specgen.errors import ConfigError, SpecgenError
from specgen.events import FinishEvent
from specgen.config.options import OPTION_NAMES, request_options, set_fields, with_overrides
from specgen.stats import Stats


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline("sampling=creative")  # sampling: the seed decides the tokens


def test_option_names_are_the_fields():
    assert OPTION_NAMES == tuple(f.name for f in dataclasses.fields(RequestOptions))
    assert set(OPTION_NAMES) >= {"max_new_tokens", "seed", "stop", "speculative", "num_tokens", "stats"}


def test_overrides_lay_over_options_and_none_changes_nothing():
    base = RequestOptions(max_new_tokens=5, seed=3)
    assert with_overrides(base, {"seed": 7, "stop": None}, "x") == RequestOptions(max_new_tokens=5, seed=7)
    assert with_overrides(None, {}, "x") == RequestOptions()
    assert set_fields(base) == {"max_new_tokens": 5, "seed": 3}
    with pytest.raises(ConfigError, match="options must be a specgen.RequestOptions, got dict"):
        with_overrides({"seed": 1}, {}, "x")


def test_resolution_fills_the_pipeline_defaults(pipe):
    resolved = request_options(pipe.defaults, RequestOptions(seed=4))
    assert resolved.seed == 4 and resolved.max_new_tokens == pipe.defaults.max_new_tokens
    assert resolved.speculative is True and resolved.stop == tuple(pipe.defaults.stop)
    with pytest.raises(ConfigError, match="max_new_tokens must be at least 1"):
        request_options(pipe.defaults, RequestOptions(max_new_tokens=0))


def test_options_overrides_and_keywords_give_the_same_generation(pipe):
    ids = [1, 2, 3]
    keywords = pipe.generate(prompt_ids=ids, max_new_tokens=6, seed=11)
    options = pipe.generate(prompt_ids=ids, options=RequestOptions(max_new_tokens=6, seed=11))
    mixed = pipe.generate(prompt_ids=ids, options=RequestOptions(max_new_tokens=6, seed=0), seed=11)
    assert keywords.token_ids == options.token_ids == mixed.token_ids and len(keywords.token_ids) == 6
    seeds = {tuple(pipe.generate(prompt_ids=ids, max_new_tokens=6, seed=s).token_ids) for s in range(6)}
    assert len(seeds) > 1, "the seed must matter for the comparison above to test the override"
    other = pipe.generate(prompt_ids=ids, options=RequestOptions(max_new_tokens=6, seed=11), speculative=False)
    assert str(other.guarantee) == "off: speculative=false" and other.stats.drafted == 0


def test_stream_takes_options_positionally_and_fills_the_given_stats(pipe):
    stats = Stats()
    events = list(pipe.stream("hello", RequestOptions(max_new_tokens=4, seed=1, stats=stats)))
    assert isinstance(events[-1], FinishEvent) and events[-1].generation.stats is stats
    assert stats.new_tokens == len(events[-1].generation.token_ids) > 0


@pytest.mark.parametrize("call", ["stream", "generate"])
def test_an_unknown_override_is_one_clear_line(pipe, call):
    with pytest.raises(SpecgenError) as info:
        getattr(pipe, call)("hi", max_new_tokenz=3)
    message = str(info.value)
    assert "\n" not in message and f"{call}() got an unknown argument 'max_new_tokenz'" in message
    assert "did you mean max_new_tokens?" in message


def test_batch_rows_take_options_and_refuse_unknown_names(pipe):
    rows = [{"prompt_ids": [1, 2], "options": RequestOptions(seed=5)}, {"prompt_ids": [1, 2], "seed": 5},
            {"prompt_ids": [1, 2], "options": RequestOptions(max_new_tokens=2), "max_new_tokens": 3}]
    first, second, third = pipe.generate_batch(rows, options=RequestOptions(max_new_tokens=4, seed=0))
    assert first.token_ids == second.token_ids and len(first.token_ids) == 4 and len(third.token_ids) == 3
    with pytest.raises(ConfigError, match="generate_batch\\(\\) got an unknown argument 'sed'"):
        pipe.generate_batch([[{"role": "user", "content": "hi"}]], sed=1)
    with pytest.raises(ConfigError, match="stats is not"):
        pipe.generate_batch([{"prompt_ids": [1], "options": RequestOptions(stats=Stats())}])
