"""One run config: frozen, built once per run at the edge, defaults and bounds written once (issue 47 item 3)."""

from __future__ import annotations

import dataclasses
import io
import pathlib
import re

import pytest
from conftest import TINY

import specgen
from specgen.cli import main as cli
from specgen.config.compose import compose, to_container
from specgen.config.run import RunConfig
from specgen.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARGS = [*TINY, "drafter=tiny", "max_new_tokens=4"]


@pytest.fixture
def constructions(monkeypatch):
    """A function returning the RunConfigs built since the test began."""
    monkeypatch.setattr(RunConfig, "constructions", 0)
    return lambda: RunConfig.constructions


def test_run_config_is_frozen_and_typed():
    run = RunConfig.from_cfg(compose(ARGS))
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.speculative = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.llama_cpp.sequences = 3
    with pytest.raises(TypeError):
        run.checked["seed"] = 1  # the checked mapping is read-only at the top
    assert run.requests.max_new_tokens == 4 and run.requests.stop == () and run.threads == 1
    assert run.llama_cpp.sequences == compose([]).llama_cpp.sequences  # conf/config.yaml's value
    assert RunConfig.from_cfg(run) is run  # handed down, never rebuilt


def test_checked_mapping_is_the_checked_plain_config():
    """What fingerprints and cost-table keys hash is what check_run_config gave before: plain dicts and
    lists (a DictConfig is resolved first; its ListConfig bad_words once failed the checks)."""
    from specgen.config.checks import check_run_config

    cfg = compose([*ARGS, "sampling.bad_words=[[9,9]]"])
    run = RunConfig.from_cfg(cfg)
    assert dict(run.checked) == check_run_config(to_container(cfg))
    assert type(run.checked["target"]) is dict and type(run.sampling["bad_words"][0]) is list


def test_one_run_config_per_cli_run(constructions, capsys):
    cli.run(to_container(compose([*ARGS, "prompt=hello"])), out=io.StringIO(), err=io.StringIO())
    assert constructions() == 1


def test_one_run_config_per_api_pipeline(constructions):
    pipe = specgen.pipeline(*ARGS, progress=False)
    assert constructions() == 1 and isinstance(pipe.config, RunConfig) and pipe.defaults is pipe.config.requests
    pipe.generate("abc")
    assert constructions() == 1  # requests take the pipeline's checked defaults


def test_one_run_config_per_server_start(constructions, monkeypatch):
    import uvicorn

    from specgen.serve import cli as serve_cli

    started = []
    monkeypatch.setattr(serve_cli, "bind", lambda host, port: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: started.append(self))
    serve_cli.serve(to_container(compose(["target=tiny", "drafter=tiny", "threads=1"], "serve")), err=io.StringIO())
    assert started and constructions() == 1


def test_a_server_with_an_unbatchable_drafter_is_not_refused_by_a_second_check():
    """specgen-serve sizes its own batches (a tree drafter serves one request at a time): its RunConfig
    has no batch_size, and build_pipeline takes it as it is (the config was checked again there, with
    the server's batch_size, and drafter=eagle was refused)."""
    from specgen.serve.cli import check_server_config

    server = check_server_config(to_container(compose(["target=tiny", "drafter=eagle"], "serve")))
    assert server.batch_size == 8 and server.run.batch_size is None
    assert RunConfig.from_cfg(server.run) is server.run
    with pytest.raises(ConfigError, match="drafter=eagle needs batch_size=1"):  # what that second check said
        RunConfig.from_cfg({**server.run.checked, "batch_size": server.batch_size})


def test_one_run_config_per_chat(constructions):
    from specgen.engine.assemble import build_pipeline
    from specgen.tui.app import chat_configs

    cfg, run = chat_configs([*ARGS])
    build_pipeline(run)
    assert constructions() == 1


def test_a_rebuilt_config_counts_again(constructions):
    """Negative control: the counter sees every construction, so the counts above can fail."""
    cfg = compose(ARGS)
    RunConfig.from_cfg(cfg)
    RunConfig.from_cfg(cfg)
    assert constructions() == 2


@pytest.mark.parametrize("key", ["seed", "max_new_tokens", "speculative", "stop", "threads"])
def test_a_run_key_has_no_default_but_the_yaml(key):
    cfg = to_container(compose(ARGS))
    del cfg[key]
    with pytest.raises(ConfigError, match=f"{key} is missing from the config"):
        RunConfig.from_cfg(cfg)


def test_a_section_key_has_no_default_but_the_yaml():
    cfg = to_container(compose(ARGS))
    del cfg["llama_cpp"]["sequences"]
    with pytest.raises(ConfigError, match="llama_cpp.sequences is missing"):
        RunConfig.from_cfg(cfg)


def _run_keys() -> list[str]:
    """The top-level keys conf/config.yaml sets (each with its one default)."""
    text = (ROOT / "conf" / "config.yaml").read_text()
    return [m.group(1) for m in re.finditer(r"^([a-z_]+):(?! *$)", text, re.M) if m.group(1) != "defaults"]


#: Modules still reading run keys off a mapping with defaults, and why: models/backends.py decides the
#: backend from a mapping (the checked one, RunConfig.checked), which its tests give partially.
REMAINING = {"specgen/models/backends.py"}


def _defaulted_reads(source: str, keys: list[str]) -> list[str]:
    """``cfg.get("key", default)`` reads of run keys in ``source``: a second home for a default."""
    pattern = re.compile(r"\b(?:cfg|config|checked)\.get\(\s*[\"'](%s)[\"']\s*," % "|".join(map(re.escape, keys)))
    return [m.group(0) for m in pattern.finditer(source)]


def test_no_run_key_is_read_with_a_default_outside_the_yaml():
    keys = _run_keys()
    assert {"seed", "max_new_tokens", "stop", "threads", "compile"} <= set(keys)
    assert _defaulted_reads('x = cfg.get("seed", 0)', keys)  # negative control: the grep finds one
    found = {str(path.relative_to(ROOT)): hits for path in sorted((ROOT / "specgen").rglob("*.py"))
             if (hits := _defaulted_reads(path.read_text(encoding="utf-8"), keys))}
    assert set(found) >= REMAINING, "a remaining module was cleaned up: drop it from REMAINING"
    found = {path: hits for path, hits in found.items() if path not in REMAINING}
    assert not found, f"run keys read with a default of their own: {found}"


def test_seed_and_stop_are_parsed_only_where_options_are_checked():
    """The engine and the batch take checked seeds and stops: no parser call below the edge."""
    call = re.compile(r"\bparse_(seed|stop|num_tokens)\(")
    assert call.search("x = parse_seed(value)")  # negative control
    below = [path for folder in ("engine", "batch", "planning") for path in (ROOT / "specgen" / folder).rglob("*.py")]
    found = [str(path.relative_to(ROOT)) for path in below if call.search(path.read_text(encoding="utf-8"))]
    assert not found, f"seed/stop/num_tokens parsed again below the edge: {found}"
