"""The llama.cpp backend (backend=llama_cpp) on tiny GGUF files written in code: the target protocol,
batch invariance as the guarantee's measured basis, greedy identity, distribution exactness, refusals."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from concurrent_requests import shared_cell_pool
from conftest import TINY
from exact import assert_greedy_identity, exact_distribution, goodness_of_fit, sample_counts

import specgen
from specgen.engine.assemble import verify_shapes
from specgen.errors import ConfigError, SpecgenError
from specgen.models import llama_context, llama_cpp, load_llama_cpp, load_model
from specgen.models.backends import choose_backend
from specgen.models.target import Target
from specgen.sampling import rejection

pytestmark = pytest.mark.skipif(not llama_cpp.available(), reason="llama-cpp-python is not installed")

LLAMA = ("backend=llama_cpp",)
TINY_SOURCE = dict(kind="tiny", seed=0, vocab_size=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   context_length=512, init_scale=1.0)
PROMPTS = [[1, 2, 3], [5, 4, 3, 2, 1, 5, 4, 3], [7, 7, 7, 1], [2, 9, 11, 2, 9, 11, 2]]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path_factory.getbasetemp() / "specgen-cache"))


def _pipe(*overrides: str, drafter: str = "tiny"):
    return specgen.pipeline(*TINY, *LLAMA, f"drafter={drafter}", *overrides, progress=False)


def test_the_tiny_gguf_computes_the_torch_model():
    """The GGUF writer keeps the model: float32 weights give the torch model's logits up to the f16 KV cache."""
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1, tiny_type="F32").lm
    reference = load_model(TINY_SOURCE, name="r", dtype=torch.float32, device=torch.device("cpu")).lm
    ids = [3, 5, 7, 1, 2, 9, 4, 4, 6, 10, 12]
    got = lm.forward(lm.new_cache(), ids, keep=len(ids))  # [11, 16]
    want = reference.forward(reference.new_cache(), ids, keep=len(ids))
    assert got.shape == want.shape == (len(ids), 16) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=2e-2), float((got - want).abs().max())
    assert isinstance(lm, Target) and lm.backend == "llama_cpp"


@pytest.mark.parametrize("prefix", [1, 7, 40])
def test_q8_0_verify_logits_equal_single_token_logits_at_every_width(prefix):
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    gap, _ = lm.verify_gap(range(2, 18), prefix=prefix)
    assert gap == 0.0


def test_feeds_are_split_at_the_widest_decode_width_measured_batch_invariant(monkeypatch):
    """A width whose decodes differ from single-token ones is never used: feeds are split narrower."""
    asked = []

    def gaps(self, prefix, widths, probe=None):  # as if llama.cpp changed kernels above 16 tokens
        asked.extend(widths)
        return {w: 0.25 if w > 16 else 0.0 for w in widths}

    monkeypatch.setattr(llama_cpp.LlamaCppLM, "_gaps_after", gaps)
    monkeypatch.setattr(llama_context, "PREFILL_TOKENS", 128)  # below the tiny model's 512-token context
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    assert lm.decode_width == 16 and asked == [32, 16, 24, 20, 18, 17]  # bisection
    assert lm.verify_gap([2, 4]) == (0.0, 2) and lm.verify_gap([2, 20]) == (0.25, 20)
    batch = lm.new_batch(2, row_context=256)
    batch.clear_row(1)  # the batch's context for both rows
    sizes = []
    assert lm.pool.size == 1  # every handle below is alone, on the pool's one context
    for context in (*lm.pool.contexts(), batch.context):
        original = context._decode
        monkeypatch.setattr(context, "_decode", lambda entries, o=original: (sizes.append(len(entries)), o(entries)))
    lm.forward(lm.new_cache(), list(range(1, 16)) * 3, keep=45)
    batch.forward([[1, 2, 3] * 7, [4, 5] * 7], [21, 14])
    assert sizes == [16, 16, 13, 16, 16, 3]
    sizes.clear()  # the tokens before the kept rows: one handle a decode, split only at PREFILL_TOKENS
    lm.forward(lm.new_cache(), list(range(1, 16)) * 10, keep=2)
    batch.forward([[1, 2, 3] * 7, [4, 5] * 7], [1, 3])
    # the first kept row goes in its span's last decode: 149 = 128 + 21, then 1; the batch rows' spans
    # 20 + 1 and 11 + 1, then the second row's other 2 kept rows
    assert sizes == [128, 21, 1, 21, 12, 2]


