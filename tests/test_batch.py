"""The batched engine (specgen.batch): per-row equivalence with single-request runs.

Greedy rows must equal single-request greedy output token for token (float32,
ragged prompts, refills); sampled rows must follow the exact law of their own
request (chi-square against exact_distribution) while sharing forwards with rows
that use other processors, grammars, seeds and lengths; a failed step must roll
every row back. The online scheduler (BatchScheduler) admits rows while others
run and cancels rows between steps, leaving the other rows' outputs unchanged.
"""

from __future__ import annotations

import re
import threading
from collections import Counter

import pytest
import torch
from conftest import TINY, tiny_pipeline
from exact import exact_distribution, goodness_of_fit

import specgen
import specgen.grammar
from specgen.batch import BatchScheduler, Cancelled, StepError, admit, prepare, step
from specgen.models.batch_kv import BatchKV
from specgen.errors import ConfigError, PromptError
from specgen.events import FinishEvent, TokenEvent
from specgen.grammar import backend as grammar_backend

TINY_REGEX = "(at|ta)[en]{0,3}"  # over the tiny alphabet: ids a=4, t=3, e=2, n=7
NUM_SAMPLES = 500  # per row kind; rows share forwards, so each kind costs one drafting run per seed
MIN_P_VALUE = 1e-3


@pytest.fixture(autouse=True)
def grammar_cache(tmp_path, monkeypatch):
    """Compiled grammars go to a per-test directory; the in-memory cache starts empty."""
    monkeypatch.setattr(grammar_backend, "cache_dir", lambda: tmp_path / "grammars")
    specgen.grammar._compiled.clear()


def _ragged_prompts(count: int) -> list[dict]:
    """Prompts of 1..6 tokens with 2..12 new tokens each (different lengths in every batch)."""
    return [dict(prompt_ids=[1 + (3 * i + j) % 15 for j in range(1 + i % 6)], max_new_tokens=2 + (5 * i) % 11)
            for i in range(count)]


@pytest.mark.parametrize("drafter", ["none", "ngram", "tiny"])
def test_greedy_rows_equal_single_requests(drafter):
    pipe = tiny_pipeline("drafter.num_tokens=3", drafter=drafter) if drafter != "none" else \
        tiny_pipeline(drafter="none")
    prompts = _ragged_prompts(9)
    prompts[4]["speculative"] = False  # a plain row among speculating ones
    single = [pipe.generate(**p) for p in prompts]
    batch = pipe.generate_batch(prompts, batch_size=4)  # 9 prompts through 4 rows: refills
    assert [g.token_ids for g in batch] == [g.token_ids for g in single]
    assert [g.finish_reason for g in batch] == [g.finish_reason for g in single]
    assert [g.prompt_ids for g in batch] == [p["prompt_ids"] for p in prompts]
    assert [len(g.token_ids) for g in batch] != [len(batch[0].token_ids)] * len(batch), "ragged lengths"
    if drafter != "none":
        assert sum(g.stats.drafted for g in batch) > 0, "rows must actually speculate"
        assert batch[4].stats.drafted == 0 and str(batch[4].guarantee) == "off: speculative=false"


