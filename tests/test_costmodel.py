"""Cost-table measurement (specgen.planning.measure), caching and keying (specgen.planning.cost_cache),
with an injected timer (never timed asserts)."""

from __future__ import annotations

import itertools
import json

import pytest

from conftest import TEST_COSTS, tiny_pipeline
from specgen.models.batch_kv import BatchKV
from specgen.batch.drafting import batch_costs
from specgen.planning import BatchCostTable, CostTable
from specgen.planning import measure as measuring
from specgen.planning import cost_cache
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
    monkeypatch.setattr(cost_cache, "cost_table", _ORIGINAL)
    monkeypatch.setattr(cost_cache, "_MEMO", {})
    return tmp_path


_ORIGINAL = cost_cache.cost_table
_ORIGINAL_BATCH = cost_cache.batch_cost_table


def table_of(pipe, **kwargs):
    return cost_cache.cost_table(pipe.cost_subject(), **kwargs)


def new_batch(pipe):
    return lambda rows: BatchKV(pipe.target, rows)


class ShapedTimer:
    """A timer whose spans follow a cost per forward width (a CPU where 4 rows beat 3), read off the
    number of tokens the target was asked to verify; other spans (drafting) cost one tick."""

    COSTS = {1: 1.0, 2: 1.4, 3: 1.6, 4: 1.36, 5: 1.55, 6: 1.55}

    def __init__(self):
        self.now, self.width = 0.0, None

    def __call__(self) -> float:
        if self.width is not None:  # the end of a timed forward
            self.now += self.COSTS[self.width]
            self.width = None
        return self.now


def test_measure_keeps_every_width_as_measured(monkeypatch):
    """Every count is measured (none interpolated) and a cheaper longer forward stays cheaper:
    the table is not forced non-decreasing."""
    pipe = tiny_pipeline(drafter="tiny")
    timer = ShapedTimer()
    real_forward, real_tree = type(pipe.target).forward, type(pipe.target).forward_tree

    def forward(self, cache, feed, keep=1, **kwargs):  # the draft model's and the calibration prefill are not shaped
        timer.width = len(feed) if len(cache) and self is pipe.target else None
        return real_forward(self, cache, feed, keep=keep, **kwargs)

    def forward_tree(self, cache, chain, nodes, *args, **kwargs):
        timer.width = len(chain) + len(nodes)
        return real_tree(self, cache, chain, nodes, *args, **kwargs)

    monkeypatch.setattr(type(pipe.target), "forward", forward)
    monkeypatch.setattr(type(pipe.target), "forward_tree", forward_tree)
    monkeypatch.setattr(pipe.drafter, "tree_width", 4, raising=False)  # as a tree drafter: trees are timed too
    table = measuring.measure(pipe.cost_subject(), clock=timer, repeats=1, max_tokens=6)
    assert table.chain == pytest.approx(tuple(ShapedTimer.COSTS[n] for n in range(1, 7)))
    assert table.tree == pytest.approx(table.chain)
    assert table.chain[3] < table.chain[2]