def test_the_chosen_decode_width_is_batch_invariant_or_the_widest():
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    assert 2 <= lm.decode_width <= llama_context.BATCH_TOKENS
    assert lm.verify_gap([lm.decode_width])[0] == 0.0 or lm.decode_width == llama_context.BATCH_TOKENS


def test_a_build_with_amx_kernels_loads_without_its_extra_weight_buffers(monkeypatch):
    lib = llama_context.library()
    loaded = []
    original = lib.llama_model_load_from_file
    monkeypatch.setattr(lib, "llama_model_load_from_file",
                        lambda path, params: (loaded.append(params.use_extra_bufts), original(path, params))[1])
    for info, extra in ((b"AVX2 = 1 | AMX_INT8 = 1 | OPENMP = 1", False), (b"AVX2 = 1 | AMX_INT8 = 0 |", True)):
        monkeypatch.setattr(lib, "llama_print_system_info", lambda info=info: info)
        loaded.clear()
        load_llama_cpp(TINY_SOURCE, name="t", threads=1, repack="on")
        assert loaded == [extra]


def test_repacked_weights_are_kept_only_where_a_decode_width_is_batch_invariant(monkeypatch):
    monkeypatch.setattr(llama_cpp, "_has_amx_kernels", lambda lib: False)
    monkeypatch.setattr(llama_cpp.LlamaCppLM, "_gaps_after",  # as if repacking made every width differ
                        lambda self, prefix, widths, probe=None: {w: 0.5 if self.repacked else 0.0 for w in widths})
    auto = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    assert not auto.repacked and auto.verify_gap([2, 4]) == (0.0, 2) and "repacked" not in auto.describe()["dtype"]
    on = load_llama_cpp(TINY_SOURCE, name="t", threads=1, repack="on").lm
    assert on.repacked and on.verify_gap([2])[0] == 0.5 and ", repacked" in on.describe()["dtype"]
    monkeypatch.setattr(llama_cpp.LlamaCppLM, "_gaps_after", lambda self, prefix, widths, probe=None: {w: 0.0 for w in widths})
    assert load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm.repacked
    monkeypatch.setattr(llama_cpp.LlamaCppLM, "_gaps_after",  # repacked: exact up to 3 tokens; as stored: up to 7
                        lambda self, prefix, widths, probe=None: {w: float(w > (3 if self.repacked else 7)) for w in widths})
    narrow = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    assert not narrow.repacked and narrow.decode_width == 7
    assert load_llama_cpp(TINY_SOURCE, name="t", threads=1, repack="on").lm.decode_width == 3
    assert not load_llama_cpp(TINY_SOURCE, name="t", threads=1, repack="off").lm.repacked


def test_flash_attention_is_off_unless_only_flash_attention_is_batch_invariant(monkeypatch):
    monkeypatch.setattr(llama_cpp, "_has_amx_kernels", lambda lib: False)
    opened = []
    real_open = llama_cpp.LlamaCppLM._open
    monkeypatch.setattr(llama_cpp.LlamaCppLM, "_open",
                        lambda self, *args: (opened.append(self.flash_attention), real_open(self, *args))[1])

    def gaps(off: float, on: float):
        monkeypatch.setattr(llama_cpp.LlamaCppLM, "_gaps_after", lambda self, prefix, widths, probe=None:
                            {w: on if self.flash_attention == "on" else off for w in widths})
        opened.clear()

    gaps(off=0.0, on=0.0)
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1, repack="off").lm
    assert lm.flash_attention == "off" and opened == ["off"] and "flash" not in lm.describe()["dtype"]
    gaps(off=0.5, on=0.0)  # only flash attention is batch invariant: auto turns it on
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1, repack="off").lm
    assert lm.flash_attention == "on" and opened == ["off", "on"] and lm.verify_gap([2, 4]) == (0.0, 2)
    assert lm.describe()["dtype"].endswith(", flash attention")
    gaps(off=0.5, on=0.0)  # an explicit setting is kept, measured gap and all
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1, repack="off", flash_attention="off").lm
    assert opened == ["off"] and lm.verify_gap([2])[0] == 0.5
    gaps(off=0.5, on=0.5)  # neither path is: the last one tried stays, and the run measures its gap
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1, repack="off").lm
    assert opened == ["off", "on"] and lm.verify_gap([2])[0] == 0.5