def test_rows_with_different_grammars_and_seeds_follow_their_own_law():
    """Row kinds interleave in one batch: a regex-constrained speculative row, an
    unconstrained speculative row and a plain row, each over many seeds."""
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3")
    prompt = [1, 2, 3]
    kinds = [dict(regex=TINY_REGEX, max_new_tokens=6), dict(max_new_tokens=3), dict(max_new_tokens=4, speculative=False)]
    prompts = [dict(prompt_ids=prompt, seed=seed, **kind) for seed in range(NUM_SAMPLES) for kind in kinds]
    gens = pipe.generate_batch(prompts, batch_size=6)
    constrained, free = gens[0::3], gens[1::3]
    for gen in constrained:
        assert gen.token_ids[-1] == 0 and re.fullmatch(TINY_REGEX, pipe.tokenizer.decode(gen.token_ids))
    assert sum(g.stats.drafted for g in constrained) > 0 and sum(g.stats.drafted for g in free) > 0
    for seed in range(0, NUM_SAMPLES, 25):  # same seed, same RNG draws: a row reproduces its single-request run
        for offset, kind in enumerate(kinds):
            single = pipe.generate(prompt_ids=prompt, seed=seed, **kind)
            assert gens[3 * seed + offset].token_ids == single.token_ids
    cases = [(constrained, 6, pipe._stack_for(None, TINY_REGEX)), (free, 3, pipe.stack)]
    for rows, length, stack in cases:
        expected = exact_distribution(pipe, prompt, length, stack=stack)
        counts = Counter(tuple(gen.token_ids) for gen in rows)
        p_value, tv = goodness_of_fit(counts, expected)
        assert p_value > MIN_P_VALUE, f"length {length}: chi-square p={p_value:.2e}, TV={tv:.3f}"


def _state(row):
    request = row.request
    return (list(request.committed.tokens), list(request.target_cache.tokens), list(request.target_cache.slots),
            request.target_rng.get_state().clone(), request.text.text, request.finish_reason)


def test_failed_step_rolls_every_row_back_and_the_batch_continues(monkeypatch):
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3")
    prompts = [dict(prompt_ids=[1, 2, 3][: 1 + i], max_new_tokens=8, seed=i) for i in range(3)]
    expected = [g.token_ids for g in pipe.generate_batch(prompts, batch_size=3)]

    kv = BatchKV(pipe.target, 3)
    rows = [admit(pipe, kv, r, prepare(pipe, p, None, r)) for r, p in enumerate(prompts)]
    step(kv, list(enumerate(rows)))
    kv.maybe_compact()  # what the next step does first, outside its transaction
    before = [_state(row) for row in rows]
    width = kv.width
    last_layer = pipe.target.model.model.layers[-1]

    def fail(module, args):
        raise RuntimeError("injected failure in the batched forward")

    handle = last_layer.register_forward_pre_hook(fail)  # earlier layers have already written the cache
    with pytest.raises(RuntimeError, match="injected"):
        step(kv, list(enumerate(rows)))
    handle.remove()
    for row, old in zip(rows, before, strict=True):
        new = _state(row)
        assert new[:3] == old[:3] and new[4:] == old[4:]
        assert torch.equal(new[3], old[3]), "the RNG is restored"
    assert kv.width == width
    assert all(layer.keys.shape[-2] == width for layer in kv.cache.layers), "partly written slots are cut"
    while any(row.request.finish_reason is None for row in rows):
        step(kv, [(r, row) for r, row in enumerate(rows) if row.request.finish_reason is None])
    assert [list(row.request.generated) for row in rows] == expected


def test_compaction_keeps_outputs():
    """Compacting at every step (slots gathered left-aligned) changes nothing."""
    pipe = tiny_pipeline("drafter.num_tokens=3", drafter="ngram")
    prompts = _ragged_prompts(5)
    expected = [g.token_ids for g in pipe.generate_batch(prompts, batch_size=3)]
    kv = BatchKV(pipe.target, 3)
    rows = [admit(pipe, kv, r, prepare(pipe, p, None, r)) for r, p in enumerate(prompts[:3])]
    compacted = 0
    while any(row.request.finish_reason is None for row in rows):
        kv.compact()
        compacted += 1
        assert kv.width == max(len(row) for row in kv.rows)
        step(kv, [(r, row) for r, row in enumerate(rows) if row.request.finish_reason is None])
    assert compacted > 1
    assert [list(row.request.generated) for row in rows] == expected[:3]