def test_tree_tables_time_branching_trees(monkeypatch):
    """A tree table prices the trees rounds verify, which branch: on a target whose tree forward
    costs one pass per root-to-leaf path (the quantized target computes a chain-shaped tree as a
    chain), a chain-shaped probe would price every tree as a chain (the planner then drafted at a
    loss on w8a8). Negative control: the chain table stays the chain's."""
    pipe = tiny_pipeline(drafter="tiny")
    timer = ShapedTimer()
    real_forward, real_tree = type(pipe.target).forward, type(pipe.target).forward_tree
    shapes = []

    def forward(self, cache, feed, keep=1, **kwargs):
        timer.width = len(feed) if len(cache) and self is pipe.target else None
        return real_forward(self, cache, feed, keep=keep, **kwargs)

    def forward_tree(self, cache, chain, nodes, ancestors, depths, *args, **kwargs):
        leaves = int((ancestors.sum(0) == 1).sum()) if len(nodes) else 1  # nodes that are no one's ancestor
        shapes.append(list(depths))
        timer.width = len(chain) + len(nodes) + leaves - 1  # each further path costs a token's worth
        return real_tree(self, cache, chain, nodes, ancestors, depths, *args, **kwargs)

    monkeypatch.setattr(type(pipe.target), "forward", forward)
    monkeypatch.setattr(type(pipe.target), "forward_tree", forward_tree)
    monkeypatch.setattr(pipe.drafter, "tree_width", 4, raising=False)
    monkeypatch.setattr(ShapedTimer, "COSTS", {n: 1.0 + 0.1 * (n - 1) for n in range(1, 12)})
    table = measuring.measure(pipe.cost_subject(), clock=timer, repeats=1, max_tokens=6)
    assert table.chain == pytest.approx(tuple(1.0 + 0.1 * n for n in range(6)))
    assert table.tree[:2] == pytest.approx(table.chain[:2])  # a root and one node: nothing branches
    assert all(tree > chain for tree, chain in zip(table.tree[2:], table.chain[2:], strict=True))
    assert any(len(set(depths)) < len(depths) for depths in shapes)  # siblings were timed
    assert measuring.facts(pipe.cost_subject())["tree_shape"] == measuring.TREE_SHAPE  # old tables are remeasured
    assert measuring.tree_shape(5) == [-1, -1, 0, 0, 1]


def _measure_chain(monkeypatch, timer: ShapedTimer):
    """The cost table of a chain drafter's pipeline, its target forwards (after the untimed
    context prefill) timed by ``timer`` from their widths."""
    pipe = tiny_pipeline(drafter="ngram")
    real_forward = type(pipe.target).forward

    def forward(self, cache, feed, keep=1, **kwargs):
        timer.width = len(feed) if len(cache) else None
        return real_forward(self, cache, feed, keep=keep, **kwargs)

    monkeypatch.setattr(type(pipe.target), "forward", forward)
    return measuring.measure(pipe.cost_subject(), clock=timer, repeats=1, max_tokens=6)


def test_a_one_token_forward_read_high_does_not_set_the_unit(monkeypatch):
    """Every 1-token timing read high (a busy machine) must not price longer verifies below a
    plain step: the unit is the fastest forward of any size, and v(n) >= v(1) = 1."""
    monkeypatch.setitem(ShapedTimer.COSTS, 1, 1.5)  # above 2-6 tokens' 1.36-1.6
    table = _measure_chain(monkeypatch, ShapedTimer())
    assert table.chain[0] == 1.0 and min(table.chain) == 1.0
    assert table.chain[3] == pytest.approx(1.0) and table.chain[2] == pytest.approx(1.6 / 1.36)


class HangoverTimer(ShapedTimer):
    """A CPU where a wide forward slows the forward after it: a 1-token forward costs
    ``slow`` after a wider one, 1.0 after a 1-token one."""

    def __init__(self, slow: float):
        super().__init__()
        self.slow, self.previous = slow, 1

    def cost(self, width: int) -> float:
        return self.slow if width == 1 and self.previous > 1 else self.COSTS[width]

    def __call__(self) -> float:
        if self.width is not None:
            self.now, self.previous, self.width = self.now + self.cost(self.width), self.width, None
        return self.now


def test_the_unit_is_a_steady_one_token_forward(monkeypatch):
    """Every 1-token forward of the sweep follows a wide one and reads 1.8 (the CPU's hangover): the
    unit comes from 1-token forwards run back to back instead, so v(n) is each width over plain pace."""
    table = _measure_chain(monkeypatch, HangoverTimer(slow=1.8))
    assert table.chain == pytest.approx(tuple(ShapedTimer.COSTS[n] for n in range(1, 7)))


class SlowStartTimer(HangoverTimer):
    """:class:`HangoverTimer`'s CPU, at half speed for its first ``spell`` forwards."""

    def __init__(self, slow: float, spell: int):
        super().__init__(slow)
        self.spell = spell

    def cost(self, width: int) -> float:
        self.spell -= 1
        return super().cost(width) * (2.0 if self.spell >= 0 else 1.0)


