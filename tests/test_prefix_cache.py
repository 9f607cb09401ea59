"""The prefix cache (specgen.models.prefix_cache): a request that starts from a finished request's
parked KV handle gives, on every path that declares ``prefix_reuse``, the tokens and the logits of
the same request on a fresh pipeline (bit for bit), and a corrupted parked entry is caught by the
same comparison; the LRU keeps its bounds, each handle has one owner, and the counts are reported."""

from __future__ import annotations

import threading

import pytest
import torch

import specgen
from specgen.errors import CacheExhausted, ConfigError
from specgen.models import llama_cpp
from specgen.models.prefix_cache import PrefixCache, common_prefix
from specgen.models.target import TokenCache

#: A tiny target whose greedy outputs vary (the default tiny one soon repeats one token).
VARIED = ("target=tiny", "threads=1", "target.source.vocab_size=64", "target.source.init_scale=3.0", "drafter=ngram")
needs_llama = pytest.mark.skipif(not llama_cpp.available(), reason="llama-cpp-python is not installed")
PATHS = [pytest.param(("dtype=int8",), id="int8"), pytest.param(("dtype=int4",), id="int4"),
         pytest.param(("backend=llama_cpp",), id="llama_cpp", marks=needs_llama)]
TURN = [[1, 2, 3, 4, 5, 6, 7], [9, 10, 11], [20, 21, 22, 23, 24]]  # a first prompt, then what each later turn adds


def pipe_pair(path, *extra):
    """A pipeline with the default prefix cache and one with it off, on ``path``."""
    cached = specgen.pipeline(*VARIED, *path, *extra, progress=False)
    fresh = specgen.pipeline(*VARIED, *path, *extra, "prefix_cache.entries=0", progress=False)
    return cached, fresh


def conversation(cached, fresh, speculative: bool, corrupt=None) -> list[tuple[list[int], list[int], int]]:
    """Three turns, each prompt the last one + its output + a new message, on both pipelines;
    -> per turn (cached tokens, fresh tokens, prompt tokens reused). ``corrupt(cache, ids)``: called
    between turns with the cached pipeline's prefix cache and the next prompt (a negative control)."""
    ids, turns = list(TURN[0]), []
    for added in TURN[1:] + [[]]:
        got = cached.generate(prompt_ids=ids, max_new_tokens=12, speculative=speculative)
        want = fresh.generate(prompt_ids=ids, max_new_tokens=12, speculative=speculative)
        assert want.stats.prefill_reused == 0 and want.stats.prefill_computed == len(ids)
        assert got.stats.prefill_reused + got.stats.prefill_computed == got.stats.prompt_tokens == len(ids)
        turns.append((got.token_ids, want.token_ids, got.stats.prefill_reused))
        ids = ids + want.token_ids + added
        if corrupt is not None and added:
            corrupt(cached.prefix_cache, ids)
    return turns


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
@pytest.mark.parametrize("path", PATHS)
def test_later_turns_start_from_the_cache_and_give_the_fresh_pipelines_tokens(path, speculative):
    cached, fresh = pipe_pair(path)
    turns = conversation(cached, fresh, speculative)
    assert [got for got, _, _ in turns] == [want for _, want, _ in turns]
    assert len({tuple(want) for _, want, _ in turns}) == 3  # outputs that differ: the comparison can fail
    assert turns[0][2] == 0 and all(reused >= 7 for _, _, reused in turns[1:])
    assert cached.prefix_cache.stats.hits == 2 and cached.prefix_cache.stats.hit_rate == pytest.approx(2 / 3)


@pytest.mark.parametrize("path", PATHS)
def test_logprobs_after_a_hit_equal_the_fresh_pipelines_bit_for_bit(path):
    cached, fresh = pipe_pair(path)
    first = cached.generate(prompt_ids=TURN[0], max_new_tokens=6)
    ids = TURN[0] + first.token_ids + TURN[1]
    got, want = (pipe.generate(prompt_ids=ids, max_new_tokens=8, logprobs=3) for pipe in (cached, fresh))
    assert got.stats.prefill_reused > 7 and got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs and len(want.logprobs) == 8


def swap_one_token(cache: PrefixCache, ids: list[int]) -> None:
    """Negative control: the parked handle claims the next prompt's id 3 at position 3 while its
    entry there is the KV of another token (as if an entry were written for the wrong id)."""
    (handle,) = cache._parked
    ids[3] = handle.tokens[3] = (handle.tokens[3] + 17) % 64


