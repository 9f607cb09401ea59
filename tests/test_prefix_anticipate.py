"""A chat's next turn, anticipated (``prefix_cache.anticipate``): when a reply ends, its parked handle is
synced in the background to what the next turn's prompt starts with (the conversation as the chat
template renders it, the reply included, up to the next user message's content), so the next turn
prefills only the user's message and the generation prompt. The tokens stay those of a fresh pipeline;
a corrupted anticipated entry is caught by the same comparison; a template that cannot render the
conversation anticipates nothing."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

import specgen
from specgen.errors import ConfigError
from specgen.models import llama_cpp
from specgen.models.prefix_cache import PrefixCache
from specgen.models.tiny import TinyTokenizer
from specgen.models.tokenizer import TokenizerInfo
from test_prefix_cache import ListCache

VARIED = ("target=tiny", "threads=1", "target.source.vocab_size=64", "target.source.init_scale=3.0", "drafter=ngram")
needs_llama = pytest.mark.skipif(not llama_cpp.available(), reason="llama-cpp-python is not installed")
PATHS = [pytest.param(("dtype=int8",), id="int8"),
         pytest.param(("backend=llama_cpp",), id="llama_cpp", marks=needs_llama)]
USERS = ["hi there", "tell me more", "why not"]  # characters of the tiny alphabet
ROLE = {"user": "U", "assistant": "A", "system": "S"}


def tiny_template(self, messages, add_generation_prompt=False, tokenize=True):
    """A chat template for the tiny tokenizer: each message as ``<role letter>\\n<content>\\n``."""
    text = "".join(f"{ROLE[m['role']]}\n{m['content']}\n" for m in messages) + ("A\n" if add_generation_prompt else "")
    return self.encode(text) if tokenize else text


@pytest.fixture
def templated(monkeypatch):
    monkeypatch.setattr(TinyTokenizer, "apply_chat_template", tiny_template, raising=False)
    original = TinyTokenizer.__init__

    def init(self, vocab_size):
        original(self, vocab_size)
        self.chat_template = "tiny"

    monkeypatch.setattr(TinyTokenizer, "__init__", init)


def chat(cached, fresh, corrupt=None) -> list[tuple]:
    """Three user turns on both pipelines, each reply appended as the assistant message; -> per turn
    (cached tokens, fresh tokens, the cached request's stats, the ids anticipated for that turn).
    ``corrupt(cache)``: called after each settle (a negative control)."""
    messages, turns, expected = [], [], []
    for text in USERS:
        messages.append({"role": "user", "content": text})
        got = cached.generate(list(messages), max_new_tokens=10)
        want = fresh.generate(list(messages), max_new_tokens=10)
        turns.append((got.token_ids, want.token_ids, got.stats, expected))
        cached.prefix_cache.wait_settled()
        expected = cached.tokenizer.next_turn_ids(messages, got.text)
        if corrupt is not None:
            corrupt(cached.prefix_cache)
        messages.append({"role": "assistant", "content": want.text})
    return turns


@pytest.mark.parametrize("path", PATHS)
def test_the_next_turn_prefills_only_the_users_message_and_gives_the_fresh_tokens(templated, path):
    cached = specgen.pipeline(*VARIED, *path, progress=False)
    fresh = specgen.pipeline(*VARIED, *path, "prefix_cache.entries=0", progress=False)
    turns = chat(cached, fresh)
    assert [got for got, *_ in turns] == [want for _, want, *_ in turns]
    assert len({tuple(want) for _, want, *_ in turns}) == 3  # outputs that differ: the comparison can fail
    for (_, _, stats, expected), text in zip(turns[1:], USERS[1:]):
        assert len(expected) > 10 and stats.prefill_reused == len(expected)
        assert stats.prefill_computed == len(text) + len("\nA\n")  # the message, its end and the generation prompt
    assert cached.prefix_cache.stats.settled > 0


@pytest.mark.parametrize("path", PATHS)
def test_without_anticipation_the_next_turn_feeds_the_template_and_the_replys_last_token(templated, path):
    cached = specgen.pipeline(*VARIED, *path, "prefix_cache.anticipate=false", progress=False)
    fresh = specgen.pipeline(*VARIED, *path, "prefix_cache.entries=0", progress=False)
    turns = chat(cached, fresh)
    assert [got for got, *_ in turns] == [want for _, want, *_ in turns]
    for _, _, stats, _ in turns[1:]:
        assert stats.prefill_reused > 10 and stats.prefill_computed > len("\nU\n") + len("\nA\n")
    assert cached.prefix_cache.stats.settled == 0


@pytest.mark.parametrize("path", PATHS)
def test_negative_control_a_corrupted_anticipated_entry_changes_the_tokens(templated, path):
    cached = specgen.pipeline(*VARIED, *path, progress=False)
    fresh = specgen.pipeline(*VARIED, *path, "prefix_cache.entries=0", progress=False)
    corrupt_last_fed(cached.prefix_cache)
    turns = chat(cached, fresh)
    _, _, stats, expected = turns[1]
    assert stats.prefill_reused == len(expected)  # the corrupted entry was served
    assert turns[0][0] == turns[0][1] and turns[1][0] != turns[1][1]


def corrupt_last_fed(cache: PrefixCache) -> None:
    """Make ``cache``'s settles write the last entry they feed for another id (of the tiny model's 64)
    while the handle claims the expected one."""
    settle = cache._settle

    def wrong(handle, ids):
        settle(handle, [*ids[:-1], (ids[-1] + 17) % 64])
        handle.tokens[-1] = ids[-1]

    cache._settle = wrong


def feeding(fed: list):
    def settle(handle, ids):
        fed.append(list(ids))
        handle.tokens.extend(ids)
    return settle


def test_a_parked_handle_is_synced_to_the_anticipated_ids_and_a_taker_waits_for_it():
    fed, gate = [], threading.Event()
    record = feeding(fed)

    def settle(handle, ids):
        gate.wait(5)
        record(handle, ids)

    cache = PrefixCache(lambda: ListCache([]), entries=2, max_bytes=1 << 30, settle=settle)
    # the reply's last entries retokenize otherwise (8, 9 -> 89), then the next turn's header 50, 51
    cache.park(ListCache(range(10)), tail=[10], ahead=lambda: [*range(8), 89, 50, 51])
    taken = []
    taker = threading.Thread(target=lambda: taken.append(cache.acquire([*range(8), 89, 50, 51, 60, 61])))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not taken
    gate.set()
    taker.join(5)
    handle, reused = taken[0]
    assert fed == [[89, 50, 51]] and reused == 11 and handle.tokens == [*range(8), 89, 50, 51]
    assert cache.stats.settled == 3


def test_without_anticipated_ids_a_handle_all_of_whose_entries_are_reusable_is_parked_as_it_is():
    """An ``ahead`` that knows nothing ([]) or fails leaves the handle and its tail alone where every
    entry is reusable (floor 1): the next request feeds the tail as cheaply as a settle would."""
    fed = []
    cache = PrefixCache(lambda: ListCache([]), entries=4, max_bytes=1 << 30, settle=feeding(fed))

    def broken():
        raise RuntimeError("the template refused")

    cache.park(ListCache(range(10)), tail=[10], ahead=lambda: [])
    cache.park(ListCache(range(20, 30)), tail=[30], ahead=broken)
    cache.park(ListCache(range(40, 50)), tail=[50])
    cache.wait_settled()
    assert fed == [] and len(cache) == 3 and cache.stats.settled == 0
    assert [h.tokens for h in cache._parked] == [list(range(10)), list(range(20, 30)), list(range(40, 50))]


def word_level() -> tuple:
    """A fast word-level tokenizer with a chat template (``start role : content | ...``) -> (it, its TokenizerInfo)."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "start", "user", "assistant", "system", ":", "|", "hi", "there", "Why", "Hello", "brief"]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    hf.chat_template = ("start {% for m in messages %}{{ m.role }} : {{ m.content }} | {% endfor %}"
                        "{% if add_generation_prompt %}assistant :{% endif %}")
    return hf, TokenizerInfo(hf)


