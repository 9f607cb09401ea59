"""Empty and oversized prompts (issue 30): refused on one line before any chat template or tokenizer
sees them, the same way from the API, the CLI, stdin, prompt files and JSONL rows."""

from __future__ import annotations

import io
import json
import re
import sys
import time
import tracemalloc

import pytest

from specgen.cli import main as cli
from specgen.errors import PromptError
from specgen.models.tokenizer import TokenizerInfo
from specgen.config.options import PROMPT_BYTES_PER_TOKEN, check_prompt, check_prompt_size, prompt_size_bound

from conftest import TINY, tiny_pipeline
from test_bad_input import assert_one_error_line, run_command

TINY_ARGS = [*TINY, "drafter=tiny", "max_new_tokens=3"]
CONTEXT = 512  # conf/target/tiny.yaml
BOUND = PROMPT_BYTES_PER_TOKEN * CONTEXT


@pytest.fixture
def no_tokenising(monkeypatch):
    """Any prompt reaching the tokenizer fails the test (an ``allowed`` set lets chosen prompts through)."""
    real, allowed = TokenizerInfo.encode_prompt, set()

    def encode_prompt(self, prompt, **kwargs):
        if not (isinstance(prompt, str) and prompt in allowed):
            pytest.fail(f"the tokenizer was called with a {len(str(prompt)):,}-character prompt")
        return real(self, prompt, **kwargs)

    monkeypatch.setattr(TokenizerInfo, "encode_prompt", encode_prompt)
    return allowed


@pytest.mark.parametrize(("prompt", "message"), [
    ("", "prompt is empty"),
    (" \n\t", "prompt holds only whitespace"),
    ([{"role": "user", "content": ""}], "prompt has no user message with text"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": "  "}], "no user message with text"),
    ([{"role": "assistant", "content": "hello"}], "no user message with text"),
    ([{"role": "wizard", "content": "hi"}],
     "prompt[0] has the role 'wizard'; a role is one of system, user, assistant"),
])
def test_empty_prompts_and_unknown_roles_are_refused(prompt, message):
    with pytest.raises(PromptError, match=re.escape(message)):
        check_prompt(prompt)


def test_the_api_refuses_empty_prompts_before_the_template(no_tokenising):
    pipe = tiny_pipeline("max_new_tokens=3")
    for call in (lambda: pipe.generate(""), lambda: pipe.generate("   ", chat=True),
                 lambda: pipe.generate([{"role": "user", "content": ""}])):
        with pytest.raises(PromptError, match="empty|whitespace|no user message"):
            call()
    with pytest.raises(PromptError, match="generate_batch\\(\\) prompt 0: prompt is empty"):
        pipe.generate_batch(["", "hi"])
    no_tokenising.add("hi")
    assert pipe.generate("hi").finish_reason in ("eos", "length")


def test_cli_empty_prompt_is_refused_before_loading(monkeypatch, capsys):
    import specgen.engine.assemble

    monkeypatch.setattr(specgen.engine.assemble, "build_pipeline", lambda cfg: pytest.fail("the model was loaded"))
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, "prompt=")
    assert_one_error_line(code, err, "specgen", "prompt is empty; give some text to generate from")


def test_cli_empty_stdin_is_one_line(monkeypatch, capsys, no_tokenising):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8"))
    code, out, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS)
    assert_one_error_line(code, err, "specgen", "stdin is empty")
    assert out == ""


@pytest.mark.parametrize("source", ["prompt=-", "prompt_file=-"])
def test_cli_reading_a_closed_stdin_is_one_line_before_loading(monkeypatch, capsys, source):
    """Started with stdin closed (``<&-``), Python has no sys.stdin: prompt=- raised AttributeError after loading."""
    import specgen.engine.assemble

    monkeypatch.setattr(specgen.engine.assemble, "build_pipeline", lambda cfg: pytest.fail("the model was loaded"))
    monkeypatch.setattr(sys, "stdin", None)
    code, out, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, source)
    assert_one_error_line(code, err, "specgen", f"{source} reads stdin, but stdin is closed")