@pytest.mark.parametrize("path", PATHS)
def test_negative_control_a_corrupted_parked_entry_changes_the_tokens(path):
    cached, fresh = pipe_pair(path)
    turns = conversation(cached, fresh, True, corrupt=swap_one_token)
    assert all(reused > 3 for _, _, reused in turns[1:])
    assert turns[0][0] == turns[0][1] and any(got != want for got, want, _ in turns[1:])


def logits_from(pipe, ids: list[int]) -> torch.Tensor:
    """The last position's logits of ``ids`` through ``pipe``'s prefix cache (handle parked after)."""
    handle, reused = pipe.prefix_cache.acquire(ids)
    logits = pipe.target.forward(handle, ids[reused:], keep=1)  # [1, vocab]
    pipe.prefix_cache.park(handle)
    return logits


@pytest.mark.parametrize("path", PATHS)
def test_logits_after_a_hit_equal_a_fresh_prefills_bit_for_bit(path):
    cached, fresh = pipe_pair(path)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (300,), generator=gen).tolist()
    logits_from(cached, ids[:40])  # parked: 40 ids, fed in one forward
    for b in (41, 100, 300, 260):  # extend, extend, extend, crop back
        assert torch.equal(logits_from(cached, ids[:b]), logits_from(fresh, ids[:b]))
    assert cached.prefix_cache.stats.hits == 4 and fresh.prefix_cache.stats.hits == 0
    handle = cached.prefix_cache._parked[0]
    handle.tokens[5] = (handle.tokens[5] + 1) % 64  # negative control: one entry now claims another id
    corrupted = ids[:5] + [handle.tokens[5]] + ids[6:280]
    assert not torch.equal(logits_from(cached, corrupted), logits_from(fresh, corrupted))


def test_torch_float_declares_no_prefix_reuse_and_starts_every_request_empty():
    pipe = specgen.pipeline(*VARIED, "dtype=float32", progress=False)
    assert not pipe.target.capabilities.prefix_reuse and not pipe.prefix_cache.enabled
    first = pipe.generate(prompt_ids=TURN[0], max_new_tokens=4)
    again = pipe.generate(prompt_ids=TURN[0] + first.token_ids, max_new_tokens=4)
    assert again.stats.prefill_reused == 0 and len(pipe.prefix_cache) == 0


@pytest.mark.parametrize("value", ["-1", "many"])
def test_a_bad_bound_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match="prefix_cache.entries"):
        specgen.pipeline(*VARIED, f"prefix_cache.entries={value}", progress=False)


class ListCache(TokenCache):
    """A handle with no KV: ``size`` bytes; records its release."""

    def __init__(self, tokens, size: int = 0):
        self.tokens, self.size, self.released = list(tokens), size, False

    def held_bytes(self) -> int:
        return self.size

    def release(self) -> None:
        self.released = True

    def _truncate(self, length: int) -> None:
        pass


def test_the_longest_prefix_wins_ties_go_to_the_latest_and_the_taker_owns_it():
    cache = PrefixCache(lambda: ListCache([]), entries=4, max_bytes=1 << 30)
    short, long_, tie = ListCache([1, 2]), ListCache([1, 2, 3, 9]), ListCache([1, 2, 3, 8])
    for handle in (short, long_, tie):
        cache.park(handle)
    got, reused = cache.acquire([1, 2, 3, 4, 5])
    assert got is tie and reused == 3 and got.tokens == [1, 2, 3] and len(cache) == 2
    got, reused = cache.acquire([1, 2, 3])  # the last prompt id is always fed
    assert got is long_ and reused == 2
    got, reused = cache.acquire([7, 7])
    assert reused == 0 and got not in (short, long_) and len(cache) == 1
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1], [1, 2]) == 1


def test_bounds_evict_the_oldest_and_release_it():
    cache = PrefixCache(lambda: ListCache([]), entries=2, max_bytes=100)
    handles = [ListCache([i], size=40) for i in range(4)]
    for handle in handles[:3]:
        cache.park(handle)
    assert [h.released for h in handles[:3]] == [True, False, False]
    cache.park(ListCache([9], size=30))  # 40 + 30 bytes would fit but not 3 entries; 40 + 40 + 30 would not
    assert handles[1].released and not handles[2].released and len(cache) == 2
    off = PrefixCache(lambda: ListCache([]), entries=0, max_bytes=100)
    off.park(handles[3])
    assert handles[3].released and len(off) == 0


