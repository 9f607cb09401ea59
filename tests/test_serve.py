"""specgen-serve: the official ``openai`` client against a server started here on localhost.

The server runs the tiny models in-process (uvicorn in a thread, a free port).
Its tokenizer is swapped for a character tokenizer over JSON characters (as in
test_grammar) so JSON-schema output is possible. Reference outputs come from a
second, identically built pipeline driven directly: greedy requests must equal
``pipe.generate`` token for token, seeded sampled ones too (requests share the
batched scheduler's forwards, each row with its own stack and seeded generator).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from conftest import TINY, tiny_pipeline
from grammar_helpers import char_info

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import specgen  # noqa: E402
from specgen.config.compose import compose, to_container  # noqa: E402
from specgen.errors import ConfigError  # noqa: E402
from specgen.guarantee import Guarantee  # noqa: E402
from specgen.serve import create_app  # noqa: E402
from specgen.serve.cli import check_server_config  # noqa: E402
from specgen.serve.metrics import CONTENT_TYPE  # noqa: E402
from specgen.serve.protocol import Sampling  # noqa: E402
from specgen.serve.request_stack import with_sampling  # noqa: E402
from specgen.serve.worker import BatchWorker, SerialWorker, make_scheduler  # noqa: E402

JSON_CHARS = '{}":,[] ab0123-'  # 15 characters + EOS = the tiny models' 16 ids
SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]},
          "b": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 3}}, "required": ["a", "b"],
          "additionalProperties": False}
SERVER = ("drafter.num_tokens=3",)  # a fixed γ: no cost table to measure
PROMPT = "12"  # greedy: 9 characters, then EOS
LONG_PROMPT = "}}"  # greedy: repeats "}" up to any length
CHAT_PROMPT = "User: ab\nAssistant:"  # how a template-less tokenizer gets [{"role": "user", "content": "ab"}]


def _pipe(*overrides: str):
    pipe = tiny_pipeline(*SERVER, *overrides)
    pipe.tokenizer = char_info(JSON_CHARS)
    return pipe


@contextmanager
def serving(app, polls: int = 600):
    """The base URL of ``app`` served by uvicorn on a free localhost port, stopped on exit."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(polls):
        if server.started or not thread.is_alive():
            break
        time.sleep(0.05)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def served():
    """(pipe, app, base URL) of a server on a free localhost port, stopped after the module."""
    pipe = _pipe()
    app = create_app(pipe)
    with serving(app) as url:
        yield pipe, app, url


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    """Reference pipelines: the server's greedy config, and sampling at temperature 0.9."""
    return {"greedy": _pipe(), "sampled": _pipe("sampling.temperature=0.9")}


def _stream_text(stream, kind: str) -> tuple[str, list]:
    chunks = list(stream)
    if kind == "chat":
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks


def test_completion_greedy_equals_pipeline_stream_and_not(client, reference):
    expected = reference["greedy"].generate(PROMPT, chat=False, max_new_tokens=8)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8)
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == len(expected.token_ids) == 8
    assert resp.usage.prompt_tokens == len(expected.prompt_ids)
    info = resp.model_extra["specgen"]
    assert info["guarantee"] == "greedy" and info["drafted"] > 0 and 0 <= info["accepted"] <= info["drafted"]
    text, chunks = _stream_text(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, stream=True),
                                "completion")
    assert text == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["specgen"]["guarantee"] == "greedy"


def test_chat_stream_and_not_equal_the_transcript_run(client, reference):
    expected = reference["greedy"].generate(CHAT_PROMPT, chat=False, max_new_tokens=10, stop=["\nUser:"])
    messages = [{"role": "user", "content": "ab"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10)
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True})
    text, chunks = _stream_text(stream, "chat")
    assert text == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-2].model_extra["specgen"]["finish_reason"] == expected.finish_reason


def test_json_schema_response_format_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    response_format = {"type": "json_schema", "json_schema": {"name": "tiny", "schema": SCHEMA}}
    for seed in range(4):
        resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                              max_tokens=60, temperature=1.0, seed=seed,
                                              response_format=response_format)
        assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
        jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)
        assert resp.model_extra["specgen"]["guarantee"] == "exact"


def test_seeded_sampling_is_deterministic_and_equals_the_pipeline(client, reference):
    expected = reference["sampled"].generate(PROMPT, chat=False, max_new_tokens=16, seed=7)
    first = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, seed=7, temperature=0.9)
    second = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, seed=7, temperature=0.9)
    assert first.choices[0].text == second.choices[0].text == expected.text
    assert first.model_extra["specgen"]["guarantee"] == "exact"
    assert first.model_extra["specgen"]["seed"] == 7
    nucleus = _pipe("sampling.temperature=0.9", "sampling.top_p=0.5")
    narrowed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, seed=7, temperature=0.9,
                                         top_p=0.5)
    assert narrowed.choices[0].text == nucleus.generate(PROMPT, chat=False, max_new_tokens=16, seed=7).text