def test_a_slow_spell_at_the_start_does_not_set_the_unit(monkeypatch):
    """The CPU of the test above also runs slow for its first 17 forwards: the unit comes from the
    blocks spread over the sweep, so v(n) is still each width over plain pace (from one block before
    the sweep, the unit would read 1.8, the sweep's own 1-token forwards, and flatten every v(n))."""
    timer = SlowStartTimer(slow=1.8, spell=2 * measuring.STEADY_FORWARDS + 1)  # one block, one round and a bit
    table = _measure_chain(monkeypatch, timer)
    assert table.chain == pytest.approx(tuple(ShapedTimer.COSTS[n] for n in range(1, 7)))


def test_measure_shapes():
    pipe = tiny_pipeline(drafter="tiny")
    table = measuring.measure(pipe.cost_subject(), clock=FakeTimer(), repeats=1, max_tokens=6)
    assert len(table.chain) == 6 and table.tree == ()  # a chain drafter: no tree forwards timed
    assert table.verify(4, tree=True) == table.verify(4) and table.chain[0] == pytest.approx(1.0)
    assert table.draft_per_token >= 0 and table.draft_fixed >= 0
    assert table.facts["threads"] >= 1 and table.facts["dtype"] == "torch.float32"


def test_a_draft_models_catch_up_is_timed_per_token():
    """Every timed span costs one tick: a catch-up of CATCH_UP_TOKENS tokens costs 1/CATCH_UP_TOKENS steps
    a token; a drafter without a model of its own catches up for free."""
    table = measuring.measure(tiny_pipeline(drafter="tiny").cost_subject(), clock=FakeTimer(), repeats=1, max_tokens=6)
    assert table.draft_catch_up == pytest.approx(1 / measuring.CATCH_UP_TOKENS)
    table = measuring.measure(tiny_pipeline(drafter="ngram").cost_subject(), clock=FakeTimer(), repeats=1, max_tokens=6)
    assert table.draft_catch_up == 0.0


def test_cache_is_keyed_and_refreshable(real_cost_table, monkeypatch):
    calls = []

    def fake_measure(pipe, clock=None):
        calls.append(pipe)
        return CostTable(chain=(1.0, 1.5), tree=(1.0, 2.0), step_s=0.01, facts=measuring.facts(pipe))

    monkeypatch.setattr(cost_cache, "measure", fake_measure)
    pipe = tiny_pipeline(drafter="tiny")
    first = table_of(pipe)
    assert list((real_cost_table / "costs").glob("*.json"))
    cost_cache._MEMO.clear()
    assert table_of(pipe) == first and len(calls) == 1  # served from disk
    table_of(pipe, refresh=True)
    assert len(calls) == 2
    other = tiny_pipeline("drafter.num_tokens=2", drafter="tiny")  # a different drafter config: another key
    assert cost_cache.cache_key(measuring.facts(other.cost_subject())) != cost_cache.cache_key(measuring.facts(pipe.cost_subject()))
    table_of(other)
    assert len(calls) == 3
    assert "v(n) chain" in cost_cache.describe(first)
    # compiled forwards cost differently: another key. The key reads the config and the target, not the
    # guarantee, so the load-time invariance check (every verify bucket compiled) is skipped here;
    # tests/test_compile.py runs it.
    monkeypatch.setattr("specgen.engine.assemble._measured", lambda guarantee, *args: guarantee)
    compiled = tiny_pipeline("compile=true", drafter="tiny")
    assert compiled.target.is_compiled
    assert cost_cache.cache_key(measuring.facts(compiled.cost_subject())) != cost_cache.cache_key(measuring.facts(pipe.cost_subject()))


def test_fixed_table_from_the_environment_replaces_measuring(real_cost_table, monkeypatch):
    """$SPECGEN_COST_TABLE: that table for every pipeline, nothing measured or cached; bad files are one line."""
    monkeypatch.setattr(cost_cache, "measure", lambda pipe, clock=None: pytest.fail("measured despite a fixed table"))
    path = real_cost_table / "fixed.json"
    path.write_text(json.dumps(cost_cache.to_dict(TEST_COSTS)))
    monkeypatch.setenv(cost_cache.FIXED_TABLE_ENV, str(path))
    pipe = tiny_pipeline(drafter="tiny")
    assert table_of(pipe) == TEST_COSTS
    assert table_of(pipe, refresh=True) == TEST_COSTS
    assert not (real_cost_table / "costs").exists()
    for content, message in ((None, "cannot read"), ("{}", "not a cost table"), ('{"chain": [1', "not a cost table")):
        if content is not None:
            path.write_text(content)
        monkeypatch.setenv(cost_cache.FIXED_TABLE_ENV, str(path) if content else str(real_cost_table / "missing"))
        with pytest.raises(ConfigError, match=message) as caught:
            table_of(pipe)
        assert "SPECGEN_COST_TABLE" in str(caught.value) and "\n" not in str(caught.value)


