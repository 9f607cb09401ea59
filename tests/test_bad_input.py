"""Bad input from a careless user: one clear line, the right exit status, nothing half-written (issue 11).

Commands run in-process through their console entry points (the same code the
installed scripts run, from the argument check to Hydra); one subprocess test
checks the installed ``specgen`` script end to end.
"""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

import specgen
from specgen.cli import main as cli
from specgen.bench import cli as bench_cli
from specgen.config.checks import check_run_config
from specgen.config.compose import compose, to_container
from specgen.errors import ConfigError, ModelLoadError, PromptError
from specgen.train import cli as train_cli

TINY_ARGS = ["target=tiny", "drafter=tiny", "threads=1", "dtype=float32", "max_new_tokens=4"]


def run_command(monkeypatch, capsys, main, name, *args):
    """(exit status, stdout, stderr) of a console entry point run in-process."""
    monkeypatch.setattr(sys, "argv", [name, *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code, err, command, fragment):
    assert code == 2, err
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{command}: error: ") and fragment in lines[0], lines[0]


BAD_OVERRIDES = [
    (["speculative=maybe"], "speculative must be a boolean"),
    (["chat=maybe"], "chat must be auto or a boolean"),
    (["max_new_tokens=abc"], "max_new_tokens must be an integer, got 'abc'"),
    (["threads=abc"], "threads must be a positive integer or auto, got 'abc'"),
    (["threads=0"], "threads must be a positive integer or auto"),
    (["threads=100000"], "threads=100000 is more than the"),  # the thread pool raised MemoryError
    (["seed=abc"], "seed must be an integer, got 'abc'"),
    (["seed=99999999999999999999999"], "seed must be at most 18446744073709551615"),
    (["seed=-1"], "seed must be at least 0"),
    (["stop=[5]"], "stop must be a string or a list of strings"),
    (["stop=['']"], "stop strings must not be empty"),
    (["sampling.temperature=inf"], "sampling.temperature must be >= 0 (0 = greedy), got inf"),
    (["sampling.temperature=nan"], "sampling.temperature must be >= 0"),
    (["sampling.temperature=-1"], "sampling.temperature must be >= 0"),
    (["sampling.temperature=1e-40"], "sampling.temperature must be 0 (greedy) or at least 1e-06, got 1e-40"),
    (["sampling.temperature=hot"], "invalid value in sampling.temperature=hot: Value 'hot' of type 'str' could not"),
    (["sampling.top_p=0"], "sampling.top_p must be in (0, 1]"),
    (["sampling.repetition_penalty=-inf"], "sampling.repetition_penalty must be > 0"),
    (["sampling.bad_words=['']"], "sampling.bad_words[0] is an empty string"),
    (["sampling.bad_words=[[]]"], "sampling.bad_words[0] must be a word, a token id or a non-empty list"),
    (["+sampling.temprature=0.5"], "unknown key 'sampling.temprature'"),
    (["++sampling.temprature=0.5"], "did you mean sampling.temperature?"),
    (["+ui.colour=true"], "unknown key 'ui.colour'"),
    (["+drafter.num_token=3"], "unknown key 'drafter.num_token'"),
    (["+foo=1"], "unknown key 'foo'"),
    (["foo=1"], "unknown key 'foo'"),
    (["target=nonexistent"], "there is no config target/nonexistent; choose from dir, gguf, hub"),
    (["hello"], "'hello' is not an override: write key=value"),
    (["max_new_tokens=[1"], "invalid override"),
    (["seed=1,2"], "Ambiguous value for argument 'seed=1,2'"),
    (["ui.color=maybe"], "ui.color must be auto or a boolean"),
    (["target=gguf"], "target.source.path is required for a 'gguf' model source"),
    (["target=hub"], "target.source.repo is required"),
    (["target.source=null"], "target.source must be a model source with a 'kind' key"),
    (["target.source.vocab_size=0"], "target.source.vocab_size must be at least 1, got 0"),
    (["+target.source.tokenizer=x"], "target.source.tokenizer: a 'tiny' model source takes only"),
    (["max_new_tokens=2.5"], "max_new_tokens must be an integer, got 2.5"),
    (["sampling.temperature=0.5", "processors=[{name: temperature, temperature: inf}]"],
     "processor temperature: temperature must be a finite number, got inf"),
    (["--cfg", "jobb"], "argument --cfg/-c: invalid choice: 'jobb'"),
    (["drafter.num_tokens=100000"], "drafter.num_tokens must be a positive integer up to 64 or auto, got 100000"),
    (["llama_cpp.sequences=abc"], "llama_cpp.sequences must be an integer from 3"),
    (["llama_cpp.sequences=1"], "llama_cpp.sequences must be an integer from 3"),
    (["llama_cpp.sequences=257"], "to 256 (llama.cpp's limit)"),
    (["llama_cpp.batch_row_context=100"], "llama_cpp.batch_row_context must be an integer of at least 256"),
    (["llama_cpp.context=100"],
     "llama_cpp.context must be auto, null (the model's training context) or an integer of at least 256"),
    (["llama_cpp.tiny_type=Q2_K"], "llama_cpp.tiny_type='Q2_K' is not one of Q8_0, F32"),
    (["llama_cpp.flash_attention=maybe"], "llama_cpp.flash_attention='maybe' is not one of auto, off, on"),
    (["llama_cpp.prefill_split=4"], "llama_cpp.prefill_split must be auto or an integer from 8 to 512"),
    (["llama_cpp.prefill_split=wide"], "llama_cpp.prefill_split must be auto or an integer from 8 to 512"),
]


@pytest.mark.parametrize("extra, fragment", BAD_OVERRIDES, ids=[" ".join(e) for e, _ in BAD_OVERRIDES])
def test_bad_override_is_one_line_and_status_2(monkeypatch, capsys, extra, fragment):
    replaced = {arg.lstrip("+").split("=")[0] for arg in extra}
    args = [arg for arg in TINY_ARGS if arg.split("=")[0] not in replaced]
    code, out, err = run_command(monkeypatch, capsys, cli.main, "specgen", *args, "prompt=hi", *extra)
    assert_one_error_line(code, err, "specgen", fragment)
    assert out == ""


def test_optional_source_keys_may_still_be_added():
    cfg = to_container(compose(["target=hub", "target.source.repo=org/name", "+target.source.cache_dtype=bfloat16"]))
    assert cfg["target"]["source"]["cache_dtype"] == "bfloat16"


@pytest.mark.parametrize("spelling, expected", [("no", False), ("off", False), ("false", False), ("0", False),
                                                ("yes", True), ("on", True), ("True", True), ("1", True)])
def test_boolean_spellings(spelling, expected):
    cfg = check_run_config(to_container(compose([f"speculative={spelling}", f"chat={spelling}"])))
    assert cfg["speculative"] is expected and cfg["chat"] is expected
    assert check_run_config(to_container(compose(["chat=auto"])))["chat"] == "auto"


def test_speculative_off_runs_plain(monkeypatch, capsys):
    code, out, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, "prompt=hi", "speculative=off")
    assert code == 0 and "[off: speculative=false]" in err