def test_stop_string_ends_the_text(client, reference):
    full = reference["greedy"].generate(PROMPT, chat=False, max_new_tokens=12).text
    stop = full[5:7]
    expected = reference["greedy"].generate(PROMPT, chat=False, max_new_tokens=12, stop=[stop])
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, stop=[stop])
    assert resp.choices[0].text == expected.text and stop not in resp.choices[0].text
    assert resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("kwargs", "status", "param"), [
    ({"model": "gpt-4"}, 404, "model"),
    ({"max_tokens": -3}, 400, "max_tokens"),
    ({"seed": -1}, 400, "seed"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"stop": [""]}, 400, "stop"),
    ({"n": 2}, 400, "n"),
    ({"extra_body": {"sampling": {"temperature": 2}}}, 400, "sampling"),
    ({"extra_body": {"target": "qwen2.5-coder-0.5b"}}, 400, "target"),
    ({"extra_body": {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}}, 400, None),
    ({"extra_body": {"response_format": {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": "/etc/passwd"}}}},
     400, "response_format"),
])
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(client, kwargs, status, param):
    args = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**args)
    assert info.value.status_code == status
    error = info.value.body
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3).choices[0].finish_reason == "length"


def test_malformed_json_and_unknown_routes(served, client):
    base = served[2]
    bad = httpx.post(base + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                     headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    missing = httpx.get(base + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert httpx.get(base + "/v1/completions").status_code == 405
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["specgen"]["scheduler"] == "batched"
    assert models[0].model_extra["specgen"]["batch_size"] == 8


def test_metrics_are_prometheus_text_with_the_guarantee(served, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    resp = httpx.get(served[2] + "/metrics")
    assert resp.headers["content-type"] == CONTENT_TYPE
    lines = resp.text.splitlines()
    assert 'specgen_info{guarantee="greedy",model="tiny"} 1' in lines
    ok = [ln for ln in lines if ln.startswith('specgen_requests_total{endpoint="/v1/completions",outcome="ok"}')]
    assert ok and int(ok[0].split()[-1]) >= 1
    drafted = next(int(ln.split()[-1]) for ln in lines if ln.startswith("specgen_draft_tokens_total "))
    accepted = next(int(ln.split()[-1]) for ln in lines if ln.startswith("specgen_accepted_tokens_total "))
    assert drafted > 0 and 0 <= accepted <= drafted
    assert all(ln.startswith("#") or len(ln.rsplit(" ", 1)) == 2 for ln in lines)


def _wait_for(condition, what: str) -> None:
    for _ in range(1200):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


@contextmanager
def _released(gate: threading.Event):
    """Set ``gate`` on the way out, whatever happened (a failed assertion must not leave the scheduler held)."""
    try:
        yield
    finally:
        gate.set()


def test_a_client_that_disconnects_mid_stream_frees_its_row(served, client, reference, monkeypatch):
    """A streamed request is held (the scheduler's step waits) after its first token until the server
    has seen its client go; it is then cancelled at its last commit and its row freed, while a request
    that was running beside it and one that arrives meanwhile complete with their single-request output."""
    _, app, base = served
    metrics, worker = app.state.server.metrics, app.state.server.scheduler
    assert isinstance(worker, BatchWorker)
    greedy = reference["greedy"]
    assert len(greedy.generate(LONG_PROMPT, chat=False, max_new_tokens=200).token_ids) == 200
    core = worker.batch.batch
    gate, held, original = threading.Event(), threading.Event(), core.step

    def gated():
        """The batch's step, holding the scheduler thread once the long row has delivered its first token."""
        for row, event in original():
            yield row, event
            if row.spec.max_new == 200 and row.owner.delivered == 1 and not held.is_set():
                held.set()
                gate.wait(60)

    monkeypatch.setattr(core, "step", gated)
    before = metrics.count("/v1/completions", "cancelled")
    stopped, stopped_tokens = metrics.total("stopped_generations"), metrics.total("stopped_tokens")
    with ThreadPoolExecutor(max_workers=2) as pool, _released(gate):
        beside = pool.submit(client.completions.create, model="tiny", prompt=LONG_PROMPT, max_tokens=40)
        body = {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines)[6:])["choices"][0]["text"]
        assert held.wait(60), "the scheduler holds after the long row's first token"
        _wait_for(lambda: metrics.count("/v1/completions", "cancelled") == before + 1,
                  "the server to see the disconnect")
        meanwhile = pool.submit(client.completions.create, model="tiny", prompt=PROMPT, max_tokens=6)
        with pytest.raises(httpx.TimeoutException):  # a request that gives up while it waits in the queue
            httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=0.5)
        _wait_for(lambda: metrics.count("/v1/completions", "cancelled") == before + 2,
                  "the server to see the second one")
        gate.set()
        assert beside.result().choices[0].text == greedy.generate(LONG_PROMPT, chat=False, max_new_tokens=40).text
        assert meanwhile.result().choices[0].text == greedy.generate(PROMPT, chat=False, max_new_tokens=6).text
    _wait_for(lambda: metrics.total("stopped_generations") == stopped + 2, "the scheduler to stop and skip them")
    assert metrics.total("stopped_tokens") == stopped_tokens + 1  # the one token before the hold; the queued one: 0
    _wait_for(lambda: worker.active == 0 and worker.pending == 0, "every row to be freed")


def _load_request(client, index: int) -> tuple[str, object]:
    """One of four kinds by index: greedy completion, streamed greedy chat, JSON schema, seeded sampling."""
    kind = index % 4
    if kind == 0:
        return "greedy", client.completions.create(model="tiny", prompt=PROMPT * (1 + index % 3), max_tokens=8)
    if kind == 1:
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab"}],
                                                max_tokens=8, stream=True)
        return "chat", _stream_text(stream, "chat")[0]
    if kind == 2:
        return "schema", client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=60, temperature=1.0, seed=index,
            response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    return "sampled", client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, seed=index,
                                                temperature=0.9)


