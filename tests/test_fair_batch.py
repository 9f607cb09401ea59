"""Chunked prefill on llama.cpp batches: a long prompt is prefilled a chunk per step while the other
rows decode, so a short row's first token does not wait for the whole prompt; every row's tokens
equal its solo run's. Latency is counted in decoded tokens and steps, never timed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from conftest import TINY
from test_llama_cpp_backend import _decodes

import specgen
from specgen.batch import Batch, BatchScheduler, prepare
from specgen.batch import steps as steps_module
from specgen.batch.steps import Row
from specgen.events import FinishEvent, TokenEvent
from specgen.models import llama_context, llama_cpp

pytestmark = pytest.mark.skipif(not llama_cpp.available(), reason="llama-cpp-python is not installed")

CHUNK = 64  # the split width of a prompt's decodes (llama_context.PREFILL_TOKENS), small for a tiny model
LONG = [1 + (7 * i + i // 5) % 13 for i in range(300)]  # five chunks: 4 x 64 + 44
SHORT = [[3, 5, 7], [2, 4, 6, 8]]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path_factory.getbasetemp() / "specgen-cache"))


def _pipe(monkeypatch, drafter: str, splits: str = "grid"):
    """splits: "grid": batches feed long prompts on the splits solo runs decode at, as where a model's
    split_gap is not 0 (the tests here count chunks on that grid; tests/test_fair_splits.py covers
    chunks sized by time); "measured": as the model's measurement says."""
    monkeypatch.setattr(llama_context, "PREFILL_TOKENS", CHUNK)  # before any context is made
    if splits == "grid":
        monkeypatch.setattr(llama_cpp.LlamaCppLM, "prefill_splits_free", property(lambda self: False))
    return specgen.pipeline(*TINY, "backend=llama_cpp", f"drafter={drafter}", progress=False)


@pytest.fixture
def pipe(monkeypatch):
    return _pipe(monkeypatch, "tiny")


@pytest.fixture
def decodes(monkeypatch) -> list[list[tuple[int, int, int, bool]]]:
    """Every llama_decode's entries (sequence, token, position, logits wanted), as they happen."""
    return _decodes(monkeypatch)


def _spec(pipe, ids, index):
    return prepare(pipe, {"prompt_ids": ids, "max_new_tokens": 6}, None, index)


def _run(pipe, decodes, chunked: bool):
    """The long prompt admitted first, SHORT[0] with it and SHORT[1] after two steps; -> per row
    (index 0: long) its tokens, the tokens decoded between its admission and its first token, the
    steps that took, and the long row's cached tokens at that moment."""
    batch = Batch(pipe, 3, row_context=512, chunked_prefill=chunked)
    rows = [batch.add(_spec(pipe, LONG, 0)), batch.add(_spec(pipe, SHORT[0], 1))]
    admitted = {0: (0, 0), 1: (0, 0)}  # index -> (step, tokens decoded so far)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    first: dict[int, tuple[int, int, int]] = {}
    ttfts: dict[int, float] = {}
    began: dict[int, float] = {}  # when the step that gave a row's first token began
    steps = 0
    while batch.active:
        if steps == 2:
            rows.append(batch.add(_spec(pipe, SHORT[1], 2)))
            admitted[2] = (steps, sum(map(len, decodes)))
        before = time.perf_counter()
        for row, event in list(batch.step()):
            i = row.spec.index
            if isinstance(event, FinishEvent):
                ttfts[i] = event.generation.stats.ttft
            if isinstance(event, TokenEvent):
                tokens[i].append(event.token_id)
                if i not in first:
                    began[i] = before
                    step0, fed0 = admitted[i]
                    first[i] = (sum(map(len, decodes)) - fed0, steps + 1 - step0, len(rows[0].request.target_cache))
        steps += 1
    assert ttfts[0] > began[0] - rows[0].start  # the long row's TTFT: its first token's step, not a prefill step
    return tokens, first


