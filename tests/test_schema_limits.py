"""No JSON schema crashes the process (issue 46): a schema's numbers and sizes are checked before any backend
compiles it (specgen.grammar.schema_limits), and every edge schema of tests/schema_corpus.py compiles and
constrains, or is refused with one line, through the API, the CLI, a JSONL run and the server.

An integer bound or const at -2^63 segfaulted llguidance, so the corpus runs in a child process
(schema_corpus_child.py): a crash there fails these tests instead of killing pytest.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from schema_corpus import ACCEPTED, REFUSED, bound_sweep

from specgen.errors import ConfigError
from specgen.grammar import parse_spec
from specgen.grammar.schema_limits import check_limits

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("starlette")
CHILD = pathlib.Path(__file__).with_name("schema_corpus_child.py")


@pytest.mark.parametrize("name", REFUSED)
def test_each_refused_schema_is_one_named_line_before_any_backend(name):
    schema, message = REFUSED[name]
    with pytest.raises(ConfigError) as caught:
        parse_spec({"kind": "json_schema", "schema": schema})
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


@pytest.mark.parametrize("name", ACCEPTED)
def test_each_accepted_schema_passes_the_limits_and_its_documents_agree_with_jsonschema(name):
    """Negative control: the limits let the accepted edge schemas through, and the documents the corpus
    expects each to accept or refuse are what jsonschema says."""
    schema, good, bad = ACCEPTED[name]
    check_limits(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert all(validator.is_valid(json.loads(doc)) for doc in good)
    assert not any(validator.is_valid(json.loads(doc)) for doc in bad if _is_json(doc))


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory) -> dict[str, list[dict]]:
    """The child's reports by route ("sweep", "api", "cli", "jsonl", "server"); fails when the child crashed."""
    workdir = tmp_path_factory.mktemp("corpus")
    child = subprocess.run([sys.executable, str(CHILD), str(workdir)], capture_output=True, text=True, timeout=900)
    lines = child.stdout.splitlines()
    if child.returncode != 0:
        pytest.fail(f"the corpus child exited with {child.returncode} after {len(lines)} reports (a native crash "
                    f"is -11); last report: {lines[-1][:300] if lines else None}; stderr: {child.stderr[-1500:]}")
    reports: dict[str, list[dict]] = {}
    for line in lines:
        row = json.loads(line)
        reports.setdefault(row["via"], []).append(row)
    return reports


def test_bounds_at_and_near_the_limits_compile_and_constrain_exactly(corpus_run):
    """Integer and number ranges from every pair of bounds in ±2^53 (inclusive and exclusive): each accepts
    its end points (or the values just inside) and refuses the values just outside."""
    (sweep,) = corpus_run["sweep"]
    assert sweep["cases"] == len(bound_sweep()) > 250 and sweep["wrong"] == []


def test_the_api_refuses_each_refused_schema_by_name(corpus_run):
    refusals = {row["name"]: row.get("refusal") for row in corpus_run["api"]}
    for name, (_, message) in REFUSED.items():
        assert refusals[name] is not None and refusals[name].startswith(message), (name, refusals[name])


def test_the_api_compiles_and_constrains_each_accepted_schema(corpus_run):
    """Each accepted edge schema accepts its valid documents and refuses the invalid ones, and every
    output finished by EOS validates (a backend that clamped a bound would fail here)."""
    rows = {row["name"]: row for row in corpus_run["api"]}
    finished = 0
    for name, (schema, good, bad) in ACCEPTED.items():
        assert rows[name]["accepts"] == {doc: doc in good for doc in good + bad}, name
        for text, finish in rows[name]["outputs"]:
            if finish == "eos":
                finished += 1
                jsonschema.validate(json.loads(text), schema)
    assert finished >= 3 * (len(ACCEPTED) - 2)  # all but minItems 100000 and 90 nested arrays end in 40 tokens


def test_a_regex_too_large_is_refused_as_too_large_while_compiling(corpus_run):
    """a{60000} read "llguidance failed on a prefix it allowed: lexer error: ..."; auto compiles it with
    outlines_core instead."""
    refusals = {row["name"]: row.get("refusal") for row in corpus_run["api"]}
    assert refusals["regex a{60000} (llguidance)"] == (
        "regex a{60000} is too large for grammar.backend=llguidance: a regex in it expands past the lexer's limit "
        "(lexer error: too many expressions constructed); use smaller counts ({n})")
    assert refusals["regex a{60000} (auto)"] is None


def test_the_cli_exits_2_with_one_line_for_each_refused_schema(corpus_run):
    rows = {row["name"]: row for row in corpus_run["cli"]}
    for name, (_, message) in REFUSED.items():
        assert rows[name]["code"] == 2 and rows[name]["stderr"].startswith(f"specgen: error: {message}"), rows[name]
        assert rows[name]["stderr"].count("\n") == 1, rows[name]


def test_a_jsonl_run_gives_each_refused_row_its_error_record_and_runs_the_others(corpus_run):
    (run,) = corpus_run["jsonl"]
    records = run["records"]
    assert run["code"] == 1 and len(records) == len(REFUSED) + 2
    assert records[0]["text"] is not None and records[-1]["text"] is not None
    for line, (record, (name, (_, message))) in enumerate(zip(records[1:-1], REFUSED.items()), start=2):
        assert record["text"] is None and record["error"].startswith(f"line {line}: "), record
        if name != "1000 nested arrays":  # the row itself nests too deeply for the JSONL reader
            assert record["error"].startswith(f"line {line}: {message}"), (name, record["error"])


def test_the_server_answers_400_to_each_refused_schema_and_still_serves(corpus_run):
    rows = {row["name"]: row for row in corpus_run["server"]}
    assert set(rows) == set(REFUSED)
    for name, (_, message) in REFUSED.items():
        assert rows[name]["status"] == 400 and rows[name]["then"] == 200, rows[name]
        if name != "1000 nested arrays":  # the body itself nests too deeply for the request parser
            assert rows[name]["message"].startswith(message), rows[name]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
