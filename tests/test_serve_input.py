"""specgen-serve and careless clients (issue 30): bodies too big or cut short, unknown chat roles, empty
or oversized prompts, flags where overrides belong, IPv6 hosts in printed URLs."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest
from conftest import tiny_pipeline

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from specgen.config.compose import compose, to_container  # noqa: E402
from specgen.errors import ConfigError  # noqa: E402
from specgen.serve import create_app  # noqa: E402
from specgen.serve.app import MAX_REQUEST_BYTES  # noqa: E402
from specgen.serve.cli import base_url, check_server_config  # noqa: E402

LIMIT = 4096


@pytest.fixture(scope="module")
def app():
    return create_app(tiny_pipeline("drafter.num_tokens=3", "max_new_tokens=3"), max_request_bytes=LIMIT)


def call(app, chunks: list[bytes], *, length: int | None = None, path: str = "/v1/completions"):
    """Drive the ASGI app with a body sent as ``chunks`` (then a disconnect if the client ``length`` promised
    more); -> (status, JSON body or None, how many chunks the app read)."""
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "headers": headers,
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000), "root_path": ""}
    sent, read = [], [0]

    async def receive():
        if read[0] < len(chunks):
            read[0] += 1
            more = read[0] < len(chunks) or (length is not None and length > sum(map(len, chunks)))
            return {"type": "http.request", "body": chunks[read[0] - 1], "more_body": more}
        await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body) if body else None, read[0]


def test_a_client_gone_while_sending_its_body_is_one_log_line(app, caplog):
    with caplog.at_level(logging.WARNING):
        status, _, _ = call(app, [b'{"model": "ti'], length=1000)
    assert status == 499
    assert [r.getMessage() for r in caplog.records] == ["/v1/completions: the client went away while sending "
                                                        "its request body"]
    assert caplog.records[0].exc_info is None


def test_a_body_over_the_limit_is_413_before_it_is_read(app):
    status, body, read = call(app, [b"x" * 1024] * 8, length=100 * 2**20)
    assert (status, read, body["error"]["code"]) == (413, 0, "request_too_large")
    assert body["error"]["message"] == (f"the request body is {100 * 2**20:,} bytes, over this server's limit of "
                                        f"{LIMIT:,} bytes (max_request_bytes)")


def test_a_chunked_body_over_the_limit_is_413_once_the_limit_is_passed(app):
    status, body, read = call(app, [b"x" * 1024] * 100)
    assert status == 413 and read == 5 and "more than 4,096 bytes" in body["error"]["message"]


def test_a_body_nested_too_deeply_is_400_not_500(app):
    status, body, _ = call(app, [b"[" * 2000 + b"]" * 2000])  # under the body limit, past the parser's depth
    assert status == 400 and body["error"]["message"] == "the request body nests JSON arrays or objects too deeply " \
                                                          "to parse"


@pytest.mark.parametrize(("payload", "path", "message"), [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "/v1/chat/completions",
     "messages[0] has the role 'wizard'; a role is one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": ""}]}, "/v1/chat/completions", "messages has no user message with text"),
    ({"prompt": "  \n"}, "/v1/completions", "prompt holds only whitespace"),
    ({"prompt": "a" * 3000}, "/v1/completions", "the prompt has 3,000 characters, so at least 3,000 tokens"),  # under the body limit: refused untokenised
    # a lone surrogate has no UTF-8 form: a real tokenizer raised TypeError, answered with a 500
    ({"prompt": "hi \ud800"}, "/v1/completions", "prompt is not valid Unicode text: a lone surrogate U+D800 at "
                                                  "character 3"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\udcff"}]},
     "/v1/chat/completions", "messages[1].content is not valid Unicode text: a lone surrogate U+DCFF"),
    # logits / 1e-40 overflow float32: the NaN distribution was a 500 after the request was queued
    ({"prompt": "hi", "temperature": 1e-40}, "/v1/completions", "temperature must be 0 (greedy) or at least 1e-06"),
    # every token's text is checked against each stop string: a request cannot ask for unbounded work per token
    ({"prompt": "hi", "stop": [str(i) for i in range(200)]}, "/v1/completions", "stop takes at most 128 strings"),
    ({"prompt": "hi", "stop": "ab" * 600}, "/v1/completions", "stop strings take at most 1024 characters"),
])
def test_unknown_roles_and_empty_prompts_are_400(app, payload, path, message):
    status, body, _ = call(app, [json.dumps({"model": "tiny", "max_tokens": 2, **payload}).encode()], path=path)
    assert status == 400 and body["error"]["message"].startswith(message), body


def test_a_schema_nested_too_deeply_is_400_not_500():
    """500 levels of {"type": "array", "items": ...} (20 KB) fit the body limit but ran the schema walk out of
    Python's stack: a 500."""
    schema = '{"type": "array", "items": ' * 500 + '{"type": "string"}' + "}" * 500
    body = ('{"model": "tiny", "prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", '
            '"json_schema": {"schema": ' + schema + "}}}")
    status, reply, _ = call(create_app(tiny_pipeline("drafter.num_tokens=3")), [body.encode()])
    assert status == 400, reply
    assert reply["error"]["message"] == "grammar.schema nests objects and arrays more than 100 levels deep; flatten it"


