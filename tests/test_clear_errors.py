"""Errors that named the wrong cause (issue 46): each is now one line naming the real one, and a check
that needs no model refuses before anything is loaded."""

from __future__ import annotations

import struct

import pytest
from test_bad_input import TINY_ARGS, assert_one_error_line, run_command

from specgen.cli import main as cli
from specgen.config.checks import check_run_config, source_from_text
from specgen.config.compose import compose, prepare_overrides, to_container
from specgen.errors import ConfigError
from specgen.serve import protocol


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test (not with a SpecgenError, so it is never reported as one line) if a tokenizer,
    llama.cpp or a model is loaded."""
    def loaded(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", loaded)
    monkeypatch.setattr("specgen.models.llama_context.library", loaded)
    monkeypatch.setattr("specgen.models.loading.load_tokenizer", loaded)


def _gguf(path, tensors: int, entries: int, size: int = 64):
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, entries) + bytes(size - 24))
    return path


@pytest.mark.parametrize("make, fragment", [
    (lambda tmp: tmp, "is a directory; give the path of a .gguf file"),
    (lambda tmp: "/dev/zero", "GGUF file /dev/zero is not a regular file"),
    (lambda tmp: _gguf(tmp / "counts.gguf", 2**60, 33),
     "counts.gguf is a corrupt GGUF file: its header counts 1152921504606846976 tensors and 33 metadata entries, "
     "more than its 64 bytes can hold"),
    (lambda tmp: tmp / "absent.gguf", "absent.gguf does not exist"),
])
def test_a_gguf_path_that_is_not_a_gguf_file_says_what_it_is(tmp_path, monkeypatch, capsys, nothing_loads, make,
                                                               fragment):
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", "target=gguf",
                               f"target.source.path={make(tmp_path)}", "prompt=hi", "threads=1")
    assert_one_error_line(code, err, "specgen", fragment)


def test_a_plausible_gguf_header_passes_the_count_check(tmp_path):
    """The negative control: counts a file of its size can hold are not called corrupt."""
    from specgen.models.gguf_cache import check_gguf_file

    check_gguf_file(_gguf(tmp_path / "small.gguf", 1, 2))


def test_a_home_relative_path_reaches_the_loader_expanded(tmp_path, monkeypatch, capsys, nothing_loads):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert prepare_overrides(["target.source.path=~/m.gguf"]) == ["target.source.path='~/m.gguf'"]
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", "target=gguf",
                               "target.source.path=~/m.gguf", "prompt=hi", "threads=1")
    assert_one_error_line(code, err, "specgen", f"GGUF file {tmp_path}/m.gguf does not exist")


def test_a_bare_drafter_source_names_a_gguf_a_directory_or_a_hub_id(tmp_path):
    cfg = check_run_config(to_container(compose([*TINY_ARGS, "drafter=small_model",
                                                 f"drafter.source={tmp_path}/d.gguf"])))
    assert cfg["drafter"]["source"] == {"kind": "gguf", "path": f"{tmp_path}/d.gguf"}
    assert source_from_text(str(tmp_path), "drafter.source") == {"kind": "dir", "path": str(tmp_path)}
    assert source_from_text("org/model", "drafter.source")["repo"] == "org/model"
    with pytest.raises(ConfigError, match=r"^drafter\.source='nothing here' is not a \.gguf file, a directory or a "
                                          r"hub id"):
        source_from_text("nothing here", "drafter.source")


def test_a_bare_drafter_source_gguf_is_loaded_as_one(tmp_path, monkeypatch, capsys):
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, "drafter=small_model",
                               f"drafter.source={tmp_path}/absent.gguf", "prompt=hi")
    assert_one_error_line(code, err, "specgen", f"GGUF file {tmp_path}/absent.gguf does not exist")


def test_seeds_the_server_draws_survive_a_json_double(monkeypatch):
    """A drawn seed is reported to the client, who replays it; JSON numbers above 2**53 lose digits
    in a double, so draws stay below it (randbits patched to its largest value)."""
    monkeypatch.setattr(protocol.secrets, "randbits", lambda bits: (1 << bits) - 1)
    seed = protocol.parse_completion({"model": "m", "prompt": "hi"}, "m").options.seed
    assert seed == 2**53 - 1 and int(float(seed)) == seed
