"""The cost model's measurement plumbing, caching and keying, with an injected timer (never timed asserts)."""

from __future__ import annotations

import itertools
import json

import pytest

import specgen.costmodel as costmodel
from conftest import TEST_COSTS, tiny_pipeline
from specgen.errors import ConfigError


class FakeTimer:
    """Each reading advances by a fixed tick: every timed span costs the same, whatever the machine."""

    def __init__(self):
        self.ticks = itertools.count()

    def __call__(self) -> float:
        return float(next(self.ticks))


@pytest.fixture
def real_cost_table(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(costmodel, "cost_table", _ORIGINAL)
    monkeypatch.setattr(costmodel, "_MEMO", {})
    return tmp_path


_ORIGINAL = costmodel.cost_table


def test_measure_shapes_and_monotone_tables():
    pipe = tiny_pipeline(drafter="tiny")
    table = costmodel.measure(pipe, clock=FakeTimer(), repeats=1, max_tokens=6)
    assert len(table.chain) == len(table.tree) == 6
    assert table.chain[0] == pytest.approx(1.0)
    assert all(b >= a for a, b in zip(table.chain, table.chain[1:]))
    assert table.draft_per_token >= 0 and table.draft_fixed >= 0
    assert table.facts["threads"] >= 1 and table.facts["dtype"] == "torch.float32"


def test_cache_is_keyed_and_refreshable(real_cost_table, monkeypatch):
    calls = []

    def fake_measure(pipe, clock=None):
        calls.append(pipe)
        return costmodel.CostTable(chain=(1.0, 1.5), tree=(1.0, 2.0), step_s=0.01, facts=costmodel.facts(pipe))

    monkeypatch.setattr(costmodel, "measure", fake_measure)
    pipe = tiny_pipeline(drafter="tiny")
    first = costmodel.cost_table(pipe)
    assert list((real_cost_table / "costs").glob("*.json"))
    costmodel._MEMO.clear()
    assert costmodel.cost_table(pipe) == first and len(calls) == 1  # served from disk
    costmodel.cost_table(pipe, refresh=True)
    assert len(calls) == 2
    other = tiny_pipeline("drafter.num_tokens=2", drafter="tiny")  # a different drafter config: another key
    assert costmodel.cache_key(costmodel.facts(other)) != costmodel.cache_key(costmodel.facts(pipe))
    costmodel.cost_table(other)
    assert len(calls) == 3
    assert "v(n) chain" in costmodel.describe(first)
    compiled = tiny_pipeline("compile=true", drafter="tiny")  # compiled forwards cost differently: another key
    assert costmodel.cache_key(costmodel.facts(compiled)) != costmodel.cache_key(costmodel.facts(pipe))


def test_fixed_table_from_the_environment_replaces_measuring(real_cost_table, monkeypatch):
    """$SPECGEN_COST_TABLE: that table for every pipeline, nothing measured or cached; bad files are one line."""
    monkeypatch.setattr(costmodel, "measure", lambda pipe, clock=None: pytest.fail("measured despite a fixed table"))
    path = real_cost_table / "fixed.json"
    path.write_text(json.dumps(costmodel.to_dict(TEST_COSTS)))
    monkeypatch.setenv(costmodel.FIXED_TABLE_ENV, str(path))
    pipe = tiny_pipeline(drafter="tiny")
    assert costmodel.cost_table(pipe) == TEST_COSTS
    assert costmodel.cost_table(pipe, refresh=True) == TEST_COSTS
    assert not (real_cost_table / "costs").exists()
    for content, message in ((None, "cannot read"), ("{}", "not a cost table"), ('{"chain": [1', "not a cost table")):
        if content is not None:
            path.write_text(content)
        monkeypatch.setenv(costmodel.FIXED_TABLE_ENV, str(path) if content else str(real_cost_table / "missing"))
        with pytest.raises(ConfigError, match=message) as caught:
            costmodel.cost_table(pipe)
        assert "SPECGEN_COST_TABLE" in str(caught.value) and "\n" not in str(caught.value)


def test_corrupt_cache_file_is_remeasured(real_cost_table, monkeypatch):
    monkeypatch.setattr(costmodel, "measure", lambda pipe, clock=None: costmodel.CostTable(chain=(1.0,), tree=(1.0,)))
    pipe = tiny_pipeline(drafter="ngram")
    path = real_cost_table / "costs" / f"{costmodel.cache_key(costmodel.facts(pipe))}.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert costmodel.cost_table(pipe).chain == (1.0,)


def test_measuring_the_cost_table_is_not_part_of_a_requests_time(monkeypatch):
    """The one-off measurement happens before the request's clock starts (a fake clock: no timing)."""
    import specgen.engine

    now = [0.0]
    monkeypatch.setattr(specgen.engine.time, "perf_counter", lambda: now[0])

    def slow_measurement(pipe, **kwargs):
        now[0] += 100.0  # a measurement that "takes" 100 s
        return TEST_COSTS

    monkeypatch.setattr("specgen.costmodel.cost_table", slow_measurement)
    pipe = tiny_pipeline(drafter="tiny")
    gen = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=8)
    assert pipe.drafter.num_tokens == "auto" and pipe.costs is TEST_COSTS
    assert now[0] == 100.0  # measured exactly once
    assert gen.stats.wall < 100.0 and gen.stats.ttft < 100.0