def test_trim_and_tight_compaction_keep_outputs_and_the_cache_narrow():
    """Each step first trims the slots no row lists off the end and compacts once dead slots
    pass an eighth of the longest row: outputs are unchanged and the shared cache stays
    within that bound of the longest row."""
    pipe = tiny_pipeline("drafter.num_tokens=4", drafter="ngram")
    prompts = _ragged_prompts(3)
    expected = [g.token_ids for g in pipe.generate_batch(prompts, batch_size=3)]
    kv = BatchKV(pipe.target, 3)
    rows = [admit(pipe, kv, r, prepare(pipe, p, None, r)) for r, p in enumerate(prompts)]
    trimmed = 0
    while any(row.request.finish_reason is None for row in rows):
        before = kv.width
        kv.maybe_compact()
        listed = [row.slots for row in kv.rows if row.slots]
        if listed:
            longest = max(len(row) for row in kv.rows)
            assert kv.width == max(slots[-1] + 1 for slots in listed), "nothing unlisted at the end"
            assert kv.width <= longest + max(16, longest // 8)
        trimmed += kv.width < before
        step(kv, [(r, row) for r, row in enumerate(rows) if row.request.finish_reason is None])
    assert trimmed > 0
    assert [list(row.request.generated) for row in rows] == expected


def test_a_refill_takes_over_dead_slots_and_appends_in_place():
    """A fresh row's prompt goes into its batch entry's dead slots first (a refill costs no
    width), the rest into the shared buffers' spare capacity (no copy of the other rows);
    other rows' entries stay as they were and the row's slots hold exactly the keys/values
    of its own forward."""
    pipe = tiny_pipeline()
    kv = BatchKV(pipe.target, 2)
    assert kv.prefill(0, [1, 2, 3, 4, 5]) and kv.prefill(1, [6, 7, 8, 9, 10, 11])
    assert kv.width == 6 and kv.rows[1].slots == [0, 1, 2, 3, 4, 5], "5 of entry 1's dead slots, 1 appended"
    kv.clear_row(1)  # row 1 finished; the same slot is refilled: the live rows stay {0, 1}
    layer = kv.cache.layers[0]
    store, before = layer._key_store, layer.keys.clone()  # [2, heads, 6, head_dim]
    fresh = [9, 10, 11, 12, 13, 14, 15]
    assert kv.prefill(1, fresh)
    assert kv.rows[1].slots == [0, 1, 2, 3, 4, 5, 6] and kv.width == 7, "6 reused, 1 appended"
    assert store is not None and layer._key_store is store, "appended into the existing buffer"
    assert layer.keys.data_ptr() == store.data_ptr()
    assert torch.equal(layer.keys[0, :, :6], before[0]), "row 0 unchanged"
    own = pipe.target.new_cache()
    pipe.target.forward(own, fresh, keep=1, check=False)
    for shared, mine in zip(kv.cache.layers, own.cache.layers, strict=True):
        assert torch.equal(shared.keys[1], mine.keys[0]) and torch.equal(shared.values[1], mine.values[0])
        assert not shared.keys[0, :, 5:].any(), "row 0's appended slots are dead zeros"
    wide = BatchKV(pipe.target, 2)
    assert wide.prefill(0, [1, 2, 3]) and wide.prefill(1, [4, 5], reuse=False)
    assert wide.width == 5 and wide.rows[1].slots == [3, 4]


def test_tree_drafter_is_refused(tiny_eagle_head):
    pipe = specgen.pipeline(*TINY, "target.source.vocab_size=8", "drafter=eagle",
                            f"drafter.head_file={tiny_eagle_head}", progress=False)
    with pytest.raises(ConfigError, match="tree drafters .* are not batched yet"):
        pipe.generate_batch([dict(prompt_ids=[1, 2])])
    plain = pipe.generate_batch([dict(prompt_ids=[1, 2], max_new_tokens=3)], speculative=False)
    assert len(plain[0].token_ids) == 3 and str(plain[0].guarantee) == "off: speculative=false"


def test_bad_batch_input_names_the_prompt():
    pipe = tiny_pipeline(drafter="none")
    with pytest.raises(ConfigError, match="prompt 1: .*max_new_tokens"):
        pipe.generate_batch([dict(prompt_ids=[1]), dict(prompt_ids=[1], max_new_tokens=0)])
    with pytest.raises(ConfigError, match="prompt 0: .*unknown argument 'sed'"):
        pipe.generate_batch([dict(prompt_ids=[1], sed=3)])
    with pytest.raises(ConfigError, match="batch_size"):
        pipe.generate_batch([dict(prompt_ids=[1])], batch_size=0)
    with pytest.raises(ConfigError, match="batch_size must be at most 256, got 1000000"):
        pipe.generate_batch([dict(prompt_ids=[1])], batch_size=10**6)
    with pytest.raises(PromptError, match="list of prompts"):
        pipe.generate_batch("one prompt")


class _Recorder:
    """Per-request item lists filled by BatchScheduler callbacks (on its thread); ``on_token``
    (index, count) runs after each TokenEvent, once every handle is known (``ready``)."""

    def __init__(self, count: int, on_token=None):
        self.items = [[] for _ in range(count)]
        self.done = [threading.Event() for _ in range(count)]
        self.ready = threading.Event()
        self.on_token = on_token

    def callback(self, index: int):
        def deliver(item):
            self.ready.wait(30)
            self.items[index].append(item)
            if isinstance(item, TokenEvent) and self.on_token is not None:
                self.on_token(index, sum(isinstance(i, TokenEvent) for i in self.items[index]))
            if not isinstance(item, TokenEvent):
                self.done[index].set()
        return deliver

    def wait(self, index: int):
        assert self.done[index].wait(120), f"request {index} did not end"
        return self.items[index][-1]


def _long_prompts(pipe, count: int) -> list[dict]:
    """Prompts whose greedy and seed-0..2 runs at temperature 1 all reach 16 tokens (no early EOS)."""
    prompts = [dict(prompt_ids=ids, max_new_tokens=16) for ids in ([3, 13], [5, 1], [8, 2], [11, 1])[:count]]
    for p in prompts:
        assert len(pipe.generate(**p).token_ids) == 16, "each reference run must be long enough to interleave"
    return prompts


def test_scheduler_admits_a_request_submitted_while_others_run():
    pipe = tiny_pipeline("drafter.num_tokens=3")
    prompts = _long_prompts(pipe, 3)
    expected = [pipe.generate(**p).token_ids for p in prompts]
    scheduler = BatchScheduler(pipe, batch_size=4)
    late: dict = {}

    def on_token(index, count):
        if index == 0 and count == 1:  # the first row has started: submit the third request now
            late["handle"] = scheduler.submit(**prompts[2], callback=recorder.callback(2))
        if index == 2 and count == 1:  # the late row's first token: the first row (16 tokens) still runs
            late["together"] = scheduler.active

    recorder = _Recorder(3, on_token)
    handles = [scheduler.submit(**p, callback=recorder.callback(i)) for i, p in enumerate(prompts[:2])]
    recorder.ready.set()
    try:
        finals = [recorder.wait(i) for i in range(3)]
    finally:
        scheduler.close()
    assert late["together"] >= 2 and len(handles) == 2
    assert all(isinstance(f, FinishEvent) for f in finals)
    assert [f.generation.token_ids for f in finals] == expected
    assert sum(f.generation.stats.drafted for f in finals) > 0
    assert scheduler.active == 0 and scheduler.pending == 0


def test_scheduler_cancel_frees_the_slot_and_leaves_other_rows_unchanged():
    pipe = tiny_pipeline("drafter.num_tokens=3", "sampling.temperature=1.0")
    prompts = [dict(p, seed=i) for i, p in enumerate(_long_prompts(pipe, 3))]
    expected = [pipe.generate(**p).token_ids for p in prompts]
    scheduler = BatchScheduler(pipe, batch_size=2)
    seen: dict = {}
    handles: list = []

    def on_token(index, count):
        if index == 0 and count >= 2 and scheduler.active == 2 and "slot" not in seen:
            # cancel the first row mid-generation, beside the second; the third takes its slot
            seen["slot"] = next(r for r, row in enumerate(scheduler.batch.slots) if row and row.owner is handles[0])
            scheduler.cancel(handles[0])
            handles.append(scheduler.submit(**prompts[2], callback=recorder.callback(2)))
        if index == 2 and count == 1:
            seen["reused"] = next(r for r, row in enumerate(scheduler.batch.slots)
                                  if row and row.owner is handles[2])

    recorder = _Recorder(3, on_token)
    handles.extend(scheduler.submit(**p, callback=recorder.callback(i)) for i, p in enumerate(prompts[:2]))
    recorder.ready.set()
    try:
        finals = [recorder.wait(i) for i in range(3)]
    finally:
        scheduler.close()
    cancelled_after = len(recorder.items[0]) - 1
    assert 2 <= cancelled_after < 16 and all(isinstance(i, TokenEvent) for i in recorder.items[0][:-1])
    assert finals[0] == Cancelled(cancelled_after), "events after the cancel are dropped: it stops at its last commit"
    assert finals[1].generation.token_ids == expected[1]
    assert finals[2].generation.token_ids == expected[2]
    assert seen["reused"] == seen["slot"]
    assert scheduler.active == 0


def test_scheduler_handles_iterate_and_bad_requests_get_their_error():
    pipe = tiny_pipeline(drafter="ngram")
    scheduler = BatchScheduler(pipe, batch_size=2)
    try:
        expected = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=5)
        events = list(scheduler.submit(prompt_ids=[1, 2, 3], max_new_tokens=5))
        assert [e.token_id for e in events[:-1]] == expected.token_ids
        assert events[-1].generation.token_ids == expected.token_ids
        with pytest.raises(ConfigError, match="max_new_tokens"):
            scheduler.generate(prompt_ids=[1], max_new_tokens=0)
        with pytest.raises(ConfigError, match="unknown argument 'sed'"):
            scheduler.generate(prompt_ids=[1], sed=3)
        assert scheduler.generate(prompt_ids=[1, 2, 3], max_new_tokens=5).token_ids == expected.token_ids
    finally:
        scheduler.close()
    with pytest.raises(ConfigError, match="batch_size"):
        BatchScheduler(pipe, batch_size=0)