def test_a_full_model_gets_room_from_the_oldest_parked_handle():
    made = []

    def new_cache():  # a model that holds two live handles at most
        if sum(not h.released for h in made) >= 2:
            raise CacheExhausted("full")
        made.append(ListCache([]))
        return made[-1]

    cache = PrefixCache(new_cache, entries=4, max_bytes=1 << 30)
    first, second = cache.acquire([1, 2])[0], cache.acquire([3, 4])[0]
    first.tokens, second.tokens = [1], [3]
    cache.park(first)
    cache.park(second)
    third, reused = cache.acquire([5, 6])
    assert reused == 0 and first.released and not second.released and len(cache) == 1
    fourth = cache.acquire([3, 4, 5])[0]
    assert fourth is second
    with pytest.raises(CacheExhausted):  # nothing parked to give room: refused as before
        cache.acquire([7, 8])


def test_threads_never_hold_one_handle_at_once():
    cache = PrefixCache(lambda: ListCache([]), entries=3, max_bytes=1 << 30)
    held, lock, clashes = set(), threading.Lock(), []

    def worker(seed: int) -> None:
        for i in range(300):
            ids = [seed % 2, i % 3, 5]
            handle, _ = cache.acquire(ids)
            with lock:
                clashes.append(id(handle) in held)
                held.add(id(handle))
            handle.tokens = ids
            with lock:
                held.discard(id(handle))
            cache.park(handle)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not any(clashes) and len(clashes) == 1200 and cache.stats.lookups == 1200 and cache.stats.hits > 0


def two_turns():
    """(pipe, first, second): a first turn on an int8 tiny pipeline, then a second that extends it."""
    pipe = specgen.pipeline(*VARIED, "dtype=int8", progress=False)
    first = pipe.generate(prompt_ids=TURN[0], max_new_tokens=4)
    second = pipe.generate(prompt_ids=TURN[0] + first.token_ids + TURN[1], max_new_tokens=4)
    return pipe, first, second


def test_the_summary_line_and_the_tui_panel_show_cached_and_prefilled_prompt_tokens():
    from specgen.cli.main import summary_line
    from specgen.tui.panel import numbers_content
    from specgen.tui.tally import PanelSnapshot

    pipe, first, second = two_turns()
    reused, computed = second.stats.prefill_reused, second.stats.prefill_computed
    assert reused == 10 and computed == 4  # the first prompt + 3 of its 4 tokens (the last was never fed)
    assert "cached" not in summary_line(first)
    assert f"prompt 14 tokens: {reused} cached, {computed} prefilled" in summary_line(second)
    panel = numbers_content(PanelSnapshot.from_stats(second.stats, pipe.guarantee, True)).plain
    assert f"prompt {reused} cached · {computed} prefilled" in panel


def test_the_server_reports_cached_prompt_tokens_and_a_hit_ratio():
    from specgen.serve.metrics import Metrics
    from specgen.serve.protocol import usage

    pipe, first, second = two_turns()
    assert usage(first)["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage(second)["prompt_tokens_details"] == {"cached_tokens": second.stats.prefill_reused} != {
        "cached_tokens": 0}
    metrics = Metrics("tiny", pipe.guarantee)
    metrics.generation(first)
    metrics.generation(second)
    lines = metrics.render(0).splitlines()
    assert f"specgen_prompt_cached_tokens_total {second.stats.prefill_reused}" in lines
    assert "specgen_prefix_cache_hit_ratio 0.5" in lines


@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param((), id="llama_cpp", marks=needs_llama), pytest.param(("dtype=int8",),
                                                                                                  id="int8")])
def test_default_model_chat_turns_after_a_hit_give_the_fresh_pipelines_tokens(path):
    cached = specgen.pipeline("threads=1", *path, progress=False)
    fresh = specgen.pipeline("threads=1", *path, "prefix_cache.entries=0", progress=False)
    messages = [{"role": "system", "content": "You answer briefly."}]
    for text in ("Name three rivers in Europe.", "Which is the longest?", "And the shortest of those?"):
        messages.append({"role": "user", "content": text})
        got = cached.generate(list(messages), max_new_tokens=24)
        want = fresh.generate(list(messages), max_new_tokens=24)
        assert got.token_ids == want.token_ids and want.stats.prefill_reused == 0
        messages.append({"role": "assistant", "content": want.text})
    assert got.stats.prefill_reused > 40 and cached.prefix_cache.stats.hits == 2


