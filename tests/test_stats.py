"""Stats bookkeeping and the stage clock, with an injected timer (no timed asserts)."""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch

from conftest import tiny_pipeline
from specgen.engine.round import speculative_round
from specgen.stats import Clock, RoundResult, Stats


def _clock(device="cpu") -> Clock:
    ticks = itertools.count()
    return Clock(torch.device(device), timer=lambda: float(next(ticks)))


def test_clock_synchronises_the_pipelines_own_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    clock = _clock("cuda:1")
    clock()
    assert calls == [torch.device("cuda:1")]
    _clock("cpu")()
    assert len(calls) == 1


def test_nested_stage_pauses_the_outer_one():
    clock = _clock()
    with clock.stage("process"):  # tick 0
        with clock.stage("verify"):  # tick 1 charges 1 to process, tick 2 ends verify
            pass
    laps = clock.take_laps()  # process resumed at 2, ended at 3
    assert laps == {"process": 2.0, "verify": 1.0}
    assert clock.take_laps() == {}


def test_record_and_planner_summary():
    stats = Stats()
    stats.record(RoundResult(3, 2, 3, planned=True, timings={"draft": 0.5, "verify": 1.0}))
    stats.record(RoundResult(0, 0, 0, planned=True))
    stats.record(RoundResult(speculative=False, timings={"verify": 1.0}))
    assert stats.rounds == 3 and stats.target_calls == 3 and stats.drafted == 3 and stats.accepted == 2
    assert stats.timings.verify == 2.0 and stats.timings.draft == 0.5
    assert stats.draft_size_counts == [1, 0, 0, 1]
    assert stats.planner_summary == "γ auto: mean 1.5, plain steps 50%"
    assert Stats().planner_summary is None


def test_tree_round_charges_the_lazy_lm_head_to_verify(monkeypatch):
    """The tree path's logits are computed while accepting: that time is verify, not process."""
    from specgen.models.causal_lm import TreeOutput

    pipe = tiny_pipeline("sampling.temperature=0", "drafter.num_tokens=2", drafter="ngram")
    request, ctx = pipe.open_request([1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=6, seed=0)
    ctx = dataclasses.replace(ctx, feature_layers=[])  # take the tree path (RoundContext is frozen)
    logits, offset = TreeOutput.logits, [0.0]
    ctx.clock.timer = lambda: time.perf_counter() + offset[0]

    def slow_logits(self, row):
        offset[0] += 100.0  # each LM-head call takes 100 fake seconds
        return logits(self, row)

    monkeypatch.setattr(TreeOutput, "logits", slow_logits)
    speculative_round(request, ctx, 2)
    assert ctx.stats.timings.verify >= 100 and ctx.stats.timings.process < 100


@pytest.mark.parametrize("value", ["auto", "AUTO", 3])
def test_drafter_num_tokens_accepts_auto(value):
    pipe = tiny_pipeline(f"drafter.num_tokens={value}", drafter="ngram")
    assert pipe.drafter.num_tokens == (3 if value == 3 else "auto")
    assert pipe.drafter.max_tokens == (3 if value == 3 else pipe.drafter.auto_max_tokens)