@pytest.mark.parametrize("prompt", ["'Hello' and 'bye'", '"Hi," she said, "bye"', '"To be or not to be"'])
def test_quoted_prompts_reach_the_run_unchanged(monkeypatch, capsys, prompt):
    code, out, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, f"prompt={prompt}",
                                 "--cfg", "job")
    assert code == 0, err
    from omegaconf import OmegaConf

    assert OmegaConf.create(out)["prompt"] == prompt


def test_invalid_utf8_prompts(monkeypatch, capsys, tmp_path):
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(PromptError, match=r"prompt_file .* is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        cli.read_prompt({"prompt_file": str(binary)})
    stdin = io.TextIOWrapper(io.BytesIO(b"\xff\xfeabc"), encoding="utf-8")
    with pytest.raises(PromptError, match=r"stdin is not UTF-8 text \(byte 0xff at offset 0\)"):
        cli.read_prompt({"prompt": "-"}, stdin=stdin)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok \xff"), encoding="utf-8"))
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, "prompt=-")
    assert_one_error_line(code, err, "specgen", "stdin is not UTF-8 text (byte 0xff at offset 3)")


def test_arguments_that_are_not_utf8_are_refused_before_loading(monkeypatch, capsys):
    """Python decodes argument bytes that are not UTF-8 to lone surrogates, which no tokenizer can encode
    (the default model's raised TypeError after loading): one line, before anything loads."""
    import specgen.engine.assemble

    monkeypatch.setattr(specgen.engine.assemble, "build_pipeline", lambda cfg: pytest.fail("the model was loaded"))
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, "prompt=caf\udce9")
    assert_one_error_line(code, err, "specgen", "prompt is not valid Unicode text: a lone surrogate U+DCE9 at "
                                                "character 3")
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, "prompt=hi", "system=\udcff")
    assert_one_error_line(code, err, "specgen", "system is not valid Unicode text: a lone surrogate U+DCFF")