def test_a_short_row_gets_its_first_token_while_a_long_prompt_prefills(pipe, decodes):
    tokens, first = _run(pipe, decodes, chunked=True)
    for i in (1, 2):
        fed, steps, long_cached = first[i]
        assert steps == 1  # its first step gives its first token
        assert fed <= 2 * 16, first  # its own prompt and the other rows' decodes: no chunk of the long prompt
        assert long_cached < len(LONG)  # the long prompt is still prefilling
    assert first[0][1] == 7  # the long row: one step per chunk, two steps paused for the fresh short rows
    solo = {i: pipe.generate(prompt_ids=p, max_new_tokens=6).token_ids for i, p in enumerate([LONG, *SHORT])}
    assert tokens == solo


def test_without_chunks_a_short_row_waits_for_the_whole_prefill(pipe, decodes):
    """Negative control: the short row admitted with the long prompt gets its first token only after
    every token of the long prompt has been decoded."""
    tokens, first = _run(pipe, decodes, chunked=False)
    assert first[1][0] >= len(LONG)
    assert first[0][1] == 1
    assert tokens[1] == pipe.generate(prompt_ids=SHORT[0], max_new_tokens=6).token_ids


def test_a_chunked_prompt_is_decoded_as_its_solo_run_decodes_it(monkeypatch, decodes):
    """The long prompt's decodes (its tokens, positions and logits wanted, per llama_decode) in the
    batch are its solo run's: chunks end where the solo run splits, the last with the prompt's last row
    (prompt lookup drafts: the only decodes are the target's)."""
    pipe = _pipe(monkeypatch, "ngram")
    decodes.clear()  # the load's measurements

    def prompt_decodes(seq_of_long: int | None) -> list[list[tuple[int, int, bool]]]:
        out = []
        for entries in decodes:
            mine = [(t, p, w) for s, t, p, w in entries if (seq_of_long is None or s == seq_of_long) and p < len(LONG)]
            if mine and (seq_of_long is not None or len(mine) == len(entries)):
                out.append(mine)
        return out

    pipe.generate(prompt_ids=LONG, max_new_tokens=1)
    solo = prompt_decodes(None)
    decodes.clear()
    batch = Batch(pipe, 2, row_context=512)
    long = batch.add(_spec(pipe, LONG, 0))
    batch.add(_spec(pipe, SHORT[0], 1))
    while long.request.committed.tokens == LONG:
        list(batch.step())
    batched = prompt_decodes(long.request.target_cache.seq)
    assert [len(d) for d in solo] == [64, 64, 64, 64, 44]
    assert batched == solo


def test_the_scheduler_chunks_by_default(pipe):
    """A BatchScheduler runs chunked prefills unless told not to; rows' outputs are their solo runs'."""
    scheduler = BatchScheduler(pipe, batch_size=2)
    other = BatchScheduler(pipe, batch_size=2, chunked_prefill=False)
    try:
        assert scheduler.batch.chunked_prefill and not other.batch.chunked_prefill
        handles = [scheduler.submit(prompt_ids=p, max_new_tokens=6) for p in (LONG, SHORT[0])]
        got = [next(e for e in h if isinstance(e, FinishEvent)).generation.token_ids for h in handles]
    finally:
        scheduler.close()
        other.close()
    assert got == [pipe.generate(prompt_ids=p, max_new_tokens=6).token_ids for p in (LONG, SHORT[0])]