def test_measure_batch_shapes(monkeypatch):
    """The batched table: every measured (rows, width) cell, in units of its 1 x 1 forward, non-decreasing."""
    pipe = tiny_pipeline(drafter="ngram")
    table = costmodel.measure_batch(pipe, 3, clock=FakeTimer(), max_width=4)
    assert table.sizes == (1, 2, 3) and table.widths == (1, 2, 3, 4)
    assert table.body[0][0] == pytest.approx(1.0) and table.head == 0.0
    assert all(b >= a for line in table.body for a, b in zip(line, line[1:]))
    assert table.facts["batch_size"] == 3


def test_batch_table_is_cached_and_fixed_by_the_environment(real_cost_table, monkeypatch):
    from specgen.batch_planner import BatchCostTable

    monkeypatch.setattr(costmodel, "batch_cost_table", _ORIGINAL_BATCH)
    calls = []
    made = BatchCostTable((1, 4), (1, 9), ((1.0, 2.0), (2.0, 5.0)), 0.01, 0.01)
    monkeypatch.setattr(costmodel, "measure_batch", lambda pipe, size, clock=None: calls.append(size) or made)
    pipe = tiny_pipeline(drafter="ngram")
    assert costmodel.batch_cost_table(pipe, 4) == made
    costmodel._MEMO.clear()
    assert costmodel.batch_cost_table(pipe, 4) == made and calls == [4]  # served from disk
    costmodel.batch_cost_table(pipe, 8)
    assert calls == [4, 8]  # another batch size: another key
    assert "B=4: 2.00 5.00" in costmodel.describe_batch(made)
    path = real_cost_table / "fixed.json"
    path.write_text(json.dumps(costmodel.to_dict(TEST_COSTS)))
    monkeypatch.setenv(costmodel.FIXED_TABLE_ENV, str(path))
    assert costmodel.batch_cost_table(pipe, 8) == BatchCostTable.from_chain(TEST_COSTS.chain, (1, 2, 4, 8))
    path.write_text(json.dumps(dict(costmodel.to_dict(TEST_COSTS), batch=costmodel.batch_to_dict(made))))
    assert costmodel.batch_cost_table(pipe, 8) == made and calls == [4, 8]
    path.write_text(json.dumps(dict(costmodel.to_dict(TEST_COSTS), batch={"sizes": [1]})))
    with pytest.raises(ConfigError, match="not a batch cost table"):
        costmodel.batch_cost_table(pipe, 8)


_ORIGINAL_BATCH = costmodel.batch_cost_table