def test_corrupt_cache_file_is_remeasured(real_cost_table, monkeypatch):
    monkeypatch.setattr(cost_cache, "measure", lambda pipe, clock=None: CostTable(chain=(1.0,), tree=(1.0,)))
    pipe = tiny_pipeline(drafter="ngram")
    path = real_cost_table / "costs" / f"{cost_cache.cache_key(measuring.facts(pipe.cost_subject()))}.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert table_of(pipe).chain == (1.0,)


def test_cache_file_is_replaced_whole(real_cost_table, monkeypatch):
    """Two processes sharing the cache: a reader sees the old table or the new one, never a torn file.
    The new table is written beside the old one and renamed over it, so a write that fails before the
    rename leaves the old file as it was and no temporary file behind."""
    monkeypatch.setattr(cost_cache, "measure", lambda pipe, clock=None: CostTable(chain=(1.0,), tree=(1.0,)))
    pipe = tiny_pipeline(drafter="ngram")
    path = real_cost_table / "costs" / f"{cost_cache.cache_key(measuring.facts(pipe.cost_subject()))}.json"
    assert table_of(pipe).chain == (1.0,)
    before = path.read_text()

    def failing_rename(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cost_cache.os, "replace", failing_rename)
    monkeypatch.setattr(cost_cache, "measure", lambda pipe, clock=None: CostTable(chain=(2.0,), tree=(2.0,)))
    assert table_of(pipe, refresh=True).chain == (2.0,)  # served, though not cached
    assert path.read_text() == before
    assert [entry.name for entry in path.parent.iterdir()] == [path.name]


def test_measuring_the_cost_table_is_not_part_of_a_requests_time(monkeypatch):
    """The one-off measurement happens before the request's clock starts (a fake clock: no timing)."""
    import specgen.engine.pipeline

    now = [0.0]
    monkeypatch.setattr(specgen.engine.pipeline.time, "perf_counter", lambda: now[0])

    def slow_measurement(pipe, **kwargs):
        now[0] += 100.0  # a measurement that "takes" 100 s
        return TEST_COSTS

    monkeypatch.setattr("specgen.planning.cost_cache.cost_table", slow_measurement)
    pipe = tiny_pipeline(drafter="tiny")
    gen = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=8)
    assert pipe.drafter.num_tokens == "auto" and pipe.costs is TEST_COSTS
    assert now[0] == 100.0  # measured exactly once
    assert gen.stats.wall < 100.0 and gen.stats.ttft < 100.0


def test_measure_batch_shapes(monkeypatch):
    """The batched table: every measured (rows, width) cell, in units of its 1 x 1 forward."""
    pipe = tiny_pipeline(drafter="ngram")
    table = measuring.measure_batch(pipe.cost_subject(), 3, new_batch(pipe), clock=FakeTimer(), max_width=4)
    assert table.sizes == (1, 2, 3) and table.widths == (1, 2, 3, 4)
    assert table.body[0][0] == pytest.approx(1.0) and table.head == 0.0
    assert len(table.wide) == 3 and table.slots[1] > table.slots[0] > 0  # a compacted and a wide cache
    assert len(table.ragged) == 3 and all(len(line) == 4 for line in table.ragged)
    assert table.ragged[0] == table.body[0] and [line[0] for line in table.ragged] == [line[0] for line in table.body]
    assert table.facts["batch_size"] == 3