def _firsts(pipe, admissions: dict[int, list[list[int]]]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Run a Batch, admitting ``admissions[s]`` (index order) before step s; -> each row's step of its
    first token, and each row's tokens (index order of admission)."""
    batch = Batch(pipe, 4, row_context=512)
    first: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    index, steps = 0, 0
    while batch.active or steps <= max(admissions):
        for ids in admissions.get(steps, []):
            batch.add(_spec(pipe, ids, index))
            tokens[index] = []
            index += 1
        for row, event in list(batch.step()):
            if isinstance(event, TokenEvent):
                first.setdefault(row.spec.index, steps)
                tokens[row.spec.index].append(event.token_id)
        steps += 1
    return first, tokens


MEDIUM = [1 + (5 * i + i // 3) % 11 for i in range(120)]  # two chunks: 64 + 56


@pytest.mark.parametrize("joins", [1, 3])
def test_the_shortest_remaining_prompt_prefills_first(pipe, joins):
    """A prompt of two chunks admitted after the long prompt's first chunk (236 tokens left) goes
    first: its two steps, then the long prompt's four. Negative control (joins=3): admitted after
    three chunks (108 left, fewer than its 120), it waits for the long prompt, whose first
    token comes first."""
    first, tokens = _firsts(pipe, {0: [LONG], joins: [MEDIUM]})
    if joins == 1:
        assert (first[1], first[0]) == (2, 6)  # medium: steps 1-2; the long prompt: 0, then 3-6
    else:
        assert (first[0], first[1]) == (4, 6)  # the long prompt: steps 0-4 (its last 44 leave 20); medium: 5-6
    solo = [pipe.generate(prompt_ids=p, max_new_tokens=6).token_ids for p in (LONG, MEDIUM)]
    assert [tokens[0], tokens[1]] == solo


def test_fresh_prompts_share_a_step_only_within_one_chunk(pipe):
    """Fresh prompts of 40 and 30 tokens (70 > 64) get their first tokens in two steps, the shorter
    first; prompts of 20 and 30 (50 <= 64), in one."""
    apart = [[1 + i % 13 for i in range(40)], [2 + i % 11 for i in range(30)]]
    together = [apart[0][:20], apart[1]]
    first, tokens = _firsts(pipe, {0: apart})
    assert (first[1], first[0]) == (0, 1)
    assert [tokens[0], tokens[1]] == [pipe.generate(prompt_ids=p, max_new_tokens=6).token_ids for p in apart]
    first, _ = _firsts(pipe, {0: together})
    assert first == {0: 0, 1: 0}


class _Cache:
    """A stand-in KV handle: which of its row's prompt tokens are cached."""

    def __init__(self):
        self.tokens: list[int] = []

    def __len__(self):
        return len(self.tokens)

    def uncached(self, committed):
        return committed[len(self.tokens):]


def _row(size: int, start: float) -> Row:
    request = SimpleNamespace(committed=SimpleNamespace(tokens=list(range(size)), num_generated=0),
                              target_cache=_Cache())
    return Row(spec=None, request=request, ctx=None, start=start)


def _long_chunks_under_a_flood(steps: int) -> int:
    """Chunks of a 300-token prompt prefilled in ``steps`` steps while a new 10-token prompt arrives
    every step (each fits the chunk, so it goes whole and leaves). -> the long prompt's chunks."""
    long_row = _row(300, 0.0)
    kv = SimpleNamespace(prefill_chunk=32, prefill_take=lambda r, length: 32 - len(long_row.request.target_cache) % 32)
    waiting: list[Row] = []
    chunks = 0
    for step in range(steps):
        waiting.append(_row(10, 1.0 + step))
        live = list(enumerate([long_row, *waiting]))
        out = steps_module.prefill_chunks(kv, live)
        if out.get(0):
            long_row.request.target_cache.tokens += out[0]
            chunks += 1
        waiting = [row for r, row in live[1:] if r in out]  # the shorts not fed stay
    return chunks


def test_a_flood_of_short_prompts_does_not_starve_a_long_one():
    """At most MAX_PASSED_OVER steps pass between the long prompt's chunks; negative control: without
    the bound, the shortest-first order never gets to it."""
    chunks = _long_chunks_under_a_flood(20)
    assert chunks >= 20 // (steps_module.MAX_PASSED_OVER + 1)


def test_negative_control_without_the_bound_the_long_prompt_starves(monkeypatch):
    monkeypatch.setattr(steps_module, "MAX_PASSED_OVER", 10**9)
    assert _long_chunks_under_a_flood(20) == 0