def test_next_turn_ids_end_where_the_next_users_content_starts():
    hf, info = word_level()
    messages = [{"role": "user", "content": "hi"}]
    expected = info.next_turn_ids(messages, "there there", system="brief")
    assert hf.convert_ids_to_tokens(expected) == ["start", "system", ":", "brief", "|", "user", ":", "hi", "|",
                                                  "assistant", ":", "there", "there", "|", "user", ":"]
    nxt = info.encode_prompt([*messages, {"role": "assistant", "content": "there there"},
                              {"role": "user", "content": "why"}], chat=True, system="brief")
    assert nxt[:len(expected)] == expected and len(nxt) > len(expected)
    assert info.encode_prompt(messages, chat=True, system="brief") == expected[:9] + hf.convert_tokens_to_ids(
        ["assistant", ":"])
    hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    assert info.next_turn_ids(messages, "there") == []
    hf.chat_template = None
    assert info.next_turn_ids(messages, "there") == []


class _OneCallerTokenizer:
    """A tokenizer that records how many threads are inside an encoding call at once."""

    chat_template = "a template"
    eos_token_id = None

    def __init__(self):
        self.inside = 0
        self.most = 0
        self._count = threading.Lock()

    def __len__(self):
        return 8

    def _enter(self, ids):
        with self._count:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(0.02)  # a Rust call holding its borrow
        with self._count:
            self.inside -= 1
        return ids

    def encode(self, text, add_special_tokens=False):
        return self._enter([1, 2])

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return self._enter([1, 2, 3 + len(messages[-1]["content"]) % 4])


@pytest.mark.parametrize("locked", [True, False])
def test_the_settle_threads_rendering_and_a_requests_encoding_do_not_overlap(locked):
    """The settle thread renders the next turn while a request encodes; a fast tokenizer fails when two
    threads set its state at once, so TokenizerInfo encodes one call at a time. Negative control: without
    its lock the same calls overlap."""
    stub = _OneCallerTokenizer()
    info = TokenizerInfo(stub)
    if not locked:
        info._encoding = contextlib.nullcontext()
    start = threading.Barrier(3)

    def settle():
        start.wait()
        for _ in range(4):
            info.next_turn_ids([{"role": "user", "content": "hi"}], "there")

    def request():
        start.wait()
        for _ in range(4):
            info.encode_prompt("Hello", chat=True)
            info.token_ids("word")

    threads = [threading.Thread(target=settle), threading.Thread(target=request), threading.Thread(target=settle)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stub.most == 1 if locked else stub.most >= 2


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_a_bad_anticipate_setting_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match="prefix_cache.anticipate"):
        specgen.pipeline(*VARIED, f"prefix_cache.anticipate={value}", progress=False)