def test_measure_batch_reads_its_cells_from_a_fit(monkeypatch):
    """Timings with one shape read high (2 rows x 1 token) still give a table that never falls with
    more rows or width, ragged forwards no dearer than uniform ones, the wide cache no cheaper."""
    pipe = tiny_pipeline(drafter="ngram")
    timer = SpanTimer()
    real_forward = BatchKV.forward

    def forward(self, feeds, keeps):
        rows = [len(f) for f in feeds if f]
        b, w, tokens = len(rows), max(rows), sum(rows)
        timer.span = (1.0 + 0.1 * tokens + 0.05 * b + 0.02 * b * w) * (1.6 if (b, w) == (2, 1) else 1.0)
        return real_forward(self, feeds, keeps)

    monkeypatch.setattr(BatchKV, "forward", forward)
    table = measuring.measure_batch(pipe.cost_subject(), 4, new_batch(pipe), clock=timer, max_width=3)
    assert table.body[1][0] < table.body[1][1]  # 2 x 1 no longer priced above 2 x 2
    for body, ragged, wide in zip(table.body, table.ragged, table.wide, strict=True):
        assert list(body) == sorted(body) and all(r <= u + 1e-12 <= x + 2e-12 for r, u, x in zip(ragged, body, wide))
    for column in zip(*table.body, strict=True):
        assert list(column) == sorted(column)
    assert table.body[0][0] == pytest.approx(1.0)


class SpanTimer:
    """A clock that advances by ``span`` (set by the code under test) at the reading after it is set."""

    def __init__(self):
        self.now, self.span = 0.0, None

    def __call__(self) -> float:
        if self.span is not None:
            self.now, self.span = self.now + self.span, None
        return self.now


def test_batch_table_is_cached_and_fixed_by_the_environment(real_cost_table, monkeypatch):
    monkeypatch.setattr(cost_cache, "batch_cost_table", _ORIGINAL_BATCH)
    calls = []
    made = BatchCostTable((1, 4), (1, 9), ((1.0, 2.0), (2.0, 5.0)), 0.01, 0.01)
    monkeypatch.setattr(cost_cache, "measure_batch", lambda subject, size, new, **kwargs: calls.append(size) or made)
    pipe = tiny_pipeline(drafter="ngram")
    assert batch_costs(pipe, 4) == made
    cost_cache._MEMO.clear()
    assert batch_costs(pipe, 4) == made and calls == [8]  # served from disk
    assert batch_costs(pipe, 7) == made and batch_costs(pipe, 1) == made
    assert calls == [8]  # one table serves every batch up to 8 rows (a run's last, smaller batch included)
    assert batch_costs(pipe, 9) == made and batch_costs(pipe, 64) == made and batch_costs(pipe, 10**6) == made
    assert calls == [8]  # and every larger one: measured with at most MAX_MEASURED_ROWS rows
    assert "B=4: 2.00 5.00" in cost_cache.describe_batch(made)
    path = real_cost_table / "fixed.json"
    path.write_text(json.dumps(cost_cache.to_dict(TEST_COSTS)))
    monkeypatch.setenv(cost_cache.FIXED_TABLE_ENV, str(path))
    assert batch_costs(pipe, 8) == BatchCostTable.from_chain(TEST_COSTS.chain, (1, 2, 4, 8))
    path.write_text(json.dumps(dict(cost_cache.to_dict(TEST_COSTS), batch=cost_cache.to_dict(made))))
    assert batch_costs(pipe, 8) == made and calls == [8]
    path.write_text(json.dumps(dict(cost_cache.to_dict(TEST_COSTS), batch={"sizes": [1]})))
    with pytest.raises(ConfigError, match="not a batch cost table"):
        batch_costs(pipe, 8)