def test_the_draft_model_repacks_unless_repacking_is_off():
    from specgen.engine.assemble import _repack

    assert [_repack(s, "target") for s in llama_cpp.REPACK] == list(llama_cpp.REPACK)
    assert [_repack(s, "drafter") for s in llama_cpp.REPACK] == ["on", "on", "off"]


def test_crop_rolls_back_and_refeeding_gives_the_same_rows():
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    cache = lm.new_cache()
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    first = lm.forward(cache, ids, keep=5)
    cache.crop(5)
    assert len(cache) == 5 and cache.tokens == ids[:5]
    other = lm.forward(cache, [11, 12], keep=2)  # what a rejected draft would have fed
    cache.sync(ids[:5])
    again = lm.forward(cache, torch.tensor(ids[5:]), keep=5)  # device-tensor feeds are read back
    assert torch.equal(first, again) and not torch.equal(other, again[:2])
    assert cache.tokens == ids


def test_bad_tokens_and_overlong_feeds_are_refused_and_leave_the_cache_as_it_was():
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    cache = lm.new_cache()
    lm.forward(cache, [1, 2], keep=1)
    with pytest.raises(SpecgenError, match="outside its vocabulary"):
        lm.forward(cache, [3, 99], keep=1)
    with pytest.raises(SpecgenError, match="do not fit"):
        lm.forward(cache, [1] * 600, keep=1)
    assert cache.tokens == [1, 2]
    assert torch.equal(lm.forward(cache, [3], keep=1),
                       lm.forward(lm.new_cache(), [1, 2, 3], keep=1))


@pytest.mark.parametrize("drafter,gamma", [("tiny", 1), ("tiny", 3), ("tiny", "auto"), ("ngram", 4), ("ngram", "auto")])
def test_greedy_speculation_equals_plain_decoding_token_for_token(drafter, gamma):
    pipe = _pipe(f"drafter.num_tokens={gamma}", drafter=drafter)
    assert str(pipe.guarantee) == "greedy" and pipe.target.backend == "llama_cpp"
    assert assert_greedy_identity(pipe, PROMPTS, 24) > 0, "the drafter must propose for this test to mean anything"


def test_speculative_sampling_matches_the_backends_distribution():
    pipe = _pipe("target.source.vocab_size=8", "drafter.source.vocab_size=8", "sampling.temperature=1.0")
    assert str(pipe.guarantee) == "exact"
    expected = exact_distribution(pipe, [1, 2, 3], 3)
    counts = sample_counts(pipe, [1, 2, 3], 3, 1200)
    assert pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=3, seed=0).stats.drafted > 0
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"


def test_negative_control_the_same_test_catches_a_wrong_residual(monkeypatch):
    pipe = _pipe("target.source.vocab_size=8", "drafter.source.vocab_size=8", "sampling.temperature=1.0")
    expected = exact_distribution(pipe, [1, 2, 3], 3)
    monkeypatch.setattr(rejection, "positive_residual", lambda target_probs, draft_probs: target_probs)
    p_value, _ = goodness_of_fit(sample_counts(pipe, [1, 2, 3], 3, 1200), expected)
    assert p_value < 1e-3


