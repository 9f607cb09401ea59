"""The cost table corrected by a run's own verify forwards (specgen.planning.observed).

Timings are fed by hand or by a fake clock that advances only inside the target's
forward, so nothing here depends on this machine's speed.
"""

from __future__ import annotations

import pytest

import specgen
from conftest import TINY
from specgen.planning import AcceptanceHistory, CostTable, plan_budget
from specgen.planning.observed import ObservedCosts
from specgen.planning.cost_cache import FIXED_TABLE_ENV, observer
from specgen.stats import Clock

TABLE = CostTable(chain=(1.0, 1.4, 1.8, 2.2), tree=())


def _run(observed: ObservedCosts, seconds_by_width: dict[int, float], rounds: int, table: CostTable = TABLE):
    for _ in range(rounds):
        for width, seconds in seconds_by_width.items():
            observed.observe(width, seconds, table)


def test_no_wide_forwards_leave_the_table_as_measured():
    observed = ObservedCosts()
    _run(observed, {1: 0.01}, 50)
    assert observed.scale == 1.0 and observed.table(TABLE) is TABLE
    assert observed.step_s == pytest.approx(0.01)


def test_wide_forwards_dearer_than_tabled_scale_the_excess():
    observed = ObservedCosts()
    _run(observed, {1: 0.010, 2: 0.018}, 200)  # in-run v(2) = 1.8 against the table's 1.4
    assert observed.scale == pytest.approx(2.0, abs=0.03)
    corrected = observed.table(TABLE)
    assert corrected.chain[0] == 1.0
    assert corrected.chain[1] == pytest.approx(1.8, abs=0.02)
    assert corrected.chain[3] == pytest.approx(1.0 + 2.0 * 1.2, abs=0.05)  # unobserved widths scale alike
    assert corrected.tree == TABLE.tree and corrected.draft_per_token == TABLE.draft_per_token
    assert observed.table(TABLE) is corrected  # one table per scale step, reused


def test_cheaper_wide_forwards_lower_the_excess():
    observed = ObservedCosts()
    _run(observed, {1: 0.010, 3: 0.014}, 200)  # in-run v(3) = 1.4 against 1.8
    assert observed.scale == pytest.approx(0.5, abs=0.03)
    assert observed.table(TABLE).chain[2] == pytest.approx(1.4, abs=0.02)


def test_the_prior_holds_the_scale_until_evidence_comes_and_a_stall_is_clipped():
    observed = ObservedCosts()
    _run(observed, {1: 0.010}, 10)
    observed.observe(2, 5.0, TABLE)  # a 500x stall counts as clip * v(2)
    prior, decay = observed.prior, observed.decay
    assert observed.scale == pytest.approx((prior * decay + observed.clip * 1.4 - 1) / (prior * decay + 0.4))
    cold = ObservedCosts()
    cold.observe(2, 0.5, TABLE)  # before any 1-token forward: no ratio to take
    assert cold.scale == 1.0 and cold.observed_excess == cold.prior


def test_the_step_time_follows_a_machine_that_slows_down():
    observed = ObservedCosts()
    _run(observed, {1: 0.010}, 20)
    _run(observed, {1: 0.015}, 1)  # one sample moves it part of the way
    assert 0.010 < observed.step_s < 0.015
    _run(observed, {1: 0.015}, 40)
    assert observed.step_s == pytest.approx(0.015, rel=1e-3)
    _run(observed, {1: 10.0}, 1)  # a stall moves it at most to 2 x its mean
    assert observed.step_s <= 0.015 * (1 + 2 * (1 - observed.step_decay))


def test_the_corrected_table_changes_the_plan():
    """At 0.6 conditional acceptance a 1-token draft pays at v(2) = 1.4 (1.6 / 1.4 > 1) but not at 1.8."""
    history = AcceptanceHistory()
    for _ in range(200):
        history.observe([None], 1)
        history.observe([None], 1)
        history.observe([None], 0)
    table = CostTable(chain=(1.0, 1.4, 2.4, 3.4), tree=())
    assert plan_budget(table, history, 3) == 1
    observed = ObservedCosts()
    _run(observed, {1: 0.010, 2: 0.018}, 200, table)
    assert plan_budget(observed.table(table), history, 3) == 0


def test_a_fixed_table_or_observe_costs_false_plans_from_the_table_alone(monkeypatch):
    assert isinstance(observer(True), ObservedCosts)
    assert observer(False) is None
    monkeypatch.setenv(FIXED_TABLE_ENV, "table.json")
    assert observer(True) is None
    with pytest.raises(specgen.ConfigError, match="observe_costs"):
        specgen.pipeline(*TINY, "observe_costs=maybe", progress=False)


def test_a_run_whose_wide_forwards_cost_more_drafts_less_and_says_the_same(monkeypatch):
    """Each forward of n tokens costs (2n - 1) ms on a fake clock, far above the test table's
    v(n): with observation the planner drafts less, and greedy output stays plain's."""
    pipe = specgen.pipeline(*TINY, "drafter=ngram", "drafter.num_tokens=auto", "max_new_tokens=48",
                            "sampling.temperature=0")
    now = [0.0]
    forward = pipe.target.forward

    def slow_forward(cache, tokens, *args, **kwargs):
        now[0] += 1e-3 * (2 * len(tokens) - 1)
        return forward(cache, tokens, *args, **kwargs)

    monkeypatch.setattr(pipe.target, "forward", slow_forward)
    monkeypatch.setattr("specgen.engine.pipeline.Clock", lambda device: Clock(device, timer=lambda: now[0]))
    prompt = "one two three four one two three four one two three four one two"
    blind = pipe.generate(prompt)
    pipe.observed = ObservedCosts()
    plain = pipe.generate(prompt, speculative=False).token_ids  # its steps give the 1-token time
    assert pipe.observed.steps > pipe.observed.warm and pipe.observed.scale == 1.0
    seen = pipe.generate(prompt)
    assert pipe.observed.scale > 5
    assert blind.token_ids == plain and seen.token_ids == plain
    assert seen.stats.drafted < blind.stats.drafted
