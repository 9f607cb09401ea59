"""The quality report (specgen.bench.quality, ``specgen-bench bench.quality=true``) on tiny models."""

from __future__ import annotations

import io

import pytest
import torch

from specgen.bench.cli import compose_bench, run_bench
from specgen.bench.quality import measure, parse_paths, reference_text
from specgen.errors import ConfigError
from specgen.models import load_model, load_quantized

SOURCE = {"kind": "tiny", "seed": 0, "vocab_size": 16, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
          "num_kv_heads": 2, "context_length": 512, "init_scale": 1.0}
QUALITY = ["target=tiny", "threads=1", "bench.quality=true", "bench.prompts=[prose]", "bench.num_prompts=2",
           "bench.max_new_tokens=6", "bench.out_dir=null", "bench.progress=false"]


def _text(reference, new_tokens=6):
    prompts = [[1, 5, 9, 2], [3, 3, 7]]
    with torch.no_grad():
        return reference_text(reference, prompts, new_tokens)


def test_reference_against_itself_is_exactly_zero_and_int8_is_not():
    """KL of the reference against itself is exactly 0 with its own NLL (every position agrees);
    int8 weights of the same model must show KL > 0 (the measurement can see a difference)."""
    reference = load_model(SOURCE, name="float32", dtype=torch.float32, device=torch.device("cpu"), progress=False).lm
    text = _text(reference)
    with torch.no_grad():
        itself = measure(reference, text)
        int8 = measure(load_quantized(SOURCE, name="int8", quant="int8", progress=False).lm, text)
    expected_nll = -torch.cat([lp.gather(-1, torch.tensor(s[-n:])[:, None])[:, 0]
                               for s, n, lp in zip(text.sequences, text.scored, text.logprobs)]).mean()
    assert itself.kl == 0.0 and itself.top1 == 1.0 and itself.positions == 12
    assert itself.nll == pytest.approx(float(expected_nll), abs=0.0)
    assert int8.kl > 0.0
    assert int8.nll != itself.nll


def test_reference_text_is_the_greedy_continuation():
    """The scored tokens are the reference's argmax at each position (a generator that drifted would not be)."""
    reference = load_model(SOURCE, name="float32", dtype=torch.float32, device=torch.device("cpu"), progress=False).lm
    text = _text(reference)
    for sequence, scored, logprobs in zip(text.sequences, text.scored, text.logprobs):
        assert logprobs.shape[0] == scored == 6
        assert logprobs.argmax(-1).tolist() == sequence[-scored:]


def test_bench_quality_report_rows():
    """The bench mode's reference row is measured (KL 0.0 from a second forward) and int8's is not 0."""
    out = io.StringIO()
    result = run_bench(compose_bench([*QUALITY, "bench.quality_paths=[int8]"]), out=out, err=io.StringIO())
    rows = {row["path"]: row for row in result.rows}
    assert list(rows) == ["float32", "int8"]
    assert rows["float32"]["kl"] == 0.0 and rows["float32"]["positions"] == 12
    assert rows["int8"]["kl"] > 0.0
    assert "| int8 |" in out.getvalue() and "greedy continuations" in out.getvalue()


def test_bad_path_is_refused_before_loading(monkeypatch):
    """An unknown path name is a ConfigError naming it, raised before any model loads."""
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("specgen.engine.assemble.build_pipeline", no_load)
    with pytest.raises(ConfigError, match="fp8"):
        run_bench(compose_bench([*QUALITY, "bench.quality_paths=[int8,fp8]"]), out=io.StringIO(), err=io.StringIO())
    with pytest.raises(ConfigError, match="bench.quality"):
        run_bench(compose_bench([*QUALITY, "bench.quality=maybe"]), out=io.StringIO(), err=io.StringIO())


def test_parse_paths_puts_the_reference_first_once():
    assert parse_paths(["int4", "float32", "int4"]) == ["float32", "int4"]
    assert parse_paths("llama_cpp") == ["float32", "llama_cpp"]