def test_a_measured_verify_gap_makes_the_run_approximate(monkeypatch):
    monkeypatch.setattr(llama_cpp.LlamaCppLM, "verify_gap", lambda self, widths, prefix=16: (3e-6, 9))
    pipe = _pipe()
    assert str(pipe.guarantee).startswith("approximate: tiny on llama_cpp") and "9-token verify logits" in pipe.guarantee.reason
    plain = _pipe("speculative=false")
    assert str(plain.guarantee) == "off: speculative=false"  # nothing verified, nothing to measure


@pytest.mark.parametrize("setting", ["llama_cpp.tiny_type=Q8_0", "llama_cpp.tiny_type=F32",
                                     "llama_cpp.flash_attention=off", "llama_cpp.flash_attention=auto"])
def test_the_guarantee_follows_the_measurement_for_each_file_type_and_attention(setting):
    pipe = _pipe(setting)
    gap, _ = pipe.target.verify_gap(verify_shapes(pipe.drafter)[0])  # every width the run verifies
    assert (str(pipe.guarantee) == "greedy") == (gap == 0.0), (setting, gap, pipe.guarantee)


def test_an_unknown_flash_attention_setting_is_refused():
    with pytest.raises(ConfigError, match="llama_cpp.flash_attention='maybe' is not one of auto, off, on"):
        _pipe("llama_cpp.flash_attention=maybe")
    with pytest.raises(ConfigError, match="llama_cpp.repack='yes' is not one of auto, on, off"):
        _pipe("llama_cpp.repack=yes")


def _count_batched_decodes(monkeypatch) -> list[int]:
    """Handles per LlamaContext.forward_rows call, recorded as they happen."""
    calls: list[int] = []
    real = llama_context.LlamaContext.forward_rows

    def counted(self, caches, feeds, keeps, check=True):
        calls.append(len(caches))
        return real(self, caches, feeds, keeps, check)

    monkeypatch.setattr(llama_context.LlamaContext, "forward_rows", counted)
    return calls


@pytest.mark.parametrize("drafter,overrides", [
    ("ngram", ()), ("ngram", ("sampling.temperature=1.0", "drafter.num_tokens=3")),
    ("tiny", ()), ("tiny", ("sampling.temperature=1.0", "drafter.num_tokens=2")), ("tiny", ("drafter.num_tokens=auto",)),
])
def test_batched_rows_equal_their_requests_run_alone(drafter, overrides, monkeypatch):
    """Rows share decodes (several sequences per llama_decode) and each row's tokens equal its
    request's alone: greedy always, and seeded sampling with a fixed draft length. Six prompts in
    a batch of four also refill freed rows."""
    pipe = _pipe(*overrides, drafter=drafter)
    assert pipe.target.capabilities.batches
    prompts = [*PROMPTS, [3, 3], [1, 5, 9, 13, 2]]
    calls = _count_batched_decodes(monkeypatch)
    rows = pipe.generate_batch([{"prompt_ids": p, "seed": i} for i, p in enumerate(prompts)], batch_size=4,
                               max_new_tokens=12)
    assert max(calls) == 4, calls  # four rows in one decode
    assert [r.token_ids for r in rows] == [pipe.generate(prompt_ids=p, max_new_tokens=12, seed=i).token_ids
                                           for i, p in enumerate(prompts)]
    assert "speculative=false" in str(rows[0].guarantee) or sum(r.stats.drafted for r in rows) > 0



def _decodes(monkeypatch) -> list[list[tuple[int, int, int, bool]]]:
    """Every llama_decode's entries (sequence, token, position, logits wanted), recorded as they happen."""
    calls: list[list[tuple[int, int, int, bool]]] = []
    real = llama_context.LlamaContext._decode

    def recorded(self, entries):
        calls.append(list(entries))
        return real(self, entries)

    monkeypatch.setattr(llama_context.LlamaContext, "_decode", recorded)
    return calls


