"""specgen-bench's batch dimension (bench.batch_sizes, specgen/bench/batching.py)."""

from __future__ import annotations

import io
import json

import pytest

from conftest import TINY
from specgen.bench.batching import _quantile, batch_markdown, summarise_batches
from specgen.bench.cli import compose_bench, run_bench
from specgen.errors import ConfigError


def test_batch_section_runs_every_method_and_size(tmp_path):
    cfg = compose_bench([*TINY, "drafter=ngram", "bench.batch_sizes=[2,1]", "bench.temperatures=[0]",
                         "bench.num_prompts=2", "bench.max_new_tokens=6", "bench.warmup=0", "bench.batch_repeats=1",
                         f"bench.out_dir={tmp_path}"])
    out, err = io.StringIO(), io.StringIO()
    result = run_bench(cfg, {"target": "tiny", "drafter": "ngram"}, out=out, err=err)
    cells = {(r["method"], r["batch_size"]) for r in result.rows}
    assert cells == {(m, b) for m in ("plain", "specgen", "hf_generate") for b in (1, 2)}
    for row in result.rows:
        assert row["tok_s"] > 0 and 0 < row["latency_p50"] <= row["latency_p99"]
        if row["method"] != "hf_generate":  # specgen's batched greedy rows equal plain batch-1 rows
            assert row["matches_single"] is True, row
    assert all(s["tokens"] == 4 * 6 for s in result.samples)  # 2 prompts x 2 tasks, EOS masked
    assert "| T | method | batch |" in out.getvalue()
    rows = [json.loads(line) for line in (result.out_dir / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[0]["environment"]["threads"] == 1


def test_batch_summary_ratios_and_quantiles():
    samples = [{"temperature": 0.0, "method": m, "batch_size": b, "tok_s": t, "latency": [1.0, 2.0, 3.0, 4.0],
                "matches_single": None} for m, b, t in (("plain", 1, 10.0), ("plain", 4, 30.0), ("specgen", 4, 15.0))]
    rows = {(r["method"], r["batch_size"]): r for r in summarise_batches(samples)}
    assert rows["plain", 4]["x_batch1"] == 3.0 and rows["specgen", 4]["x_plain"] == 0.5
    assert rows["specgen", 4]["x_batch1"] is None  # no batch-1 specgen sample
    assert _quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and _quantile([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0


def test_bad_batch_sizes_are_refused():
    cfg = compose_bench([*TINY, "drafter=ngram", "bench.batch_sizes=[0]"])
    with pytest.raises(ConfigError, match="bench.batch_sizes"):
        run_bench(cfg, out=io.StringIO(), err=io.StringIO())


def test_batch_summary_pairs_each_repeat_with_plain():
    """×plain per repeat divides by plain's rate in the same repeat, not by plain's median."""
    rates = {("plain", 0): 100.0, ("specgen", 0): 110.0, ("plain", 1): 50.0, ("specgen", 1): 52.0,
             ("plain", 2): 80.0, ("specgen", 2): 76.0, ("specgen", 3): 1.0}  # repeat 3 has no plain: left out
    samples = [{"temperature": 0.0, "method": m, "batch_size": 8, "repeat": k, "tok_s": t, "latency": [1.0],
                "matches_single": None} for (m, k), t in rates.items()]
    rows = {r["method"]: r for r in summarise_batches(samples)}
    assert rows["specgen"]["paired"] == pytest.approx([1.10, 1.04, 0.95])
    assert rows["specgen"]["x_plain_paired"] == pytest.approx(1.04)
    assert rows["plain"]["paired"] == [] and rows["plain"]["x_plain_paired"] is None
    assert "1.04 [0.95–1.10]" in batch_markdown(list(rows.values()))


def test_batch_section_leaves_out_the_baselines_not_named(tmp_path):
    """Without plain in bench.baselines only specgen batches run; greedy rows are checked
    against specgen's own batch-1 outputs. With nothing batchable the bench says so."""
    cfg = compose_bench([*TINY, "drafter=ngram", "bench.batch_sizes=[1,2]", "bench.temperatures=[0]",
                         "bench.num_prompts=2", "bench.max_new_tokens=6", "bench.warmup=0", "bench.batch_repeats=1",
                         "bench.baselines=[]", f"bench.out_dir={tmp_path}"])
    result = run_bench(cfg, {"target": "tiny", "drafter": "ngram"}, out=io.StringIO(), err=io.StringIO())
    assert {(r["method"], r["batch_size"]) for r in result.rows} == {("specgen", 1), ("specgen", 2)}
    assert all(r["matches_single"] is True and r["x_plain"] is None for r in result.rows)
    cfg = compose_bench([*TINY, "drafter=ngram", "speculative=false", "bench.batch_sizes=[1]", "bench.baselines=[]",
                         f"bench.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="no method to batch"):
        run_bench(cfg, out=io.StringIO(), err=io.StringIO())


def test_batch_section_under_a_grammar_skips_hf_generate_and_says_why(tmp_path):
    pattern = "[eaoiu]{3,10}( [tnshrdlcm]{1,4}){0,3}"  # over the tiny alphabet
    cfg = compose_bench([*TINY, "drafter=ngram", "grammar=regex", f"grammar.pattern={pattern}",
                         "bench.batch_sizes=[2]", "bench.temperatures=[0]", "bench.num_prompts=2",
                         "bench.max_new_tokens=6", "bench.warmup=0", "bench.batch_repeats=1",
                         "bench.baselines=[plain,hf_generate]", f"bench.out_dir={tmp_path}"])
    result = run_bench(cfg, {"target": "tiny", "drafter": "ngram"}, out=io.StringIO(), err=io.StringIO())
    assert {r["method"] for r in result.rows} == {"plain", "specgen"}
    skipped = [n for n in result.notes if n.startswith("hf_generate skipped")]
    assert skipped == ["hf_generate skipped: HF generate() has no equivalent of grammar=regex"]
    assert not any("kernels" in n for n in result.notes), "no HF method ran"


def test_batch_size_one_runs_the_single_request_engine(monkeypatch):
    """B = 1 is one request at a time on pipe.generate (what the CLI's batch_size=1 runs), and
    gives the outputs B = 2 gives on the batched engine."""
    import specgen.batch
    from conftest import tiny_pipeline
    from specgen.bench.batching import run_specgen

    pipe = tiny_pipeline("drafter.num_tokens=3", drafter="ngram")
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 4]]
    ticks = iter(range(100))
    batched = run_specgen(pipe, prompts, 2, speculative=True, max_new=8, seed=0, clock=lambda: next(ticks))
    monkeypatch.setattr(specgen.batch, "stream_batch", lambda *a, **k: pytest.fail("B = 1 went to stream_batch"))
    calls = []
    generate = type(pipe).generate
    monkeypatch.setattr(type(pipe), "generate", lambda self, *a, **k: calls.append(k) or generate(self, *a, **k))
    single = run_specgen(pipe, prompts, 1, speculative=True, max_new=8, seed=0, clock=lambda: next(ticks))
    assert [c["options"].seed for c in calls] == [0, 1] and all(c["options"].speculative for c in calls)
    assert single["outputs"] == batched["outputs"] and len(single["outputs"][0]) == 8
    assert single["latency"][0] < single["latency"][1] <= single["wall"]