def test_batch_table_prices_the_shared_width_between_its_two_measurements():
    table = BatchCostTable((1, 8), (1, 2), ((1.0, 1.2), (1.5, 2.0)), 0.01, 0.02,
                           wide=((1.4, 2.0), (3.0, 5.0)), slots=(100, 800))
    assert table.at(100).body == table.body and table.at(50).body == table.body  # never below the narrow one
    def flat(t):
        return [v for line in t.body for v in line]

    assert flat(table.at(450)) == pytest.approx([1.2, 1.6, 2.25, 3.5])
    assert flat(table.at(1500)) == pytest.approx([1.8, 2.8, 4.5, 8.0])  # continued past the wide one
    assert table.at(800).verify(8, 2) == pytest.approx(5.0) and table.at(800).head == 0.01
    single = BatchCostTable((1, 8), (1, 2), ((1.0, 1.2), (1.5, 2.0)))
    assert single.at(5000) is single
    again = cost_cache.from_dict(BatchCostTable, json.loads(json.dumps(cost_cache.to_dict(table))))
    assert again == table and again.wide == table.wide and again.slots == (100, 800)
    ragged = BatchCostTable((1, 8), (1, 2), ((1.0, 1.2), (1.5, 2.0)), ragged=((1.0, 1.2), (1.5, 1.7)))
    assert cost_cache.from_dict(BatchCostTable, json.loads(json.dumps(cost_cache.to_dict(ragged)))).ragged == ragged.ragged
    assert "one row w wide, the others 1: B=1: 1.00 1.20; B=8: 1.50 1.70" in cost_cache.describe_batch(ragged)
    assert "800 slots: B=1: 1.40 2.00" in cost_cache.describe_batch(table)
    with pytest.raises(ValueError, match="wide"):
        cost_cache.from_dict(BatchCostTable, dict(cost_cache.to_dict(table), slots=[100]))


def test_measure_batch_is_clamped_for_a_big_batch():
    """A batch of 64 rows is measured on caches of at most MAX_MEASURED_ROWS rows (memory and time
    bounded), its bigger sizes priced by the fit's continuation, with progress reported."""
    pipe = tiny_pipeline(drafter="ngram")
    made, lines = [], []

    def new(rows):
        made.append(rows)
        return BatchKV(pipe.target, rows)

    table = measuring.measure_batch(pipe.cost_subject(), 64, new, clock=FakeTimer(), repeats=1, max_width=3,
                                    progress=lines.append)
    assert made and max(made) == measuring.MAX_MEASURED_ROWS == table.sizes[-1]
    assert table.facts["batch_size"] == measuring.MAX_MEASURED_ROWS and len(lines) == 2
    four, eight = table.verify(4, 2), table.verify(8, 2)
    assert table.verify(64, 2) == pytest.approx(eight + (eight - four) * 14)  # linear past the measured rows


def test_old_or_torn_cache_files_are_measured_over(real_cost_table, monkeypatch, capsys):
    """A cache file of another format (an older method's fields, a list, a torn write) is measured
    over, never an error; the measurement says so on stderr."""
    made = BatchCostTable((1, 8), (1, 9), ((1.0, 2.0), (2.0, 5.0)), 0.01, 0.01)
    monkeypatch.setattr(cost_cache, "batch_cost_table", _ORIGINAL_BATCH)
    monkeypatch.setattr(cost_cache, "measure", lambda subject, clock=None: CostTable(chain=(1.0, 1.25), tree=()))
    monkeypatch.setattr(cost_cache, "measure_batch", lambda subject, size, new, **kwargs: made)
    pipe = tiny_pipeline(drafter="ngram")
    subject = pipe.cost_subject()
    costs = real_cost_table / "costs"
    costs.mkdir()
    single = costs / f"{cost_cache.cache_key(measuring.facts(subject))}.json"
    batch = costs / f"batch-{cost_cache.cache_key(measuring.batch_facts(subject, 8))}.json"
    for old in ('{"sizes": [1, 8], "widths": [1], "body": [[1.0]]}', "[1, 2]", '{"chain": [1.0, "x"], "tree": []}'):
        single.write_text(old)
        batch.write_text(old)
        cost_cache._MEMO.clear()
        assert table_of(pipe).chain == (1.0, 1.25)
        assert batch_costs(pipe, 8) == made
    assert "measuring the batched cost table" in capsys.readouterr().err
    cost_cache._MEMO.clear()
    assert cost_cache.from_dict(CostTable, json.loads(single.read_text())) == CostTable(chain=(1.0, 1.25), tree=())
    assert cost_cache.from_dict(BatchCostTable, json.loads(batch.read_text())) == made
