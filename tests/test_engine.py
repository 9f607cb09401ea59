"""Engine behaviour on tiny models: greedy equivalence, transactions, stops, events."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_pipeline
from specgen.errors import ConfigError
from specgen.events import FinishEvent, TokenEvent
from specgen.processors import CommittedCounts
from specgen.engine.round import speculative_round

PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1], [7], [2, 9, 2, 9, 2, 9], [11, 3, 14, 15, 9, 2, 6]]


@pytest.mark.parametrize("drafter", ["tiny", "ngram"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("extra", [(), ("sampling.repetition_penalty=1.3", "sampling.min_new_tokens=5")])
def test_greedy_speculative_equals_plain(drafter, gamma, extra):
    pipe = tiny_pipeline(f"drafter.num_tokens={gamma}", "target.source.init_scale=3", *extra, drafter=drafter)
    assert str(pipe.guarantee) == "greedy"
    for prompt in PROMPTS:
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=40)
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=40, speculative=False)
        assert spec.token_ids == plain.token_ids
        assert spec.text == plain.text
        assert spec.finish_reason == plain.finish_reason


def test_same_seed_same_output_and_seeds_differ():
    pipe = tiny_pipeline("sampling.temperature=1.0")
    runs = [pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, seed=s).token_ids for s in (4, 4, 5)]
    assert runs[0] == runs[1]
    outputs = {tuple(pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, seed=s).token_ids) for s in range(10)}
    assert len(outputs) > 1


def _assert_consistent(request):
    """KV caches and counts are exactly what the committed tokens imply."""
    committed = request.committed.tokens
    assert request.target_cache.tokens == committed[: len(request.target_cache)]
    assert len(request.target_cache) == len(request.target_cache.cache.layers[0].keys[0, 0])
    assert len(request.target_cache) >= len(committed) - 1
    draft_cache = request.draft.cache
    assert draft_cache.tokens == committed[: len(draft_cache)]
    fresh = CommittedCounts.start(committed[: request.committed.num_prompt], len(request.committed.seen), torch.device("cpu"))
    fresh.commit(committed[request.committed.num_prompt :])
    assert torch.equal(fresh.seen, request.committed.seen)
    assert torch.equal(fresh.generated, request.committed.generated)


def test_state_after_every_round_matches_committed_tokens():
    pipe = tiny_pipeline("sampling.temperature=1.0", "sampling.repetition_penalty=1.2", "drafter.num_tokens=4")
    request, ctx = pipe.open_request([1, 2, 3, 4], max_new_tokens=60, seed=3)
    rejected_rounds = 0
    while request.finish_reason is None:
        before = len(request.committed.tokens)
        events = speculative_round(request, ctx, 4)
        rejected_rounds += any(e.kind == "resampled" for e in events)
        assert len(request.committed.tokens) == before + len(events)
        _assert_consistent(request)
    assert rejected_rounds > 0


class Boom(RuntimeError):
    pass


def test_failed_round_rolls_back_everything(monkeypatch):
    """An exception after draft + verify restores tokens, caches, RNGs and text state."""
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=4", "stop=[zz]")
    reference = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, seed=11, stop=["zz"])

    request, ctx = pipe.open_request([1, 2, 3], max_new_tokens=30, seed=11, stop=["zz"])
    for _ in range(2):
        speculative_round(request, ctx, 4)
    tokens = list(request.committed.tokens)
    target_len, draft_len = len(request.target_cache), len(request.draft.cache)
    rngs = (request.target_rng.get_state(), request.draft_rng.get_state())
    text_state = request.text.snapshot()

    import specgen.engine.round as round_module

    def failing_verify(*args, **kwargs):
        raise Boom("injected")

    with monkeypatch.context() as patch:
        patch.setattr(round_module, "verify", failing_verify)
        with pytest.raises(Boom):
            speculative_round(request, ctx, 4)
    assert request.committed.tokens == tokens
    assert (len(request.target_cache), len(request.draft.cache)) == (target_len, draft_len)
    assert torch.equal(request.target_rng.get_state(), rngs[0])
    assert torch.equal(request.draft_rng.get_state(), rngs[1])
    assert request.text.snapshot() == text_state
    _assert_consistent(request)
    while request.finish_reason is None:
        speculative_round(request, ctx, 4)
    assert request.generated == reference.token_ids


def test_closing_the_stream_leaves_pipeline_reusable():
    pipe = tiny_pipeline("sampling.temperature=1.0")
    full = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, seed=2)
    stream = pipe.stream(prompt_ids=[1, 2, 3], max_new_tokens=30, seed=2)
    first = [next(stream) for _ in range(3)]
    stream.close()
    assert [e.token_id for e in first] == full.token_ids[:3]
    again = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, seed=2)
    assert again.token_ids == full.token_ids


def test_events_describe_every_committed_token():
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3")
    events = list(pipe.stream(prompt_ids=[1, 2, 3], max_new_tokens=40, seed=0))
    *tokens, finish = events
    assert isinstance(finish, FinishEvent) and all(isinstance(e, TokenEvent) for e in tokens)
    gen = finish.generation
    assert [e.token_id for e in tokens] == gen.token_ids
    assert "".join(e.text for e in events) == gen.text
    for e in tokens:
        assert e.kind in ("accepted", "resampled", "bonus")
        assert 1 <= e.draft_position <= 4
        if e.kind == "accepted":
            assert 0.0 < e.accept_prob <= 1.0
        if e.kind == "bonus":
            assert e.accept_prob is None
    stats = gen.stats
    assert stats.new_tokens == len(gen.token_ids)
    assert stats.accepted == sum(stats.accepted_per_position) == sum(e.kind == "accepted" for e in tokens)
    assert stats.tokens_per_target_call == pytest.approx(stats.new_tokens / stats.target_calls)
    assert stats.drafter_memory_bytes > 0
    plain = list(pipe.stream(prompt_ids=[1, 2, 3], max_new_tokens=10, seed=0, speculative=False))
    assert {e.kind for e in plain[:-1]} == {"plain"}
    assert str(plain[-1].generation.guarantee) == "off: speculative=false"


def test_max_new_tokens_is_exact_and_eos_ids_stop():
    pipe = tiny_pipeline("target.source.init_scale=3", "drafter.num_tokens=5")
    for n in (1, 2, 7, 13):
        gen = pipe.generate(prompt_ids=[3, 4], max_new_tokens=n)
        assert len(gen.token_ids) == n or gen.finish_reason == "eos"
    first = pipe.generate(prompt_ids=[3, 4], max_new_tokens=20).token_ids
    eos_pipe = tiny_pipeline("target.source.init_scale=3", "drafter.num_tokens=5", f"target.eos_ids=[{first[3]}]")
    gen = eos_pipe.generate(prompt_ids=[3, 4], max_new_tokens=20)
    assert gen.finish_reason == "eos"
    assert gen.token_ids == first[: first.index(first[3]) + 1]


def test_stop_string_across_tokens_and_drafts():
    pipe = tiny_pipeline("sampling.temperature=1.0", "target.source.vocab_size=6", "drafter.source.vocab_size=6")
    for seed in range(30):
        plain = pipe.generate(prompt_ids=[1, 2], max_new_tokens=40, seed=seed, speculative=False)
        text = plain.text
        for stop in {text[i : i + 2] for i in range(3, len(text) - 2)}:
            gen = pipe.generate(prompt_ids=[1, 2], max_new_tokens=40, seed=seed, stop=[stop], speculative=False)
            assert gen.finish_reason == "stop"
            assert gen.text == text[: text.index(stop)]
            spec_events = list(pipe.stream(prompt_ids=[1, 2], max_new_tokens=40, seed=seed, stop=[stop]))
            spec_text = "".join(e.text for e in spec_events)
            assert stop not in spec_text
            assert spec_events[-1].generation.text == spec_text
            return
    pytest.fail("no seed produced text long enough for a stop string")


def test_drafter_with_a_shorter_context_stops_drafting_at_its_limit():
    pipe = tiny_pipeline("drafter.source.context_length=10", "drafter.num_tokens=3", "target.source.init_scale=3")
    spec = pipe.generate(prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=20)
    plain = pipe.generate(prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=20, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted <= 3 * 5


def test_per_call_gamma():
    pipe = tiny_pipeline("drafter.num_tokens=2", "target.source.init_scale=3")
    wide = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30, num_tokens=5)
    assert len(wide.stats.proposed_per_position) == 5
    assert wide.token_ids == pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30).token_ids
    assert len(pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=30).stats.proposed_per_position) == 2
    for bad in (0, 65, 10**9, 2.5, True, "3"):  # one parser and bound with drafter.num_tokens (64)
        with pytest.raises(ConfigError, match=f"^num_tokens must be a positive integer up to 64 or auto, got {bad!r}$"):
            pipe.generate(prompt_ids=[1], num_tokens=bad)
    assert len(pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, num_tokens=64.0).token_ids) == 4