def _first_row_decode(calls, prompt: list[int]) -> list[tuple[int, int]]:
    """(token, position) of the prompt's sequence in the decode that gave its last row's logits."""
    for entries in calls:
        for seq, token, position, wanted in entries:
            if wanted and position == len(prompt) - 1 and token == prompt[-1]:
                return [(t, p) for s, t, p, _ in entries if s == seq]
    raise AssertionError("no decode gave the prompt's last row")


@pytest.mark.parametrize("apart", [False, True])
def test_a_prompts_last_token_is_decoded_with_its_prompt_on_every_path(apart, monkeypatch):
    """Plain, speculative and batched runs read a prompt's first logits from one decode of the same
    tokens, the whole prompt. Control (apart): a batch that prefilled the prompt before its first
    step would read them from a decode of its own."""
    from specgen.models.llama_batch import LlamaBatch

    pipe = _pipe("prefix_cache.entries=0", drafter="ngram")  # each run prefills the whole prompt itself
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # prompt lookup drafts in the first round
    monkeypatch.setattr(LlamaBatch, "prefills_apart", apart)
    calls = _decodes(monkeypatch)
    seen = []
    for run in (lambda: pipe.generate(prompt_ids=prompt, max_new_tokens=3, speculative=False),
                lambda: pipe.generate(prompt_ids=prompt, max_new_tokens=3, num_tokens=2),
                lambda: pipe.generate_batch([{"prompt_ids": prompt}, {"prompt_ids": [3, 3]}], batch_size=2,
                                            max_new_tokens=3)):
        calls.clear()
        run()
        seen.append(_first_row_decode(calls, prompt))
    whole = [(t, i) for i, t in enumerate(prompt)]
    assert seen[:2] == [whole, whole]
    assert (seen[2] == whole) is not apart


def test_batched_rows_follow_the_backends_distribution():
    pipe = _pipe("target.source.vocab_size=8", "drafter.source.vocab_size=8", "sampling.temperature=1.0")
    expected = exact_distribution(pipe, [1, 2, 3], 3)
    rows = pipe.generate_batch([{"prompt_ids": [1, 2, 3], "seed": s} for s in range(1200)], batch_size=8,
                               max_new_tokens=3)
    assert sum(r.stats.drafted for r in rows) > 0
    p_value, tv = goodness_of_fit(Counter(tuple(r.token_ids) for r in rows), expected)
    assert p_value > 1e-3, f"chi-square p={p_value:.2e}, TV={tv:.3f}"


def _replay_gap(lm, rows_of, steps: int = 30, seed: int = 0) -> float:
    """Rows (from ``rows_of(n)``) fed ragged feeds, rolled back and refilled as batches do; the largest
    logit difference from replaying each row's history on one handle of ``lm``'s own context."""
    rng = random.Random(seed)
    vocab = lm.vocab_size
    rows, handles = rows_of(4)
    history: list[list] = [[] for _ in handles]

    def fresh(r):
        prefix = [rng.randrange(vocab) for _ in range(rng.randint(3, 12))]
        history[r] = [("feed", prefix, 1, lm_forward(handles[r], prefix))]

    def lm_forward(handle, tokens):
        return handle.context.forward_rows([handle], [tokens], [1])[0]

    for r in range(len(handles)):
        fresh(r)
    for step in range(steps):
        feeds = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for _ in handles]
        outs = rows(feeds)
        for r, handle in enumerate(handles):
            history[r].append(("feed", feeds[r], len(feeds[r]), outs[r]))
            keep = len(handle) - rng.randint(0, len(feeds[r]) - 1)
            handle.crop(keep)
            history[r].append(("crop", keep))
        if step % 7 == 6:
            r = rng.randrange(len(handles))
            handles[r].crop(0)
            fresh(r)
    worst = 0.0
    alone = lm.new_cache()
    for events in history:
        alone.crop(0)
        for event in events:
            if event[0] == "crop":
                alone.crop(event[1])
            else:
                worst = max(worst, float((lm.forward(alone, event[1], keep=event[2]) - event[3]).abs().max()))
    return worst