def test_64_concurrent_mixed_requests(client, reference, record_property):
    jsonschema = pytest.importorskip("jsonschema")

    def timed(index):
        start = time.perf_counter()
        result = _load_request(client, index)
        return index, result, time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=64) as pool:
        results = list(pool.map(timed, range(64)))
    assert len(results) == 64
    greedy, sampled = reference["greedy"], reference["sampled"]
    for index, (kind, result), _ in results:
        if kind == "greedy":
            prompt = PROMPT * (1 + index % 3)
            assert result.choices[0].text == greedy.generate(prompt, chat=False, max_new_tokens=8).text
        elif kind == "chat":
            assert result == greedy.generate(CHAT_PROMPT, chat=False, max_new_tokens=8, stop=["\nUser:"]).text
        elif kind == "schema":
            jsonschema.validate(json.loads(result.choices[0].message.content), SCHEMA)
        else:
            expected = sampled.generate(PROMPT, chat=False, max_new_tokens=8, seed=index).text
            assert result.choices[0].text == expected
    latencies = sorted(seconds for _, _, seconds in results)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    p50 = statistics.median(latencies)
    record_property("latency_p50_s", p50)
    record_property("latency_p99_s", p99)
    print(f"\nspecgen-serve load: 64 concurrent mixed requests, batched scheduler (batch_size 8): "
          f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")


def test_serve_config_binds_loopback_and_checks_host_and_port():
    cfg = check_server_config(to_container(compose(["target=tiny"], "serve")))
    assert (cfg.host, cfg.port, cfg.batch_size) == ("127.0.0.1", 8000, 8)
    tree = check_server_config(to_container(compose(["target=tiny", "drafter=eagle", "batch_size=4"], "serve")))
    assert tree.batch_size == 4  # a tree drafter serves one request at a time instead (make_scheduler)
    for override, message in (("port=0", "port must be at least 1"), ("port=70000", "port must be at most 65535"),
                              ("batch_size=0", "batch_size must be at least 1"),
                              ("batch_size=many", "batch_size must be an integer"),
                              ("port=abc", "port must be an integer"), ("host=''", "host must be"),
                              ("prompt=hi", "specgen-serve takes its prompts from requests")):
        with pytest.raises(ConfigError, match=message):
            check_server_config(to_container(compose(["target=tiny", override], "serve")))


def test_per_request_sampling_keeps_a_guarantee_the_stack_does_not_decide():
    plain = _pipe("speculative=false")
    variant = with_sampling(plain, Sampling(temperature=0.7))
    assert variant.guarantee == plain.guarantee == Guarantee.off("speculative=false")
    assert not variant.stack.greedy and plain.stack.greedy
    assert variant.target is plain.target and plain.stack is not variant.stack
    spec = _pipe()
    assert str(with_sampling(spec, Sampling(temperature=0.7)).guarantee) == "exact"
    assert str(with_sampling(spec, Sampling(temperature=0.0, top_p=0.9)).guarantee) == "greedy"


def test_tree_drafters_are_served_one_request_at_a_time(tiny_eagle_head):
    tree = specgen.pipeline(*TINY, "target.source.vocab_size=8", "drafter=eagle",
                            f"drafter.head_file={tiny_eagle_head}", progress=False)
    serial = make_scheduler(tree, 8)
    assert isinstance(serial, SerialWorker) and serial.info["scheduler"] == "serial"
    assert "one request at a time" in serial.info["note"] and "eagle" in serial.info["note"]
    assert isinstance(make_scheduler(tiny_pipeline(drafter="ngram"), 4), BatchWorker)
