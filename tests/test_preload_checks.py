"""Settings no model could run are refused before any model loads: one line, status 2 (cli, checks)."""

from __future__ import annotations

import io
import sys

import pytest

import specgen.engine.assemble
from specgen.cli import main as cli

from test_bad_input import assert_one_error_line, run_command

TINY_ARGS = ["target=tiny", "drafter=tiny", "threads=1", "dtype=float32", "max_new_tokens=4"]


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if a model is loaded."""
    loads = []
    monkeypatch.setattr(specgen.engine.assemble, "build_pipeline", lambda *a, **k: loads.append(1) or pytest.fail("loaded"))
    return loads


@pytest.mark.parametrize("extra, fragment", [
    (["grammar=json_schema"], "grammar=json_schema needs grammar.schema"),
    (["grammar=regex"], "grammar=regex needs grammar.pattern"),
    (["drafter.num_tokens=0"], "drafter.num_tokens must be a positive integer up to 64 or auto, got 0"),
    (["drafter.num_tokens=1000"], "drafter.num_tokens must be a positive integer up to 64 or auto, got 1000"),
    (["batch_size=8"], "batch_size=8 runs the rows of a JSONL prompt_file together; add output=PATH.jsonl"),
    (["prompt_file={tmp}/rows.jsonl"], "rows.jsonl is a JSONL file: add output=PATH.jsonl for one result per row"),
])
def test_refused_before_the_model_loads(monkeypatch, capsys, tmp_path, no_loading, extra, fragment):
    (tmp_path / "rows.jsonl").write_text('"a"\n"b"\n')
    args = [arg.format(tmp=tmp_path) for arg in extra]
    prompt = [] if any(arg.startswith("prompt_file=") for arg in args) else ["prompt=hi"]
    code, out, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, *prompt, *args)
    assert_one_error_line(code, err, "specgen", fragment)
    assert out == "" and not no_loading


@pytest.mark.parametrize("data", [b"", b"  \n\t\n"])
def test_empty_stdin_is_refused_before_the_model_loads(monkeypatch, capsys, no_loading, data):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS)
    assert_one_error_line(code, err, "specgen", "stdin is empty")
    assert not no_loading


def test_peeked_stdin_gives_every_byte(monkeypatch, capsys):
    """Negative control for the peek: a stdin with text still reaches the model whole (leading blank
    lines, a piece boundary in the middle)."""
    text = "\n\n  " + "word " * 30_000
    stdin = cli.peek_stdin(io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8"), piece=7)
    assert cli._read_text(stdin, "stdin") == text
    ok = [*TINY_ARGS, "prompt=hi", "batch_size=1", "drafter.num_tokens=3"]
    code, out, _ = run_command(monkeypatch, capsys, cli.main, "specgen", *ok)
    assert code == 0 and out.strip()


def test_a_jsonl_file_without_rows_is_refused_before_the_model_loads(monkeypatch, capsys, tmp_path, no_loading):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b"\xef\xbb\xbf\n  \n")
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, f"prompt_file={rows}",
                               f"output={tmp_path / 'out.jsonl'}")
    assert_one_error_line(code, err, "specgen", f"prompt_file {rows} has no rows; give one JSON prompt per line")
    assert not no_loading and not (tmp_path / "out.jsonl").exists()
