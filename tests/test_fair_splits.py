"""Prompt chunks sized by time on llama.cpp batches, where the model measures that how a prompt's
decodes are split changes no logit (:func:`specgen.models.llama_batch.split_gap` is 0): every row's
tokens still equal its solo run's; where the measurement is not 0, chunks keep the solo run's splits.
Chunk widths are bounded, never timed, here."""

from __future__ import annotations

import pytest
from test_fair_batch import CHUNK, LONG, SHORT, _pipe, _run, _spec
from test_llama_cpp_backend import TINY_SOURCE, _decodes

from specgen.batch import Batch
from specgen.errors import SpecgenError
from specgen.events import TokenEvent
from specgen.models import llama_batch, llama_context, llama_cpp, load_llama_cpp

pytestmark = pytest.mark.skipif(not llama_cpp.available(), reason="llama-cpp-python is not installed")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path_factory.getbasetemp() / "specgen-cache"))


@pytest.fixture
def decodes(monkeypatch) -> list[list[tuple[int, int, int, bool]]]:
    return _decodes(monkeypatch)


def _width_dependent_logits(monkeypatch) -> None:
    """Make every decode's logits depend on its width (a bump of 50 on token (7 * width + 1) mod vocab),
    as a model whose kernels change with the decode's shape would."""
    decode, logits = llama_context.LlamaContext._decode, llama_context.LlamaContext._logits

    def decoded(self, entries):
        self.probe_width = len(entries)
        return decode(self, entries)

    def bumped(self, rows):
        out = logits(self, rows)  # [rows, n_vocab]
        out[:, (7 * self.probe_width + 1) % self.vocab_size] += 50.0
        return out

    monkeypatch.setattr(llama_context.LlamaContext, "_decode", decoded)
    monkeypatch.setattr(llama_context.LlamaContext, "_logits", bumped)


def test_the_tiny_model_measures_splits_free():
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    assert llama_batch.split_gap(lm) == 0.0
    assert lm.prefill_splits_free and lm.new_batch(1, 256).splits_free


def test_negative_control_the_split_probe_sees_width_dependent_logits(monkeypatch):
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    _width_dependent_logits(monkeypatch)
    assert llama_batch.split_gap(lm) >= 50.0
    assert not lm.prefill_splits_free and not lm.new_batch(1, 256).splits_free


def test_chunks_sized_by_time_keep_every_row_solo(monkeypatch, decodes):
    """The long prompt is fed in chunks of at most PREFILL_BUDGET tokens (its last, with its first
    logits, too), the short rows get their first token in their first step, and every row's tokens
    equal its solo run's."""
    pipe = _pipe(monkeypatch, "none", splits="measured")  # no drafter: every decode is the batch's
    assert pipe.target.prefill_splits_free
    decodes.clear()
    tokens, first = _run(pipe, decodes, chunked=True)
    for i in (1, 2):
        assert first[i][1] == 1 and first[i][2] < len(LONG)
    assert first[0][1] >= len(LONG) // llama_batch.PREFILL_BUDGET  # a step per chunk at least
    widths = [len(d) for d in decodes if all(s == 0 for s, *_ in d) and d[-1][2] < len(LONG)]  # row 0: the long
    assert sum(widths) == len(LONG) and max(widths) <= llama_batch.PREFILL_BUDGET < CHUNK
    solo = {i: pipe.generate(prompt_ids=p, max_new_tokens=6).token_ids for i, p in enumerate([LONG, *SHORT])}
    assert tokens == solo


def test_prefill_take_is_sized_by_the_measured_cost_per_token():
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    batch = lm.new_batch(2, 256)
    budget = llama_batch.PREFILL_BUDGET
    assert batch.splits_free  # the tiny model measures splits free (test above): chunks sized by time
    assert batch.prefill_take(0, 100) == budget  # nothing measured yet
    batch.forward([[1, 2, 3], [4] * 5], [0, 0])  # two chunks, timed
    assert batch._cheapest is not None and set(batch._rates) == {0, 1}
    batch._cheapest, batch._rates[0] = 0.01, (3, 0.025)  # this row's tokens now cost 2.5x the cheapest
    assert batch.prefill_take(0, 100) == int(budget / 2.5) or budget < 3
    batch._rates[0] = (3, 0.01)
    assert batch.prefill_take(0, 100) == budget
    batch.clear_row(0)
    assert batch.prefill_take(0, 100) == budget and 0 not in batch._rates
    batch.splits = "grid"
    assert batch.prefill_take(1, 100) == batch.prefill_chunk - 5  # to the end of the solo run's chunk


def _long_alone(pipe) -> list[int]:
    """The long prompt alone on a batch (chunked as the batch decides); -> its tokens."""
    batch = Batch(pipe, 1, row_context=512)
    batch.add(_spec(pipe, LONG, 0))
    out = []
    while batch.active:
        out.extend(e.token_id for _, e in batch.step() if isinstance(e, TokenEvent))
    return out


@pytest.mark.parametrize("forced_free", [False, True])
def test_where_splits_change_logits_chunks_keep_the_solo_splits(monkeypatch, forced_free):
    """With decode-width-dependent logits the model measures splits not free, and the batch's long
    prompt gives its solo tokens (fed on the solo run's grid). Negative control (forced_free): sized
    by time anyway, its last chunk is decoded narrower than its solo run's, and its tokens differ."""
    pipe = _pipe(monkeypatch, "none", splits="measured")
    assert pipe.target.capabilities.batches  # measured before the logits depend on widths
    _width_dependent_logits(monkeypatch)
    assert not pipe.target.prefill_splits_free
    if forced_free:
        monkeypatch.setattr(llama_cpp.LlamaCppLM, "prefill_splits_free", property(lambda self: True))
    solo = pipe.generate(prompt_ids=LONG, max_new_tokens=6).token_ids
    assert (_long_alone(pipe) == solo) != forced_free


def test_a_failed_step_takes_back_the_chunk_it_fed():
    """The chunk rows are decoded before the rest; when the rest's decode fails, no row keeps its feed."""
    lm = load_llama_cpp(TINY_SOURCE, name="t", threads=1).lm
    batch = lm.new_batch(2, 256)
    batch.forward([[1, 2], [3]], [1, 1])
    with pytest.raises(SpecgenError):
        batch.forward([[4, 5, 6], [lm.n_vocab + 1]], [0, 1])  # row 1's token is outside the vocabulary
    assert [len(row) for row in batch.rows] == [2, 1]
    batch.forward([[4, 5, 6], [7]], [0, 1])
    assert [len(row) for row in batch.rows] == [5, 2]
