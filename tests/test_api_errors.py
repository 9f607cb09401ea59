"""The Python API refuses bad arguments with a SpecgenError that names them, and reads the usual spellings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specgen
from conftest import tiny_pipeline
from specgen.errors import ConfigError, PromptError, SpecgenError
from specgen.config.options import parse_bool, parse_chat, parse_num_tokens, parse_stop
from specgen.stats import Stats


@pytest.fixture(scope="module")
def pipe():
    return tiny_pipeline()


# --- parse_bool and friends -----------------------------------------------------------------------

@pytest.mark.parametrize("value", [True, 1, "true", "TRUE", " yes ", "On", "1"])
def test_parse_bool_true_spellings(value):
    assert parse_bool(value, "speculative") is True


@pytest.mark.parametrize("value", [False, 0, "false", "No", "OFF", "0"])
def test_parse_bool_false_spellings(value):
    assert parse_bool(value, "speculative") is False


@pytest.mark.parametrize("value", ["maybe", "", 2, -1, 0.5, None, [], "truee"])
def test_parse_bool_rejects_the_rest_naming_the_key(value):
    with pytest.raises(ConfigError, match="chat.enabled must be a boolean"):
        parse_bool(value, "chat.enabled")


def test_parse_chat_stop_and_num_tokens():
    assert [parse_chat(v) for v in (None, "auto", "AUTO", "no", True)] == ["auto", "auto", "auto", False, True]
    assert parse_stop("confusion") == ("confusion",) and parse_stop(["a", "bc"]) == ("a", "bc")
    assert parse_num_tokens("auto") == "auto" and parse_num_tokens(np.int64(3)) == 3
    with pytest.raises(ConfigError, match="chat must be auto or a boolean"):
        parse_chat("maybe")


# --- Pipeline.generate / stream -------------------------------------------------------------------

BAD_CALLS = [
    ((12345,), {}, PromptError, "prompt"),
    ((b"hello",), {}, PromptError, "prompt"),
    (({"role": "user", "content": "hi"},), {}, PromptError, "prompt"),
    (([{"content": "hi"}],), {}, PromptError, "'role'"),
    (([{"role": "user"}],), {}, PromptError, "'content'"),
    ((["hi"],), {}, PromptError, "prompt[0]"),
    (([],), {}, PromptError, "empty list of messages"),
    ((), {"prompt_ids": {1, 2}}, PromptError, "prompt_ids"),
    ((), {"prompt_ids": {"a": 1}}, PromptError, "prompt_ids"),
    ((), {"prompt_ids": np.array([[1, 2]])}, PromptError, "prompt_ids[0]"),
    ((), {"prompt_ids": torch.tensor([1.0, 2.0])}, PromptError, "prompt_ids[0]"),
    ((), {"prompt_ids": torch.tensor(3)}, PromptError, "1-D"),
    (("hi",), {"max_tokens": 5}, ConfigError, "'max_tokens'; did you mean max_new_tokens"),
    (("hi",), {"seed": True}, ConfigError, "seed"),
    ((), {"prompt_ids": ["a"]}, PromptError, "prompt_ids"),
    ((), {"prompt_ids": [1.7]}, PromptError, "prompt_ids"),
    ((), {"prompt_ids": [True]}, PromptError, "prompt_ids"),
    ((), {"prompt_ids": "123"}, PromptError, "prompt_ids"),
    ((), {"prompt_ids": 5}, PromptError, "prompt_ids"),
    ((), {"prompt_ids": [1, 10**9]}, PromptError, "prompt_ids"),
    (("hi",), {"max_new_tokens": 2.9}, ConfigError, "max_new_tokens"),
    (("hi",), {"max_new_tokens": "5"}, ConfigError, "max_new_tokens"),
    (("hi",), {"max_new_tokens": 0}, ConfigError, "max_new_tokens"),
    (("hi",), {"seed": 2**70}, ConfigError, "seed"),
    (("hi",), {"seed": -1}, ConfigError, "seed"),
    (("hi",), {"seed": 1.5}, ConfigError, "seed"),
    (("hi",), {"num_tokens": "abc"}, ConfigError, "num_tokens"),
    (("hi",), {"num_tokens": 0}, ConfigError, "num_tokens"),
    (("hi",), {"num_tokens": 2.5}, ConfigError, "num_tokens"),
    (("hi",), {"stats": {}}, ConfigError, "stats"),
    (("hi",), {"stop": [5]}, ConfigError, "stop"),
    (("hi",), {"stop": [""]}, ConfigError, "stop"),
    (("hi",), {"stop": 5}, ConfigError, "stop"),
    (("hi",), {"stop": ["x"] * 129}, ConfigError, "stop takes at most 128 strings"),
    (("hi",), {"stop": "x" * 1025}, ConfigError, "stop strings take at most 1024 characters"),
    (("hi",), {"speculative": "maybe"}, ConfigError, "speculative"),
    (("hi",), {"chat": "maybe"}, ConfigError, "chat"),
    (("hi",), {"system": 5}, ConfigError, "system"),
    (("hi",), {"regex": 5}, ConfigError, "regex"),
]


@pytest.mark.parametrize(("args", "kwargs", "error", "name"), BAD_CALLS)
def test_bad_arguments_raise_an_error_naming_them(pipe, args, kwargs, error, name):
    with pytest.raises(error) as info:
        pipe.generate(*args, max_new_tokens=kwargs.pop("max_new_tokens", 4), **kwargs)
    assert isinstance(info.value, SpecgenError) and name in str(info.value)


def test_stream_checks_arguments_before_the_first_event(pipe):
    with pytest.raises(ConfigError, match="seed"):
        pipe.stream("hi", seed=2**70)  # raised by the call itself, not on the first next()


def test_integer_like_prompt_ids_and_seeds_are_accepted(pipe):
    reference = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=6, seed=7).token_ids
    assert pipe.generate(prompt_ids=torch.tensor([1, 2, 3]), max_new_tokens=np.int64(6), seed=7).token_ids == reference
    assert pipe.generate(prompt_ids=np.array([1, 2, 3]), max_new_tokens=6, seed=np.uint64(7)).token_ids == reference
    assert len(pipe.generate(prompt_ids=[1], max_new_tokens=2, seed=2**64 - 1).token_ids) == 2


@pytest.mark.parametrize("value", [False, "no", "off", "false", "0", 0])
def test_speculative_false_spellings_decode_plainly(pipe, value):
    assert str(pipe.generate("hi", max_new_tokens=3, speculative=value).guarantee) == "off: speculative=false"


@pytest.mark.parametrize("value", [True, "yes", "on", "TRUE", None])
def test_speculative_true_spellings_keep_speculating(pipe, value):
    assert pipe.generate("hi", max_new_tokens=3, speculative=value).guarantee == pipe.guarantee and pipe.guarantee.speculative


@pytest.mark.parametrize("value", ["false", "no", "off", 0])
def test_chat_false_spellings_encode_raw_text(pipe, value):
    """tiny has no chat template: chat=true fails, so a false spelling read as true would fail too."""
    assert not pipe.tokenizer.has_chat_template
    assert pipe.generate("hi", max_new_tokens=3, chat=value).token_ids
    with pytest.raises(PromptError, match="chat template"):
        pipe.generate("hi", max_new_tokens=3, chat="yes")


def test_a_stop_string_is_one_stop_string(pipe):
    """stop="confusion" must not become the one-character stops c, o, n, f, u, s, i."""
    baseline = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, seed=1)
    text = baseline.text
    assert len(text) > 3
    absent = text[0] + "\x00never-generated"
    kept = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, seed=1, stop=absent)
    assert kept.token_ids == baseline.token_ids and kept.finish_reason == baseline.finish_reason
    stop = text[1:3]
    stopped = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, seed=1, stop=stop)
    assert stopped.finish_reason == "stop" and stop not in stopped.text


def test_reusing_a_stats_object_is_refused_and_leaves_it_alone(pipe):
    stats = Stats()
    first = pipe.generate("hi", max_new_tokens=5, stats=stats)
    assert first.stats is stats and stats.new_tokens == len(first.token_ids) > 0
    before = stats.to_dict()
    with pytest.raises(ConfigError, match="stats"):
        pipe.generate("hi", max_new_tokens=5, stats=stats)
    assert stats.to_dict() == before
    assert pipe.generate("hi", max_new_tokens=5, stats=Stats()).stats.new_tokens == before["new_tokens"]


# --- specgen.pipeline() ---------------------------------------------------------------------------

@pytest.mark.parametrize("args", [(5,), ("target=tiny", None), (["target=tiny"],), (b"target=tiny",)])
def test_pipeline_overrides_must_be_strings(args):
    with pytest.raises(ConfigError, match="overrides must be strings"):
        specgen.pipeline(*args, progress=False)


def test_pipeline_progress_must_be_a_boolean():
    with pytest.raises(ConfigError, match="progress"):
        specgen.pipeline("target=tiny", "drafter=tiny", progress="maybe")