def test_scheduler_close_cancels_running_and_queued_requests():
    pipe = tiny_pipeline("drafter.num_tokens=3")
    prompts = _long_prompts(pipe, 2)
    scheduler = BatchScheduler(pipe, batch_size=1)
    closer = threading.Thread(target=scheduler.close)

    def on_token(index, count):
        if index == 0 and count == 1:  # close from another thread; wait until it has begun
            closer.start()
            while not scheduler.closed:
                closer.join(0.01)

    recorder = _Recorder(2, on_token)
    for i, p in enumerate(prompts):
        scheduler.submit(**p, callback=recorder.callback(i))
    recorder.ready.set()
    first, second = recorder.wait(0), recorder.wait(1)
    closer.join()
    assert first == Cancelled(sum(isinstance(i, TokenEvent) for i in recorder.items[0])) and first.new_tokens >= 1
    assert second == Cancelled(0) and recorder.items[1] == [second]
    with pytest.raises(ConfigError, match="closed"):
        scheduler.submit(prompt_ids=[1])


def test_scheduler_step_failure_fails_its_rows_and_serving_goes_on():
    pipe = tiny_pipeline(drafter="ngram")
    expected = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=4).token_ids
    scheduler = BatchScheduler(pipe, batch_size=2)

    def fail(module, args):
        raise RuntimeError("injected failure in the batched forward")

    hook = pipe.target.model.model.layers[-1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(StepError, match="generation failed: injected"):
            scheduler.generate(prompt_ids=[1, 2, 3], max_new_tokens=4)
        hook.remove()
        assert scheduler.active == 0
        assert scheduler.generate(prompt_ids=[1, 2, 3], max_new_tokens=4).token_ids == expected
    finally:
        hook.remove()
        scheduler.close()