def test_a_prompt_too_big_for_the_context_is_400_before_tokenising(monkeypatch):
    from specgen.models.tokenizer import TokenizerInfo

    monkeypatch.setattr(TokenizerInfo, "encode_prompt", lambda *a, **k: pytest.fail("tokenised"))
    app = create_app(tiny_pipeline("drafter.num_tokens=3"))
    prompt = "a" * (256 * 512 + 1)
    status, body, _ = call(app, [json.dumps({"model": "tiny", "prompt": prompt}).encode()])
    assert status == 400 and body["error"]["param"] == "prompt"
    assert body["error"]["message"].startswith("prompt is 131,073 characters; a prompt for this model's 512-token")


@pytest.mark.parametrize("known", [True, False])
def test_prompts_too_long_for_the_context_never_reach_the_scheduler(known, monkeypatch):
    """64 prompts under the size bound but with more characters than the context has tokens (the tiny
    tokenizer's tokens are one character each) are refused on the event loop, untokenised; a small
    request after them is the scheduler's only job and its only tokenisation. Control (the tokenizer's
    longest token not known): each refusal is made on the scheduler thread after tokenising the prompt,
    64 tokenisations ahead of the small request's."""
    from specgen.models.tokenizer import TokenizerInfo

    if not known:
        monkeypatch.setattr(TokenizerInfo, "longest_token_chars", None)
    encoded: list[int] = []
    real_encode = TokenizerInfo.encode_prompt
    monkeypatch.setattr(TokenizerInfo, "encode_prompt",
                        lambda self, prompt, **k: encoded.append(len(prompt)) or real_encode(self, prompt, **k))
    app = create_app(tiny_pipeline("drafter.num_tokens=3", "max_new_tokens=2"))
    scheduler = app.state.server.scheduler
    jobs: list[object] = []
    real_submit = scheduler.submit
    monkeypatch.setattr(scheduler, "submit", lambda job: jobs.append(job) or real_submit(job))
    try:
        for i in range(64):
            status, body, _ = call(app, [json.dumps({"model": "tiny", "prompt": "ab " * 700 + str(i)}).encode()])
            assert status == 400, body
            assert ("so at least 2,10" in body["error"]["message"]) is known, body
        status, body, _ = call(app, [json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()])
    finally:
        scheduler.close()
    assert status == 200, body
    assert (len(jobs), encoded[-1]) == ((1, 5) if known else (65, 5))
    assert len(encoded) == (1 if known else 65)