def shared_prefix_prompts(count: int = 6, shared: int = 24) -> list[dict]:
    """``count`` prompts: one shared instruction of ``shared`` ids, then a tail of each own."""
    instruction = [(5 * i + 3) % 64 for i in range(shared)]
    return [{"prompt_ids": instruction + [(11 * k + 7 * j + 1) % 64 for j in range(3 + k % 3)]} for k in range(count)]


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
@pytest.mark.parametrize("path", PATHS)
def test_batched_rows_start_from_their_slots_last_prompt_and_give_the_fresh_tokens(path, speculative):
    from specgen.batch import generate_batch

    cached, fresh = pipe_pair(path)
    prompts = shared_prefix_prompts()
    got = generate_batch(cached, prompts, batch_size=2, max_new_tokens=10, speculative=speculative)
    want = [fresh.generate(**prompt, max_new_tokens=10, speculative=speculative) for prompt in prompts]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert len({tuple(w.token_ids) for w in want}) > 1  # outputs that differ: the comparison can fail
    assert [g.stats.prefill_reused for g in got[:2]] == [0, 0]  # the first two rows start empty
    assert all(g.stats.prefill_reused >= 24 for g in got[2:])  # later rows keep the shared instruction
    assert all(g.stats.prefill_reused + g.stats.prefill_computed == g.stats.prompt_tokens for g in got)
    off = generate_batch(fresh, prompts, batch_size=2, max_new_tokens=10, speculative=speculative)
    assert [g.token_ids for g in off] == [w.token_ids for w in want]
    assert all(g.stats.prefill_reused == 0 for g in off)  # prefix_cache.entries=0: every row starts empty


@pytest.mark.parametrize("path", PATHS)
def test_negative_control_a_corrupted_kept_slot_changes_the_batched_tokens(path, monkeypatch):
    import dataclasses

    from specgen.batch import generate_batch, steps

    cached, fresh = pipe_pair(path)
    admit, claimed = steps.admit, {}

    def corrupting_admit(pipe, kv, r, spec, reuse=False):
        if reuse and r < len(kv.rows) and len(kv.rows[r].tokens) > 5:
            kv.rows[r].tokens[5] = (spec.ids[5] + 1) % 64  # the kept entry now claims another id
            spec = dataclasses.replace(spec, ids=spec.ids[:5] + [kv.rows[r].tokens[5]] + spec.ids[6:])
            claimed[spec.index] = spec.ids
        return admit(pipe, kv, r, spec, reuse)

    monkeypatch.setattr(steps, "admit", corrupting_admit)
    got = generate_batch(cached, shared_prefix_prompts(), batch_size=2, max_new_tokens=10)
    assert sorted(claimed) == [2, 3, 4, 5] and all(got[i].stats.prefill_reused > 5 for i in claimed)
    want = {i: fresh.generate(prompt_ids=ids, max_new_tokens=10).token_ids for i, ids in claimed.items()}
    assert any(got[i].token_ids != want[i] for i in claimed)  # the same comparison as above catches it


class WidthNoise:
    """A target whose logits move with the number of tokens a forward feeds (a kernel that computes a
    position differently by the forward it is fed in): the prefix probe's negative control."""

    def __init__(self, target):
        self.target, self.vocab_size = target, target.vocab_size

    def new_cache(self):
        return self.target.new_cache()

    def forward(self, cache, tokens, keep):
        logits = self.target.forward(cache, tokens, keep)
        return logits + 1e-6 * len(tokens)


@pytest.mark.parametrize("path", PATHS)
def test_the_prefix_probe_measures_zero_where_reuse_is_exact_and_catches_width_noise(path):
    from specgen.models.invariance import prefix_gap

    target = pipe_pair(path)[0].target
    assert prefix_gap(target) == 0.0
    assert prefix_gap(WidthNoise(target)) > 0.0


@needs_llama
def test_llama_cpp_measures_prefix_reuse_and_a_gap_turns_the_cache_and_slot_reuse_off(monkeypatch):
    from specgen.batch import generate_batch
    from specgen.batch.steps import Batch

    monkeypatch.setattr(llama_cpp, "prefix_gap", lambda lm, **_: 1e-6)  # a model whose kernels differ by width
    pipe = specgen.pipeline(*VARIED, "backend=llama_cpp", progress=False)
    assert not pipe.target.capabilities.prefix_reuse and not pipe.prefix_cache.enabled
    assert not Batch(pipe, 2).reuse
    first = pipe.generate(prompt_ids=TURN[0], max_new_tokens=6)
    again = pipe.generate(prompt_ids=TURN[0] + first.token_ids, max_new_tokens=6)
    assert again.stats.prefill_reused == 0  # every request starts empty
    rows = generate_batch(pipe, shared_prefix_prompts(), batch_size=2, max_new_tokens=6)
    assert all(row.stats.prefill_reused == 0 for row in rows)