def test_batched_rows_and_concurrent_handles_see_solo_logits_and_a_shared_cell_pool_would_not():
    """The reason a batch has one KV stream per row and a model a context per handle: through
    ragged feeds, rollbacks and refills, rows' and concurrent handles' logits equal a solo replay
    bit for bit, while the same rows as sequences of one shared (unified) pool drift (the
    negative control)."""
    lm = load_llama_cpp(TINY_SOURCE | {"hidden_size": 64, "num_layers": 3}, name="t", threads=1).lm

    def streams(n):
        batch = lm.new_batch(n, 256)
        batch.clear_row(n - 1)  # every row made
        return (lambda feeds: batch.forward(feeds, [len(f) for f in feeds])), batch.rows

    def shared_pool(n):  # every handle, the solo replay's too, a sequence of one context
        shared_cell_pool(lm, n + 1)
        handles = [lm.new_cache() for _ in range(n)]
        context = handles[0].context
        return (lambda feeds: context.forward_rows(handles, feeds, [len(f) for f in feeds])), handles

    def own_contexts(n):  # what requests on one model get: a context per handle, fed one after another
        handles = [lm.new_cache() for _ in range(n)]
        return (lambda feeds: [lm.forward(h, f, keep=len(f)) for h, f in zip(handles, feeds, strict=True)]), handles

    assert _replay_gap(lm, streams) == 0.0
    assert max(_replay_gap(lm, own_contexts, seed=s) for s in range(3)) == 0.0  # seed 1 drifts in a shared pool
    assert max(_replay_gap(lm, shared_pool, seed=s) for s in range(3)) > 0.0


def test_rows_run_one_after_another_where_batches_are_measured_inexact(monkeypatch):
    monkeypatch.setattr(llama_cpp, "batch_gap", lambda lm, rows=4: 1e-6)
    pipe = _pipe(drafter="ngram")
    assert not pipe.target.capabilities.batches
    calls = _count_batched_decodes(monkeypatch)
    rows = pipe.generate_batch([{"prompt_ids": p} for p in PROMPTS], batch_size=4, max_new_tokens=12)
    assert set(calls) == {1}
    assert [r.token_ids for r in rows] == [pipe.generate(prompt_ids=p, max_new_tokens=12).token_ids for p in PROMPTS]


def test_the_models_own_context_is_llama_cpp_context_at_most_its_training_one():
    small = _pipe("llama_cpp.context=256", "target.source.context_length=512", drafter="ngram")
    assert small.target.context_length == 256
    with pytest.raises(SpecgenError, match="context is 256; shorten the prompt or raise llama_cpp.context"):
        small.generate(prompt_ids=[1] * 300, max_new_tokens=4)
    assert len(small.generate(prompt_ids=[1] * 200, max_new_tokens=4).token_ids) == 4
    trained = _pipe("llama_cpp.context=null", "target.source.context_length=512", drafter="ngram")
    assert trained.target.context_length == 512
    auto = _pipe("llama_cpp.context=auto", "target.source.context_length=512", drafter="ngram")
    assert auto.target.context_length == 512
    with pytest.raises(ConfigError, match=r"^llama_cpp\.context=4096 is more than target's training context \(512 "
                                          r"tokens\); use at most 512, null \(the training context\) or auto$"):
        _pipe("llama_cpp.context=4096", "target.source.context_length=512", drafter="ngram")


def test_an_online_row_longer_than_the_batch_row_context_is_refused_alone():
    from specgen.batch import BatchScheduler

    pipe = _pipe("llama_cpp.batch_row_context=256", "target.source.context_length=512", drafter="ngram")
    scheduler = BatchScheduler(pipe, batch_size=2)
    try:
        with pytest.raises(SpecgenError, match="need 310 tokens; a batched row here holds 256"):
            scheduler.generate(prompt_ids=[1] * 10, max_new_tokens=300)
        assert len(scheduler.generate(prompt_ids=[1, 2, 3], max_new_tokens=5).token_ids) == 5
    finally:
        scheduler.close()


