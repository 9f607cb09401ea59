"""The prefix cache prepares a request still being written: a chat message is prefilled up to its last
complete word while it is typed (``Pipeline.prepare``, ``PrefixCache.prepare``), so sending it prefills
only the last words, and the tokens are a fresh pipeline's."""

from __future__ import annotations

import threading

import pytest

import specgen
from specgen.models.prefix_cache import PrefixCache
from test_prefix_anticipate import PATHS, USERS, VARIED, corrupt_last_fed, feeding, templated, word_level  # noqa: F401 (a fixture)
from test_prefix_cache import ListCache


def typed_turns(cached, fresh, corrupt=None) -> list[tuple]:
    """Three user turns on both pipelines; before each, the cached one prepares the message as typed
    (all but its last word) and waits for it, as a typist's pause would. -> per turn (cached tokens,
    fresh tokens, the cached request's stats). ``corrupt(cache)``: called after each prepare."""
    messages, turns = [], []
    for text in USERS:
        messages.append({"role": "user", "content": text})
        cached.prepare(list(messages))
        cached.prefix_cache.wait_settled()
        if corrupt is not None:
            corrupt(cached.prefix_cache)
        got = cached.generate(list(messages), max_new_tokens=10)
        want = fresh.generate(list(messages), max_new_tokens=10)
        turns.append((got.token_ids, want.token_ids, got.stats))
        cached.prefix_cache.wait_settled()
        messages.append({"role": "assistant", "content": want.text})
    return turns


@pytest.mark.parametrize("path", PATHS)
def test_a_message_prepared_while_typed_prefills_only_its_last_word_and_gives_the_fresh_tokens(templated, path):
    cached = specgen.pipeline(*VARIED, *path, progress=False)
    fresh = specgen.pipeline(*VARIED, *path, "prefix_cache.entries=0", progress=False)
    turns = typed_turns(cached, fresh)
    assert [got for got, *_ in turns] == [want for _, want, _ in turns]
    assert len({tuple(want) for _, want, _ in turns}) == 3  # outputs that differ: the comparison can fail
    for (_, _, stats), text in zip(turns, USERS):
        last_word = text.split(" ")[-1]
        assert stats.prefill_computed == len(last_word) + len("\nA\n")  # the word, the message's end, the prompt
        assert stats.prefill_reused == stats.prompt_tokens - stats.prefill_computed


@pytest.mark.parametrize("path", PATHS)
def test_negative_control_a_corrupted_prepared_entry_changes_the_tokens(templated, path):
    cached = specgen.pipeline(*VARIED, *path, progress=False)
    fresh = specgen.pipeline(*VARIED, *path, "prefix_cache.entries=0", progress=False)
    corrupt_last_fed(cached.prefix_cache)
    turns = typed_turns(cached, fresh)
    assert turns[0][0] != turns[0][1]


def gated(fed: list, gate: threading.Event, entered: threading.Event):
    """A settle that records what it feeds once ``gate`` opens; ``entered`` is set when it begins."""
    record = feeding(fed)

    def settle(handle, ids):
        entered.set()
        assert gate.wait(5)
        record(handle, ids)
    return settle


def test_prepare_syncs_the_best_handle_feeds_the_latest_ids_and_a_request_drops_the_rest():
    fed, gate, entered = [], threading.Event(), threading.Event()
    cache = PrefixCache(lambda: ListCache([]), entries=4, max_bytes=1 << 30, settle=gated(fed, gate, entered))
    best, other = ListCache(range(6)), ListCache([7, 7, 7])
    cache.park(best)
    cache.park(other)
    cache.prepare([0, 1, 2, 3, 9, 10])       # begins at once, held at the gate
    assert entered.wait(5)
    cache.prepare([0, 1, 2, 3, 9, 10, 11])   # left for the running thread ...
    cache.prepare([0, 1, 2, 3, 9, 10, 11, 12])  # ... and replaced: the latest wins
    gate.set()
    cache.wait_settled()
    assert fed == [[9, 10], [11, 12]] and best.tokens == [0, 1, 2, 3, 9, 10, 11, 12]
    assert other.tokens == [7, 7, 7] and cache.stats.settled == 4
    handle, reused = cache.acquire([0, 1, 2, 3, 9, 10, 11, 12, 13])
    assert handle is best and reused == 8

    gate.clear()
    entered.clear()
    cache.park(handle)
    cache.prepare([0, 1, 2, 3, 20, 21])
    assert entered.wait(5)
    cache.prepare([0, 1, 2, 3, 20, 21, 22, 23])
    taken = []
    taker = threading.Thread(target=lambda: taken.append(cache.acquire([7, 7, 7, 8])))
    taker.start()
    taker.join(5)  # another handle: not held by the prepare; it drops the ids not yet begun
    gate.set()
    cache.wait_settled()
    assert taken[0][0] is other and fed[2:] == [[20, 21]]


def test_prepare_starts_a_fresh_handle_where_none_shares_a_prefix_and_not_when_off():
    fed = []
    cache = PrefixCache(lambda: ListCache([]), entries=2, max_bytes=1 << 30, settle=feeding(fed))
    cache.prepare([5, 6, 7])
    cache.prepare([5])  # one id: nothing to feed ahead of its request
    cache.wait_settled()
    assert fed == [[5, 6, 7]] and len(cache) == 1
    handle, reused = cache.acquire([5, 6, 7, 8])
    assert reused == 3 and handle.tokens == [5, 6, 7]
    for off in (PrefixCache(lambda: ListCache([]), entries=0, max_bytes=1 << 30, settle=feeding(fed)),
                PrefixCache(lambda: ListCache([]), entries=2, max_bytes=1 << 30)):
        off.prepare([1, 2, 3])
        off.wait_settled()
        assert len(off) == 0
    assert fed == [[5, 6, 7]]


def test_typed_prefix_ids_stop_before_the_word_being_typed():
    hf, info = word_level()
    typed = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"},
             {"role": "user", "content": "there hi the"}]
    ids = info.typed_prefix_ids(typed, chat=True, system="brief")
    assert hf.convert_ids_to_tokens(ids) == ["start", "system", ":", "brief", "|", "user", ":", "hi", "|", "assistant",
                                             ":", "there", "|", "user", ":", "there", "hi"]
    sent = info.encode_prompt([*typed[:-1], {"role": "user", "content": "there hi there"}], chat=True, system="brief")
    assert sent[:len(ids)] == ids and len(sent) > len(ids)
    assert hf.convert_ids_to_tokens(info.typed_prefix_ids("hi there", chat=False)) == ["hi"]
    assert info.typed_prefix_ids(typed[:2], chat=True) == []  # the last message is not the user's
    hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    assert info.typed_prefix_ids(typed, chat=True) == []
