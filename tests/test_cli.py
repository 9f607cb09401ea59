"""The specgen command: free-text prompts, --cfg job, errors, no output clutter."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY

from specgen.cli import main as cli
from specgen.config.compose import compose, prepare_overrides, quote_text_value, to_container

TINY_ARGS = [*TINY, "drafter=tiny", "max_new_tokens=8"]  # the exact torch configuration (conftest.TINY)
AWKWARD = [
    "Hello, world",
    "What's up?",
    "key: value [1, 2] {a: b}",
    'He said "hi" = ok',
    "C:\\path\\ with \\' and trailing\\",
    "cost ${x} and $HOME",
    "'single' and \"double\"",
    "",
    "'Hello' and 'bye'",
    '"Hi," she said, "bye"',
    '"To be or not to be"',
    "'",
]


@pytest.mark.parametrize("text", AWKWARD)
def test_free_text_prompt_survives_hydra(text):
    cfg = to_container(compose([*TINY_ARGS, f"prompt={text}", f"system={text}"]))
    assert cfg["prompt"] == text
    assert cfg["system"] == text


def test_quoted_values_keep_their_quotes():
    """A prompt that starts and ends with a quote is text like any other (issue 11, wrong #3)."""
    assert quote_text_value("'Hello, world'") == "'\\'Hello, world\\''"
    assert prepare_overrides(["max_new_tokens=5", "prompt=a,b"]) == ["max_new_tokens=5", "prompt='a,b'"]


def _run_main(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["specgen", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_streams_text_and_prints_summary(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run_main(monkeypatch, capsys, *TINY_ARGS, "prompt=Hi, it's me: [ok]", "sampling.temperature=0.7")
    assert code == 0
    assert "[exact vs torch (float32)]" in err and "tok/s" in err and "tau" in err and "finish:" in err
    assert "acceptance by draft position" in err
    assert list(tmp_path.iterdir()) == []  # no outputs/ or .hydra/ clutter


def test_cli_cfg_job_shows_processor_order(monkeypatch, capsys):
    code, out, _ = _run_main(monkeypatch, capsys, *TINY_ARGS, "prompt=x", "--cfg", "job")
    assert code == 0
    names = [line.split("name:")[1].strip() for line in out.splitlines() if "- name:" in line]
    assert names == ["bad_words", "min_new_tokens", "repetition_penalty", "frequency_presence_penalty",
                     "temperature", "top_k", "top_p", "min_p"]


def test_cli_errors_are_one_clear_line(monkeypatch, capsys):
    code, _, err = _run_main(monkeypatch, capsys, *TINY_ARGS, "prompt=hi", "max_new_tokens=0")
    assert code == 2
    assert err.strip() == "specgen: error: max_new_tokens must be at least 1, got 0"
    code, _, err = _run_main(monkeypatch, capsys, *TINY_ARGS, "prompt_file=/nonexistent/prompt.txt")
    assert code == 2 and "prompt_file /nonexistent/prompt.txt does not exist" in err
    code, _, err = _run_main(monkeypatch, capsys, *TINY_ARGS, "sampling.temperature=hot", "prompt=x")
    assert code != 0 and "could not be converted to Float" in err and "Traceback" not in err


def test_prompt_sources(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("from a file, with commas", encoding="utf-8")
    assert cli.read_prompt({"prompt_file": str(path)}) == "from a file, with commas"
    assert cli.read_prompt({"prompt": "-"}, stdin=io.StringIO("from stdin")) == "from stdin"
    assert cli.read_prompt({}, stdin=io.StringIO("piped")) == "piped"


def test_console_script_end_to_end(tmp_path):
    """The installed entry point, in a fresh process, reading the prompt from stdin."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        ["specgen", *TINY_ARGS, "prompt=-", "ui.color=false"],
        input="Hello, what's new?", capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "[greedy vs torch (float32)]" in result.stderr
    assert result.stdout.strip() != ""
    assert not Path(tmp_path, "outputs").exists()


def test_ctrl_c_mid_stream_exits_cleanly(monkeypatch, capsys):
    """KeyboardInterrupt inside a round: partial text kept, status 130, no traceback."""
    import specgen.engine.round as round_module

    real_round = round_module.speculative_round
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_round(*args, **kwargs)

    monkeypatch.setattr("specgen.engine.pipeline.speculative_round", interrupted)
    code, out, err = _run_main(monkeypatch, capsys, *TINY_ARGS[:-1], "max_new_tokens=50", "prompt=count")
    assert code == 130
    assert "specgen: cancelled" in err and "Traceback" not in err
