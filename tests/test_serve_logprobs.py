"""specgen-serve's logprobs: the ``openai`` client against the test server of test_serve.

The server's rows share batched forwards, whose logits on the tiny torch path are up to ~1e-6 away
from a single request's (not batch invariant), so served values are compared to ``Generation``'s to
1e-5, with negative controls far above that; echo's prompt logprobs come from one prefill of their
own and equal ``Pipeline.score`` bit for bit.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_logprobs import oracle  # noqa: E402
from test_serve import CHAT_PROMPT, PROMPT, SCHEMA, client, reference, served  # noqa: E402,F401 (fixtures)

TOLERANCE = 1e-5


def _close(served_values, expected_values) -> bool:
    return len(served_values) == len(expected_values) and all(
        abs(a - b) < TOLERANCE for a, b in zip(served_values, expected_values, strict=True))


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_completion_logprobs_equal_the_generations(client, reference, kind):
    seed = {"seed": 7} if kind == "sampled" else {}
    expected = reference[kind].generate(PROMPT, chat=False, max_new_tokens=8, logprobs=3, **seed)
    plain = reference[kind].generate(PROMPT, chat=False, max_new_tokens=8, logprobs=3, speculative=False, **seed)
    temperature = {"temperature": 0.9} if kind == "sampled" else {}
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=3, **seed, **temperature)
    logprobs = resp.choices[0].logprobs
    decode = reference[kind].tokenizer.decode
    assert logprobs.tokens == [decode([t]) for t in expected.token_ids]
    assert "".join(logprobs.tokens) == resp.choices[0].text == expected.text
    assert _close(logprobs.token_logprobs, [e.logprob for e in expected.logprobs])
    assert logprobs.text_offset == list(range(len(expected.token_ids)))  # one character a token
    for top, entry in zip(logprobs.top_logprobs, expected.logprobs, strict=True):
        assert len(top) == 3 and _close(list(top.values()), [v for _, v in entry.top])
        assert list(top) == [decode([t]) for t, _ in entry.top]
    if kind == "greedy":  # plain decoding reports the same tokens and numbers
        assert plain.token_ids == expected.token_ids
        assert _close(logprobs.token_logprobs, [e.logprob for e in plain.logprobs])
    assert _close(logprobs.token_logprobs, oracle(reference[kind], expected.prompt_ids, expected.token_ids))
    # negative control: the other law (greedy's temperature 1 vs 0.9) gives other numbers for these tokens
    other = reference["sampled" if kind == "greedy" else "greedy"]
    assert not _close(logprobs.token_logprobs, oracle(other, expected.prompt_ids, expected.token_ids))


def test_echo_scores_the_prompt_bit_for_bit(client, reference):
    pipe = reference["greedy"]
    scores = pipe.score(PROMPT, top_logprobs=2)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = resp.choices[0]
    assert choice.text == PROMPT and resp.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == [e.logprob for e in scores.logprobs[1:]]
    assert choice.logprobs.tokens == [pipe.tokenizer.decode([t]) for t in scores.token_ids]
    # with a completion: the prompt's entries, then the generated ones, offsets running on
    expected = pipe.generate(PROMPT, chat=False, max_new_tokens=4, logprobs=2)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, echo=True, logprobs=2)
    logprobs = resp.choices[0].logprobs
    assert resp.choices[0].text == PROMPT + expected.text
    assert logprobs.token_logprobs[1:len(PROMPT)] == [e.logprob for e in scores.logprobs[1:]]
    assert _close(logprobs.token_logprobs[len(PROMPT):], [e.logprob for e in expected.logprobs])
    assert logprobs.text_offset == list(range(len(PROMPT) + 4))


def test_chat_logprobs_equal_the_generations(client, reference):
    expected = reference["greedy"].generate(CHAT_PROMPT, chat=False, max_new_tokens=6, stop=["\nUser:"], logprobs=2)
    messages = [{"role": "user", "content": "ab"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, logprobs=True,
                                          top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == [reference["greedy"].tokenizer.decode([t]) for t in expected.token_ids]
    assert _close([c.logprob for c in content], [e.logprob for e in expected.logprobs])
    assert all(bytes(c.bytes).decode() == c.token and len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, logprobs=True)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    none = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    assert none.choices[0].logprobs is None


def test_streamed_chunks_carry_the_same_logprobs(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=1)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=1, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert _close(streamed, whole.choices[0].logprobs.token_logprobs)
    offsets = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    messages = [{"role": "user", "content": "ab"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, logprobs=True)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, logprobs=True,
                                                 stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in whole.choices[0].logprobs.content]
    assert _close([c.logprob for c in streamed], [c.logprob for c in whole.choices[0].logprobs.content])


@pytest.mark.parametrize(("kind", "kwargs", "param"), [
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"logprobs": -1}, "logprobs"),
    ("completion", {"logprobs": True}, "logprobs"),
    ("completion", {"echo": "yes"}, "echo"),
    ("completion", {"echo": True, "stream": True}, "echo"),
    ("completion", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("chat", {"extra_body": {"echo": True}}, "echo"),
])
def test_bad_logprob_fields_get_a_400_naming_them(client, kind, kwargs, param):
    with pytest.raises(openai.APIStatusError) as info:
        if kind == "chat":
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=3,
                                           **kwargs)
        else:
            client.completions.create(**{"model": "tiny", "prompt": PROMPT, "max_tokens": 3, **kwargs})
    assert info.value.status_code == 400
    assert info.value.body["param"] == param


def test_a_grammar_request_reports_only_allowed_alternatives(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "tiny", "schema": SCHEMA}}
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=30,
                                          temperature=1.0, seed=1, response_format=response_format, logprobs=True,
                                          top_logprobs=20)
    content = resp.choices[0].logprobs.content
    assert content and content[0].token == "{" and [c.token for c in content[0].top_logprobs] == ["{"]
    assert content[0].logprob == 0.0  # the grammar allows only "{": p is one-hot
    assert all(len(c.top_logprobs) < 16 for c in content)  # forbidden tokens are no alternatives (and no -inf)