@pytest.mark.parametrize("override,why", [
    ("drafter=eagle", "hidden states"), ("compile=true", "compile"), ("dtype=bfloat16", "torch dtype"),
    ("target=hub target.source.repo=x/y", "reads GGUF files"),
])
def test_what_llama_cpp_cannot_serve_is_refused_before_loading(override, why, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("loaded a model")

    monkeypatch.setattr("specgen.engine.assemble.load_model", no_loading)
    monkeypatch.setattr("specgen.engine.assemble.load_llama_cpp", no_loading)
    with pytest.raises(ConfigError, match=f"backend=llama_cpp cannot serve this run: .*{why}.*use backend=torch"):
        specgen.pipeline(*TINY, *LLAMA, *override.split(), progress=False)


def test_backend_auto_picks_llama_cpp_for_a_gguf_target_on_a_cpu_only():
    cpu = torch.device("cpu")
    gguf = {"backend": "auto", "target": {"source": {"kind": "package_gguf"}}, "drafter": {"kind": "ngram"}}
    assert choose_backend(gguf, cpu) == "llama_cpp"
    assert choose_backend({**gguf, "drafter": {"kind": "eagle"}}, cpu) == "torch"
    assert choose_backend({**gguf, "target": {"source": {"kind": "tiny"}}}, cpu) == "torch"
    assert choose_backend({**gguf, "backend": "torch"}, cpu) == "torch"
    with pytest.raises(ConfigError, match="backend='onnx' is not one of torch, llama_cpp, auto"):
        choose_backend({**gguf, "backend": "onnx"}, cpu)


def test_a_batch_context_grows_with_the_rows_used_and_moved_rows_keep_their_solo_logits():
    """A batch holds one row's KV cache until more rows are used; rows already holding tokens are
    moved to the larger context and their next logits still equal a solo replay bit for bit."""
    lm = load_llama_cpp(TINY_SOURCE | {"hidden_size": 64, "num_layers": 3}, name="t", threads=1).lm
    batch = lm.new_batch(5, 256)
    assert batch.capacity == 1 and batch.context.length == 256  # nothing for the rows not used yet
    rng = random.Random(0)
    histories: list[list[int]] = [[] for _ in range(5)]
    worst = 0.0
    for used in (1, 2, 3, 5, 5):  # rows 1, 2 and 4 join while the earlier ones hold tokens
        batch.clear_row(used - 1)
        histories[used - 1] = []
        feeds = [[rng.randrange(lm.vocab_size) for _ in range(rng.randint(1, 4))] for _ in range(used)]
        outs = batch.forward(feeds, [len(f) for f in feeds])
        for r, feed in enumerate(feeds):
            histories[r].extend(feed)
            alone = lm.new_cache()
            solo = lm.forward(alone, histories[r], keep=len(feed))  # [len(feed), vocab]
            alone.release()
            worst = max(worst, float((outs[r] - solo).abs().max()))
    assert batch.capacity == 5 and worst == 0.0
    assert [len(row) for row in batch.rows] == [len(h) for h in histories]


def test_a_batch_whose_full_rows_exceed_the_memory_available_is_refused_before_allocating(monkeypatch):
    from specgen.models import llama_batch

    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    opened = []
    open_context = lm.open_context
    monkeypatch.setattr(lm, "open_context", lambda *args: opened.append(args) or open_context(*args))
    monkeypatch.setattr(llama_batch, "available_memory", lambda: 256 * lm.kv_bytes_per_token * 3)
    with pytest.raises(ConfigError, match=r"a batch of 4 rows of 256 tokens needs .* lower batch_size"):
        lm.new_batch(4, 256)
    assert opened == []
    monkeypatch.setattr(llama_batch, "available_memory", lambda: 256 * lm.kv_bytes_per_token * 4)
    lm.new_batch(4, 256)
    # the split probe's context (measured on the first batch that fits), then the batch's own
    assert opened == [(256, 1), (256, 1)]
    lm.new_batch(4, 256)
    assert len(opened) == 3  # the probe ran once