def test_prompt_file_that_is_a_directory(monkeypatch, capsys, tmp_path):
    with pytest.raises(PromptError, match="prompt_file is empty"):
        cli.read_prompt({"prompt_file": ""})
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, f"prompt_file={tmp_path}")
    assert_one_error_line(code, err, "specgen", f"prompt_file {tmp_path} is a directory")


def test_ctrl_c_while_loading_is_one_line_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("specgen.engine.assemble.load_model", interrupted)
    code, out, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS, "prompt=hi")
    assert code == 130 and err == "specgen: cancelled\n"


def test_multirun_leaves_nothing_in_cwd(monkeypatch, capsys, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    code, out, err = run_command(monkeypatch, capsys, cli.main, "specgen", "-m", *TINY_ARGS, "prompt=hi",
                                 "ui.summary=false", "seed=1,2")
    assert code == 0, err
    assert list(work.iterdir()) == []
    code, out, err = run_command(monkeypatch, capsys, cli.main, "specgen", "-m", *TINY_ARGS, "prompt=hi", "seed=1,x")
    assert_one_error_line(code, err, "specgen", "seed must be an integer, got 'x'")
    assert out == ""  # the bad job is found before the first one runs


def test_console_script_bad_override(tmp_path):
    """The installed script: Hydra never prints its own multi-line error."""
    done = subprocess.run(["specgen", *TINY_ARGS, "prompt=hi", "+sampling.temprature=0.5"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["specgen: error: unknown key 'sampling.temprature' in "
                                        "+sampling.temprature=0.5: specgen's config has no such setting; "
                                        "did you mean sampling.temperature?"]


# ---- specgen-bench ------------------------------------------------------------------------------------------

BENCH = ["target=tiny", "drafter=ngram", "threads=1", "bench.num_prompts=2", "bench.prompts=[prose]",
         "bench.max_new_tokens=4", "bench.progress=false", "bench.gammas=[2]", "bench.temperatures=[0]",
         "bench.baselines=[plain]", "bench.warmup=0", "bench.calibration_repeats=0", "bench.plots=false"]


@pytest.mark.parametrize("extra, fragment", [
    (["bench.num_prompts=0"], "bench.num_prompts must be a positive integer (or null = every prompt), got 0"),
    (["bench.temperatures=[-1]"], "bench.temperatures must hold finite numbers >= 0 (0 = greedy), got -1"),
    (["bench.temperatures=[1e-40]"], "bench.temperatures must be 0 (greedy) or at least 1e-06, got 1e-40"),
    (["bench.gammas=[]"], "bench.gammas needs at least one value"),
    (["bench.batch_sizes=[100000]"], "bench.batch_sizes must be at most 256, got 100000"),  # was after loading
])
def test_bench_settings_messages(monkeypatch, capsys, extra, fragment):
    code, _, err = run_command(monkeypatch, capsys, bench_cli.main, "specgen-bench", *BENCH, *extra)
    assert_one_error_line(code, err, "specgen-bench", fragment)


def test_bench_prompts_and_seeds_are_checked_before_any_model_loads(monkeypatch, capsys, tmp_path):
    """A prompt file that is not UTF-8 raised UnicodeDecodeError (status 1); a bench.seed whose seed + i
    passes 2**64 - 1 stopped the run after the first prompt was measured, losing it."""
    import specgen.bench.runner as runner

    monkeypatch.setattr(runner, "build_variant", lambda *a, **k: pytest.fail("a model was loaded"))
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"prompt": "first"}\n{"prompt": "caf\xe9"}\n')
    code, _, err = run_command(monkeypatch, capsys, bench_cli.main, "specgen-bench", *BENCH,
                               f"bench.prompts=[{latin}]")
    assert_one_error_line(code, err, "specgen-bench", f"{latin} is not UTF-8 text (byte 0xe9 at offset 35)")
    code, _, err = run_command(monkeypatch, capsys, bench_cli.main, "specgen-bench", *BENCH,
                               "bench.seed=18446744073709551615")
    assert_one_error_line(code, err, "specgen-bench", "bench.seed=18446744073709551615: prompt i runs with "
                                                      "bench.seed + i, past the largest seed")


def test_bench_out_dir_that_is_a_file_fails_before_running(monkeypatch, capsys, tmp_path):
    target = tmp_path / "taken"
    target.write_text("")

    def must_not_run(*args, **kwargs):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(bench_cli, "run_matrix", must_not_run)
    code, _, err = run_command(monkeypatch, capsys, bench_cli.main, "specgen-bench", *BENCH, f"bench.out_dir={target}")
    assert_one_error_line(code, err, "specgen-bench", f"bench.out_dir={target} is a file, not a directory")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        bench_cli.run_bench(bench_cli.compose_bench([*BENCH, f"bench.out_dir={target / 'sub'}"]))


def test_bench_ctrl_c_saves_what_was_measured(monkeypatch, capsys, tmp_path):
    import specgen.bench.runner as runner

    real_run_arm, calls = runner.run_arm, {"n": 0}

    def interrupted_on_second_prompt(*args, **kwargs):  # two arms a prompt: specgen gamma=2 and plain
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_run_arm(*args, **kwargs)

    monkeypatch.setattr(runner, "run_arm", interrupted_on_second_prompt)
    code, out, err = run_command(monkeypatch, capsys, bench_cli.main, "specgen-bench", *BENCH,
                                 f"bench.out_dir={tmp_path / 'res'}")
    assert code == 130 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("specgen-bench: interrupted after 2 measured generations; results so far in")
    (run_dir,) = (tmp_path / "res").iterdir()
    assert (run_dir / "samples.jsonl").read_text().count("\n") == 2
    assert "interrupted by Ctrl-C" in (run_dir / "table.md").read_text()
    calls["n"] = 2  # interrupted before anything was measured: nothing is written, one line, 130
    code, out, err = run_command(monkeypatch, capsys, bench_cli.main, "specgen-bench", *BENCH,
                                 f"bench.out_dir={tmp_path / 'res2'}")
    assert code == 130 and err == "specgen-bench: cancelled\n" and not (tmp_path / "res2").exists()


# ---- specgen-train ------------------------------------------------------------------------------------------

TRAIN = ["target=tiny", "train.kind=mtp", "train.head.intermediate_size=16", "train.head.draft_vocab_size=8",
         "train.num_conversations=8", "train.max_len=32", "train.eval_conversations=4", "train.batch_tokens=16",
         "train.steps=6", "train.progress=false", "train.device=cpu", "threads=1"]


def test_train_takes_top_level_device_dtype_threads(monkeypatch):
    monkeypatch.setattr("specgen.machine.logical_cpus", lambda: 4)  # whatever this machine has
    train = to_container(train_cli.compose_train(["threads=1", "dtype=float32", "device=cpu"]))["train"]
    assert (train["threads"], train["dtype"], train["device"]) == (1, "float32", "cpu")
    train = to_container(train_cli.compose_train(["threads=1", "train.threads=2"]))["train"]
    assert train["threads"] == 2


@pytest.mark.parametrize("extra, fragment", [
    ("train.lr=-1", "train.lr must be a finite number > 0, got -1"),  # was ValueError from AdamW, status 1
    ("train.lr=nan", "train.lr must be a finite number > 0, got nan"),
    ("train.steps=abc", "train.steps must be an integer, got 'abc'"),  # was ValueError from int()
    ("train.steps=2.7", "train.steps must be an integer, got 2.7"),  # was cut to 2 steps without a word
    ("train.shard_tokens=abc", "train.shard_tokens must be an integer, got 'abc'"),
    ("train.seed=-1", "train.seed must be at least 0, got -1"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio must be in [0, 1], got 2"),
])
def test_bad_train_settings_are_one_line_before_loading(monkeypatch, capsys, tmp_path, extra, fragment):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    code, _, err = run_command(monkeypatch, capsys, train_cli.main, "specgen-train", *TRAIN,
                               f"train.out={tmp_path / 'head.safetensors'}", extra)
    assert_one_error_line(code, err, "specgen-train", fragment)
    assert not (tmp_path / "cache").exists()  # refused before the target was loaded


def test_train_out_that_is_a_directory_fails_before_training(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    code, _, err = run_command(monkeypatch, capsys, train_cli.main, "specgen-train", *TRAIN, f"train.out={tmp_path}")
    assert_one_error_line(code, err, "specgen-train", f"train.out={tmp_path} is a directory")
    assert not tmp_path.with_name(tmp_path.name + ".tmp").exists()
    assert not (tmp_path / "cache").exists()  # refused before the target was loaded


@pytest.mark.parametrize("out", ["/proc/nope/head.safetensors", "/proc/head.safetensors"])
def test_train_out_that_cannot_be_written_fails_before_loading(monkeypatch, capsys, tmp_path, out):
    """/proc takes no new files, even from root: refused before the target loads, not after training."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    code, _, err = run_command(monkeypatch, capsys, train_cli.main, "specgen-train", *TRAIN, f"train.out={out}")
    assert_one_error_line(code, err, "specgen-train", f"train.out={out} cannot be written: no file can be created in")
    assert not (tmp_path / "cache").exists()


def test_output_checks_create_nothing(tmp_path):
    from specgen.config.paths import check_output_file

    check_output_file(tmp_path / "new" / "dir" / "head.safetensors", "train.out", create_parents=True)
    with pytest.raises(ConfigError, match="new does not exist; create it first"):
        check_output_file(tmp_path / "new" / "out.jsonl", "output")
    existing = tmp_path / "kept.jsonl"
    existing.write_text("earlier\n")
    check_output_file(existing, "output")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.jsonl"] and existing.read_text() == "earlier\n"


def test_jsonl_output_in_a_missing_directory_fails_before_loading(monkeypatch, capsys, tmp_path):
    import specgen.engine.assemble

    monkeypatch.setattr(specgen.engine.assemble, "build_pipeline", lambda cfg: pytest.fail("the model was loaded"))
    (tmp_path / "rows.jsonl").write_text('"hi"\n')
    out = tmp_path / "nodir" / "out.jsonl"
    code, _, err = run_command(monkeypatch, capsys, cli.main, "specgen", *TINY_ARGS,
                               f"prompt_file={tmp_path / 'rows.jsonl'}", f"output={out}")
    assert_one_error_line(code, err, "specgen", f"output={out} cannot be created: {out.parent} does not exist")


def test_train_ctrl_c_exits_130_naming_the_checkpoint(monkeypatch, capsys, tmp_path):
    import specgen.train.loop as loop

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    real_loss, calls = loop.depth_loss, {"n": 0}

    def interrupted_at_step_3(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(loop, "depth_loss", interrupted_at_step_3)
    out_file = tmp_path / "head.safetensors"
    code, _, err = run_command(monkeypatch, capsys, train_cli.main, "specgen-train", *TRAIN, f"train.out={out_file}")
    checkpoint = tmp_path / "head.safetensors.ckpt"
    assert code == 130 and checkpoint.is_file() and not out_file.exists()
    assert err.splitlines() == [f"specgen-train: interrupted: stopped at step 2/6; checkpoint saved to {checkpoint} "
                                "(run again with train.resume=true to continue)"]


# ---- files and caches ---------------------------------------------------------------------------------------

def test_gguf_cut_inside_its_header(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF\x03\x00\x00\x00\x01")
    with pytest.raises(ModelLoadError, match="ends inside its GGUF header"):
        specgen.pipeline("target=gguf", f"target.source.path={cut}", "drafter=none", "threads=1", progress=False)
    folders = [tmp_path / "cache" / name for name in ("converted", "tokenizers")]  # torch or llama.cpp's cache
    assert any(f.is_dir() for f in folders)
    assert [p.name for f in folders if f.is_dir() for p in f.iterdir()] == []  # no partial entry left


@pytest.mark.parametrize("where", ["file", "file/below"])
def test_specgen_cache_that_is_a_file(monkeypatch, tmp_path, where):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / where))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ModelLoadError, match="cannot use the specgen cache directory .*: Not a directory; set "
                                             "SPECGEN_CACHE to a writable directory"):
        specgen.pipeline("target=gguf", f"target.source.path={gguf}", "drafter=none", "threads=1", progress=False)


def test_missing_source_entry_through_the_loader():
    from specgen.models.loading import resolve_model_dir

    with pytest.raises(ModelLoadError, match="a 'gguf' model source needs a 'path' entry"):
        resolve_model_dir({"kind": "gguf", "path": "???"})


def _config_dir(tmp_path, config) -> str:
    config.save_pretrained(str(tmp_path))
    return str(tmp_path)


def test_sliding_window_target_is_refused(tmp_path):
    from transformers import MistralConfig

    path = _config_dir(tmp_path, MistralConfig(sliding_window=8, max_position_embeddings=64, hidden_size=16,
                                               intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, vocab_size=32))
    with pytest.raises(ModelLoadError, match=r"mistral uses sliding-window attention \(window 8 tokens, context 64\)"):
        specgen.pipeline("target=dir", f"target.source.path={path}", "drafter=none", "threads=1", progress=False)


def test_recurrent_target_is_refused(tmp_path):
    from transformers import MambaConfig

    path = _config_dir(tmp_path, MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=32))
    with pytest.raises(ModelLoadError, match="mamba has recurrent or state-space layers"):
        specgen.pipeline("target=dir", f"target.source.path={path}", "drafter=none", "threads=1", progress=False)


def test_full_attention_configs_are_accepted():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from specgen.models.architecture import unsupported_architecture

    assert unsupported_architecture(LlamaConfig()) is None
    assert unsupported_architecture(Qwen2Config(sliding_window=4096, use_sliding_window=False)) is None
    assert unsupported_architecture(MistralConfig(sliding_window=64, max_position_embeddings=64)) is None


def test_empty_medusa_tree():
    from specgen.drafters.medusa import validate_tree

    with pytest.raises(ConfigError, match="drafter.tree is empty"):
        validate_tree([], 4)


def test_chat_entry_checks_values_before_starting(monkeypatch, capsys):
    from specgen.tui import app

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr(sys, "stdout", Terminal())
    monkeypatch.setattr(app, "ChatApp", None)  # never reached
    assert app.main(["target=tiny", "speculative=maybe"]) == 2
    assert app.main(["target=tiny", "+sampling.temprature=0.5"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("specgen-chat: error: speculative must be a boolean (true/false, yes/no, on/off, 1/0), "
                      "got 'maybe'")
    assert err[1].startswith("specgen-chat: error: unknown key 'sampling.temprature'") and len(err) == 2
