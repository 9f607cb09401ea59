"""Run the edge-schema corpus (schema_corpus.py) through the API, the CLI, a JSONL run and the server in THIS process,
printing one JSON line per check. tests/test_schema_limits.py runs it in a child process, so a schema that
crashes the native grammar library fails the test instead of killing pytest.

Usage: python tests/schema_corpus_child.py WORKDIR
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from conftest import TINY, fix_costs, tiny_pipeline  # noqa: E402
from grammar_helpers import char_info  # noqa: E402
from schema_corpus import ACCEPTED, CHARS, REFUSED, bound_sweep  # noqa: E402

import specgen  # noqa: E402
from specgen.cli import main as cli  # noqa: E402
from specgen.config.compose import compose, exits_on_error, to_container  # noqa: E402
from specgen.errors import SpecgenError  # noqa: E402
from specgen.grammar import grammar_processor  # noqa: E402

HUGE_REGEX = "a{60000}"


def report(**row) -> None:
    print(json.dumps(row), flush=True)


def dumps(value) -> str:
    """JSON text of ``value``, which may nest deeper than Python's recursion limit allows json.dumps."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        return json.dumps(value)
    finally:
        sys.setrecursionlimit(limit)


def refusal(call) -> str | None:
    """The message of the SpecgenError ``call()`` raises; None when it runs."""
    try:
        call()
    except SpecgenError as exc:
        return str(exc)
    return None


def accepts(automaton, info, text: str) -> bool:
    state = automaton.state_after(info.tokenizer.encode(text))
    return state is not None and automaton.is_accepting(state)


def sweep() -> None:
    """Every bound pair of schema_corpus.bound_sweep compiled with llguidance: the cases whose verdicts differ."""
    info = char_info(CHARS)
    wrong = []
    for schema, good, bad in bound_sweep():
        spec = {"kind": "json_schema", "schema": schema, "backend": "llguidance"}
        automaton = grammar_processor(spec, info).automaton
        verdicts = {text: accepts(automaton, info, text) for text in good + bad}
        if verdicts != {text: text in good for text in good + bad}:
            wrong.append([schema, verdicts])
    report(via="sweep", cases=len(bound_sweep()), wrong=wrong)


def api() -> None:
    vocab = len(CHARS) + 1
    pipe = specgen.pipeline(*TINY, f"target.source.vocab_size={vocab}", "drafter=tiny",
                            f"drafter.source.vocab_size={vocab}", "drafter.num_tokens=3", "sampling.temperature=1.0",
                            progress=False)
    pipe.tokenizer = info = char_info(CHARS)
    for name, (schema, _) in REFUSED.items():
        report(via="api", name=name, refusal=refusal(lambda: pipe.generate(prompt_ids=[1, 2], max_new_tokens=4,
                                                                           schema=schema)))
    for name, (schema, good, bad) in ACCEPTED.items():
        automaton = grammar_processor({"kind": "json_schema", "schema": schema}, info).automaton
        verdicts = {doc: accepts(automaton, info, doc) for doc in good + bad}
        outputs = [pipe.generate(prompt_ids=[1, 2], max_new_tokens=40, schema=schema, seed=seed) for seed in range(3)]
        report(via="api", name=name, accepts=verdicts, outputs=[[g.text, g.finish_reason] for g in outputs])
    for backend in ("llguidance", "auto"):
        spec = {"kind": "regex", "pattern": HUGE_REGEX, "backend": backend}
        message = refusal(lambda: grammar_processor(spec, info))
        report(via="api", name=f"regex {HUGE_REGEX} ({backend})", refusal=message)


def run_cli(cfg: dict) -> tuple[int, str]:
    """(exit status, stderr) of ``specgen`` run in this process on the composed ``cfg``, as its console
    entry point runs it (a specgen error: one line and status 2)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), exits_on_error("specgen"):
            cli.run(cfg, out=io.StringIO(), err=err)
        return 0, err.getvalue()
    except SystemExit as exc:
        return exc.code, err.getvalue()


def command_line() -> None:
    for name, (schema, _) in REFUSED.items():
        cfg = to_container(compose([*TINY, "drafter=tiny", "max_new_tokens=4", "prompt=hi", "grammar=json_schema"]))
        cfg["grammar"]["schema"] = schema
        code, err = run_cli(cfg)
        report(via="cli", name=name, code=code, stderr=err)


def jsonl(workdir: pathlib.Path) -> None:
    rows = ["first", *({"prompt": "x", "id": name, "schema": schema} for name, (schema, _) in REFUSED.items()), "last"]
    source, output = workdir / "rows.jsonl", workdir / "out.jsonl"
    source.write_text("".join(dumps(row) + "\n" for row in rows), encoding="utf-8")
    cfg = to_container(compose([*TINY, "drafter=tiny", "max_new_tokens=4", f"prompt_file={source}",
                                f"output={output}"]))
    code, _ = run_cli(cfg)
    records = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
    report(via="jsonl", code=code, records=[{k: r.get(k) for k in ("id", "text", "error")} for r in records])


def server() -> None:
    from starlette.testclient import TestClient

    from specgen.serve import create_app

    with TestClient(create_app(tiny_pipeline("drafter.num_tokens=3", "max_new_tokens=3"))) as client:
        for name, (schema, _) in REFUSED.items():
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
            reply = client.post("/v1/completions", content=dumps(body), headers={"content-type": "application/json"})
            normal = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            report(via="server", name=name, status=reply.status_code, message=reply.json()["error"]["message"],
                   then=normal.status_code)


if __name__ == "__main__":
    fix_costs(pytest.MonkeyPatch())
    sweep()
    api()
    command_line()
    jsonl(pathlib.Path(sys.argv[1]))
    server()
