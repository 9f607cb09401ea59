"""Grammar work as its own stage of the time split, and mask time per position.

Fake timers only: no assertion depends on how fast this machine is.
"""

from __future__ import annotations

import itertools
import time
from array import array

import pytest
import torch
from conftest import tiny_pipeline
from grammar_helpers import history

import specgen.grammar
from specgen.batch import generate_batch
from specgen.cli.main import summary_line
from specgen.grammar import TokenAutomaton, grammar_processor
from specgen.grammar import backend as grammar_backend
from specgen.models.tiny import TinyTokenizer
from specgen.models.tokenizer import TokenizerInfo
from specgen.engine.round import plain_step, speculative_round
from specgen.stats import Clock, GrammarTimer, percentile

PATTERN = "[eaoiu]{3,10}( [tnshrdlcm]{1,4}){0,3}"  # over the tiny models' alphabet
SLOW = 100.0  # fake seconds each slowed grammar call takes


@pytest.fixture(autouse=True)
def grammar_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(grammar_backend, "cache_dir", lambda: tmp_path / "grammars")
    specgen.grammar._compiled.clear()


def ticking_clock() -> Clock:
    """A clock whose every reading is one fake second after the previous one."""
    ticks = itertools.count()
    return Clock(torch.device("cpu"), timer=lambda: float(next(ticks)))


def regex_proc(info: TokenizerInfo, pattern: str = PATTERN):
    return grammar_processor({"kind": "regex", "pattern": pattern}, info)


def test_carve_moves_seconds_out_of_the_open_stage():
    clock = ticking_clock()
    with clock.stage("process"):  # tick 0
        clock.carve("grammar", 0.25)
    laps = clock.take_laps()  # process ends at tick 1
    assert laps == {"process": 0.75, "grammar": 0.25}
    clock.carve("grammar", 2.0)  # outside any stage: charged as it is
    assert clock.take_laps() == {"grammar": 2.0}


def test_processor_call_is_charged_to_grammar_and_split_over_its_positions():
    info = TokenizerInfo(TinyTokenizer(16))
    clock, samples = ticking_clock(), array("d")
    proc = regex_proc(info).timed(GrammarTimer(clock, samples))
    e, a = (info.tokenizer.encode(ch)[0] for ch in "ea")
    with clock.stage("process"):  # tick 0
        proc(torch.zeros(3, 16), history(info, [1], [e], [a, e]))  # start 1, rows end at 2, 3, 4, call ends at 5
    laps = clock.take_laps()  # process resumes at 5, ends at 6
    assert laps == {"process": 2.0, "grammar": 4.0}, "the grammar's 4 ticks are not also charged to process"
    assert list(samples) == pytest.approx([4 / 3] * 3), "each row's tick plus a third of the masked fill"
    assert sum(samples) == pytest.approx(laps["grammar"])