def test_a_real_client_sees_the_413(app):
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=b"x" * (2 * 2**20), timeout=60)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_serve_config_has_a_body_limit_and_ipv6_urls_are_bracketed():
    cfg = check_server_config(to_container(compose(["target=tiny"], "serve")))
    assert cfg.max_request_bytes == MAX_REQUEST_BYTES == 4 * 2**20
    with pytest.raises(ConfigError, match="max_request_bytes must be at least 1024"):
        check_server_config(to_container(compose(["target=tiny", "max_request_bytes=10"], "serve")))
    assert base_url("::", 8000) == "http://[::]:8000/v1"
    assert base_url("::1", 80) == "http://[::1]:80/v1"
    assert base_url("127.0.0.1", 8000) == "http://127.0.0.1:8000/v1"


@pytest.mark.parametrize(("args", "hint"), [
    (["--host", "0.0.0.0", "target=tiny"], "write host=0.0.0.0"),
    (["--host=::1", "target=tiny"], "write host=::1"),
    (["--port", "--host"], "write port=..."),
    (["--max-new-tokens", "5"], "write max_new_tokens=5"),
])
def test_flags_get_the_override_to_write(args, hint):
    from specgen.config.compose import check_command_line

    with pytest.raises(ConfigError, match="unrecognized arguments") as info:
        check_command_line(args, "serve")
    assert hint in str(info.value) and "--cfg job" not in str(info.value)


def test_a_message_name_reaches_the_template_and_the_transcript():
    """OpenAI's ``messages[i].name`` is not dropped: the template gets it (as vLLM passes it), a transcript
    writes it after the role; a name that is not a one-line string is a 400 naming it."""
    from specgen.serve.protocol import APIError
    from specgen.serve.protocol import parse_chat as parse_chat_body

    body = {"model": "m", "messages": [{"role": "user", "content": "hi", "name": "ann"},
                                       {"role": "user", "content": "yo"}]}
    templated = parse_chat_body(body, "m", use_template=True).prompt
    assert templated == [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo"}]
    transcript = parse_chat_body(body, "m", use_template=False).prompt
    assert transcript == "User (ann): hi\nUser: yo\nAssistant:"
    for bad in (3, "", "a\nb"):
        with pytest.raises(APIError, match=r"messages\[0\]\.name must be a non-empty one-line string") as caught:
            parse_chat_body({"model": "m", "messages": [{"role": "user", "content": "hi", "name": bad}]}, "m",
                            use_template=True)
        assert caught.value.status == 400


def test_a_template_that_reads_the_name_renders_it():
    """The messages the server passes go to the tokenizer's chat template as they are, ``name`` included."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from specgen.models.tokenizer import TokenizerInfo

    words = ["[UNK]", "user", "assistant", "ann", "hi", ":", "|"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    hf.chat_template = ("{% for m in messages %}{{ m.role }} {% if m.name %}{{ m.name }} {% endif %}: "
                        "{{ m.content }} | {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
    info = TokenizerInfo(hf)
    ids = info.encode_prompt([{"role": "user", "content": "hi", "name": "ann"}], chat=True)
    assert hf.convert_ids_to_tokens(ids) == ["user", "ann", ":", "hi", "|", "assistant", ":"]


def test_the_longest_token_is_known_only_where_no_character_can_be_dropped():
    """A byte-level tokenizer's longest token bounds a text's tokens from below; a normalizer, a
    whitespace pre-tokenizer or a split that removes its pattern may drop characters: unknown."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from specgen.models.tokenizer import TokenizerInfo

    pre, norm = tokenizers.pre_tokenizers, tokenizers.normalizers

    def longest(pre_tokenizer, normalizer=None):
        tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "bb": 1, "ccc": 2, "?": 3}, unk_token="?"))
        tok.pre_tokenizer = pre_tokenizer
        if normalizer is not None:
            tok.normalizer = normalizer
        return TokenizerInfo(PreTrainedTokenizerFast(tokenizer_object=tok)).longest_token_chars

    assert longest(pre.ByteLevel(add_prefix_space=False)) == 3
    assert longest(pre.Sequence([pre.Digits(), pre.ByteLevel()])) == 3
    assert longest(pre.Whitespace()) is None
    assert longest(pre.Split(" ", behavior="removed")) is None
    assert longest(pre.ByteLevel(), norm.Lowercase()) is None