def test_a_huge_prompt_file_is_refused_by_its_size(monkeypatch, capsys, tmp_path, no_tokenising):
    """A sparse 400 MB file: refused from its size alone (nothing read or tokenised), in little memory."""
    big = tmp_path / "big.txt"
    with open(big, "wb") as file:
        file.truncate(400 * 2**20)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, f"prompt_file={big}")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_one_error_line(code, err, "specgen", f"prompt_file {big} is 419,430,400 bytes; a prompt for any "
                                                "model's context (at most 1,048,576 tokens) has at most 268,435,456 bytes")
    assert time.perf_counter() - start < 30 and peak < 100 * 2**20
    with open(big, "r+b") as file:  # under any context's bound, over this model's: refused once it has loaded
        file.truncate(2**20)
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, f"prompt_file={big}")
    assert_one_error_line(code, err, "specgen", f"prompt_file {big} is 1,048,576 bytes; a prompt for this "
                                                f"model's 512-token context has at most {BOUND:,} bytes")


def test_huge_stdin_and_prompt_strings_are_refused_unread(monkeypatch, capsys, no_tokenising):
    stdin = io.BytesIO(b"a" * (4 * BOUND))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(stdin, encoding="utf-8"))
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS)
    assert_one_error_line(code, err, "specgen", f"stdin is {BOUND + 1:,} bytes or more")
    assert stdin.tell() <= BOUND + 1 + 2**16  # read up to the bound (and a buffer), not to the end
    with pytest.raises(PromptError, match=f"prompt is {BOUND + 1:,} characters"):
        check_prompt_size("é" * (BOUND + 1), CONTEXT)
    check_prompt_size("a" * BOUND, CONTEXT)
    with pytest.raises(PromptError, match="characters"):
        check_prompt_size([{"role": "user", "content": "a" * BOUND}, {"role": "user", "content": "b"}], CONTEXT)
    assert prompt_size_bound(CONTEXT) == BOUND


def test_jsonl_rows_too_big_for_the_context_are_error_rows(tmp_path, no_tokenising):
    """A 9 MB line is skipped unread and a 200 000-character prompt is refused by its length; the
    rows around them run."""
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w", encoding="utf-8") as file:
        file.write('"first"\n')
        huge = json.dumps({"prompt": "x" * (9 * 2**20), "id": "huge line"}) + "\n"
        file.write(huge)
        file.write(json.dumps({"prompt": "y" * 200_000, "id": "long prompt"}) + "\n")
        file.write('"last"\n')
    no_tokenising.update({"first", "last"})
    out = tmp_path / "out.jsonl"
    code, err = _run_jsonl(rows, out)
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert code == 1 and "4 rows: 2 ok, 2 errors" in err
    assert [r["index"] for r in records] == [0, 1, 2, 3] and "text" in records[0] and "text" in records[3]
    assert records[1]["error"].startswith(f"line 2: the row is {len(huge):,} bytes; a row for this model's "
                                          f"512-token context has at most {8 * BOUND:,}")
    assert records[2]["error"].startswith("line 3: prompt is 200,000 characters")
    assert records[2]["id"] == "long prompt"


def _run_jsonl(rows, out, *extra):
    from specgen.config.compose import compose, to_container

    cfg = to_container(compose([*TINY_ARGS, f"prompt_file={rows}", f"output={out}", *extra]))
    err = io.StringIO()
    try:
        cli.run(cfg, out=io.StringIO(), err=err)
        return 0, err.getvalue()
    except SystemExit as exc:
        return exc.code, err.getvalue()


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs Linux /proc")
def test_a_file_that_reports_no_size_is_still_read():
    """/proc files have st_size 0: read (to the bound at most), not taken for empty."""
    assert "Name:" in cli.read_prompt({"prompt_file": "/proc/self/status"}, context_length=CONTEXT)


def test_the_api_refuses_a_prompt_too_big_for_the_context_before_tokenising(monkeypatch):
    from conftest import tiny_pipeline

    from specgen.errors import PromptError

    pipe = tiny_pipeline()
    huge = "a" * (300 * pipe.target.context_length)
    encode = pipe.tokenizer.encode_prompt

    def guarded(prompt, **kwargs):
        assert prompt != huge, "tokenised a refused prompt"
        return encode(prompt, **kwargs)

    monkeypatch.setattr(pipe.tokenizer, "encode_prompt", guarded)
    with pytest.raises(PromptError):
        pipe.generate(huge)
    with pytest.raises(PromptError, match="prompt 1"):
        pipe.generate_batch(["ok", huge])