def test_masking_waits_for_the_device_and_walking_states_does_not(monkeypatch):
    """On a CUDA clock a processor call is bracketed by device syncs (queued work stays with the
    outer stage, its own masking with the grammar); host-only grammar work reads no sync."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    ticks = itertools.count()
    timer = GrammarTimer(Clock(torch.device("cuda:0"), timer=lambda: float(next(ticks))), array("d"))
    info = TokenizerInfo(TinyTokenizer(16))
    proc = regex_proc(info).timed(timer)
    proc(torch.zeros(2, 16), history(info, [1], [], [2]))
    assert len(syncs) == 2 and len(timer.samples) == 2
    timer.spent(timer.now())
    assert len(syncs) == 2


def test_timed_grammar_gives_the_same_masks():
    info = TokenizerInfo(TinyTokenizer(16))
    plain = regex_proc(info)
    timed = plain.timed(GrammarTimer(Clock(torch.device("cpu")), array("d")))
    for generated, candidates in (([], [2, 4, 2]), ([2, 4], [1, 3]), ([2, 4, 5], [3, 3, 3])):
        raw = torch.randn(len(candidates) + 1, 16)
        h = history(info, [9], generated, candidates)
        assert torch.equal(plain(raw.clone(), h), timed(raw.clone(), h))


def test_percentile_is_nearest_rank():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert percentile(list(range(1, 101)), 0.99) == 99


@pytest.mark.parametrize("speculative", [True, False])
def test_grammar_stage_is_charged_only_under_a_grammar(speculative):
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3")
    constrained = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=12, seed=0, regex=PATTERN,
                                speculative=speculative)
    stats = constrained.stats
    assert stats.timings.grammar > 0 and len(stats.mask_seconds) >= stats.new_tokens
    assert stats.grammar_share is not None and "grammar" in summary_line(constrained)
    summary = stats.to_dict()
    assert summary["mask_positions"] == len(stats.mask_seconds) and summary["mask_p99_s"] >= summary["mask_p50_s"]
    free = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=12, seed=0, speculative=speculative)
    assert free.stats.timings.grammar == 0.0 and not free.stats.mask_seconds
    assert free.stats.grammar_share is None and "grammar" not in summary_line(free)
    assert free.stats.to_dict()["mask_p50_s"] is None


@pytest.mark.parametrize("drafter", ["tiny", "ngram"])
def test_grammar_time_is_taken_out_of_draft_and_process(drafter, monkeypatch):
    """Every grammar call takes SLOW fake seconds: they land in "grammar", not in draft or process."""
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3", drafter=drafter)
    pipe.stack = pipe.stack.with_grammar(regex_proc(pipe.tokenizer))
    offset, calls = [0.0], [0]
    mask, forced = TokenAutomaton.mask, TokenAutomaton.forced_bytes

    def slow(original):
        def wrapper(self, *args, **kwargs):
            offset[0] += SLOW
            calls[0] += 1
            return original(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(TokenAutomaton, "mask", slow(mask))
    monkeypatch.setattr(TokenAutomaton, "forced_bytes", slow(forced))
    request, ctx = pipe.open_request([4, 3, 8, 4, 3, 2, 2], max_new_tokens=10, seed=0)
    ctx.clock.timer = lambda: time.perf_counter() + offset[0]
    while request.finish_reason is None:
        speculative_round(request, ctx, 3)
    timings = ctx.stats.timings
    assert calls[0] > 0 and timings.grammar >= SLOW * calls[0]
    assert timings.draft < SLOW and timings.process < SLOW and timings.verify < SLOW and timings.commit < SLOW
    samples = ctx.stats.mask_seconds
    assert max(samples) >= SLOW and sum(samples) <= timings.grammar + 1e-6
    if drafter == "tiny":  # all grammar work is processor calls (q and p): the samples add up to it
        assert sum(samples) == pytest.approx(timings.grammar, rel=1e-9)


def test_plain_steps_charge_grammar_out_of_process(monkeypatch):
    pipe = tiny_pipeline("sampling.temperature=0")
    pipe.stack = pipe.stack.with_grammar(regex_proc(pipe.tokenizer))
    offset = [0.0]
    mask = TokenAutomaton.mask

    def slow(self, *args, **kwargs):
        offset[0] += SLOW
        return mask(self, *args, **kwargs)

    monkeypatch.setattr(TokenAutomaton, "mask", slow)
    request, ctx = pipe.open_request([1, 2, 3], max_new_tokens=4, seed=0, use_spec=False)
    ctx.clock.timer = lambda: time.perf_counter() + offset[0]
    for _ in range(4):
        plain_step(request, ctx)
    timings = ctx.stats.timings
    assert timings.grammar >= 4 * SLOW and timings.process < SLOW and len(ctx.stats.mask_seconds) == 4


def test_batched_rows_meter_their_own_grammar():
    pipe = tiny_pipeline()  # greedy: a batched row equals its single run
    prompts = [[1, 2, 3], [4, 3, 8, 4], [5, 5, 6]]
    rows = generate_batch(pipe, [{"prompt_ids": p} for p in prompts], batch_size=2, max_new_tokens=10,
                          regex=PATTERN)
    for prompt, gen in zip(prompts, rows, strict=True):
        assert gen.token_ids == pipe.generate(prompt_ids=prompt, max_new_tokens=10, regex=PATTERN).token_ids
        assert gen.stats.timings.grammar > 0 and len(gen.stats.mask_seconds) >= gen.stats.new_tokens
