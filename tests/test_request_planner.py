"""One planner per request (specgen.planning.planner): it owns the planning state, the round context
is frozen, cost measurement does not re-enter the engine, and a planner cut that peeks at the
target's p is caught by the same chi-square test that passes the planner's own cut."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY, tiny_pipeline
from exact import exact_distribution, goodness_of_fit, sample_counts

import specgen
from specgen.drafters import Proposal
from specgen.engine import pipeline as pipeline_module
from specgen.engine import round as round_module
from specgen.planning import AcceptanceHistory, CostTable, measure
from specgen.planning.planner import Planner, chain_prefix
from specgen.processors import CommittedCounts, History

VOCAB8 = ("target.source.vocab_size=8", "drafter.source.vocab_size=8")
PROMPT = [1, 2, 3]
LENGTH = 3
NUM_SAMPLES = 1200
MIN_P_VALUE = 1e-3
#: Drafting pays when the first draft is likely accepted: the cut decides how much is verified.
TABLE = CostTable(chain=tuple(1.0 + 0.2 * n for n in range(9)), tree=(), step_s=1e-3)


def test_each_request_owns_its_planner_and_the_round_context_is_frozen():
    pipe = tiny_pipeline(drafter="ngram")
    first, ctx = pipe.open_request([1, 2, 3, 1, 2, 3], max_new_tokens=8, seed=0)
    second, _ = pipe.open_request([1, 2, 3, 1, 2, 3], max_new_tokens=8, seed=0)
    assert isinstance(first.planner, Planner) and first.planner is not second.planner
    assert isinstance(first.planner.history, AcceptanceHistory)
    assert first.planner.history is not second.planner.history
    assert (first.planner.max_tokens, first.planner.tree_width) == (pipe.drafter.max_tokens, pipe.drafter.tree_width)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.read_once = True
    plain, _ = pipe.open_request([1, 2, 3], max_new_tokens=4, seed=0, use_spec=False)
    assert plain.draft is None and plain.planner.load_costs is None  # a plain request never plans


def test_planned_rounds_teach_the_requests_planner(monkeypatch):
    monkeypatch.setattr("specgen.planning.cost_cache.cost_table", lambda subject, **kwargs: TABLE)
    pipe = tiny_pipeline(drafter="ngram")
    request, ctx = pipe.open_request([1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=12, seed=0)
    for _ in range(4):
        round_module.speculative_round(request, ctx, "auto")
    assert request.planner.costs is TABLE and request.planner.history.rounds > 0


def test_measuring_costs_does_not_enter_the_engine(monkeypatch):
    """The draft session a cost table times opens through the drafter's and the target's protocols:
    opening a request or running a round while measuring fails the measurement."""
    def refuse(*args, **kwargs):
        raise AssertionError("cost measurement re-entered the engine")

    pipes = [tiny_pipeline(drafter=drafter) for drafter in ("tiny", "ngram")]
    monkeypatch.setattr(round_module, "speculative_round", refuse)
    monkeypatch.setattr(pipeline_module, "speculative_round", refuse)
    monkeypatch.setattr(pipeline_module.Pipeline, "open_request", refuse)
    for pipe in pipes:
        table = measure.measure(pipe.cost_subject(), repeats=1, max_tokens=4)
        assert len(table.chain) == 4 and table.draft_fixed >= 0.0


def test_the_calibration_session_is_warm():
    """A draft model's session is prefilled once, at opening: timed proposals do not prefill again."""
    pipe = tiny_pipeline(drafter="tiny")
    context = measure.calibration_context(pipe.cost_subject(), 4)
    session = pipe.cost_subject().open_draft(context, 4)
    before = len(session.cache)
    assert before >= len(context) - 1
    mark = session.mark()
    session.propose(4)
    session.rollback(mark)
    assert len(session.cache) == before


def test_chain_prefix_keeps_a_prefix():
    proposal = Proposal([3, 4, 5], torch.full((3, 8), 0.125, dtype=torch.float64), None, [0.9, 0.5, 0.1])
    assert chain_prefix(proposal, 3) is proposal and not len(chain_prefix(proposal, 0))
    cut = chain_prefix(proposal, 2)
    assert cut.tokens == [3, 4] and cut.draft_probs.shape == (2, 8) and cut.confidence == [0.9, 0.5]


@pytest.fixture(scope="module")
def sampled():
    pipe = tiny_pipeline(*VOCAB8, "sampling.temperature=1.0")
    assert str(pipe.guarantee) == "exact" and pipe.drafter.num_tokens == "auto"
    return pipe


def _p_value(pipe) -> float:
    expected = exact_distribution(pipe, PROMPT, LENGTH)
    counts = sample_counts(pipe, PROMPT, LENGTH, NUM_SAMPLES)
    return goodness_of_fit(counts, expected)[0]


def _draft_in_prefill_rounds(monkeypatch) -> None:
    """The cut is tested at every drafted position, the first token's included: the prefill round
    drafts here too (by default it drafts nothing, :func:`specgen.planning.planner.prefills`)."""
    monkeypatch.setattr("specgen.planning.planner.prefills", lambda feed: False)


def test_the_planners_cut_is_exact(sampled, monkeypatch):
    _draft_in_prefill_rounds(monkeypatch)
    monkeypatch.setattr("specgen.planning.cost_cache.cost_table", lambda subject, **kwargs: TABLE)
    assert _p_value(sampled) > MIN_P_VALUE


def test_a_planner_cut_that_peeks_at_the_target_is_caught(sampled, monkeypatch):
    """Negative control (contract 5): a Planner whose cut drops the draft wherever the target's p of
    its first token is below q (the drafts verification might reject) must fail the same test."""
    _draft_in_prefill_rounds(monkeypatch)
    monkeypatch.setattr("specgen.planning.cost_cache.cost_table", lambda subject, **kwargs: TABLE)
    monkeypatch.setattr(Planner, "draft", _peeking_draft(sampled))
    assert _p_value(sampled) < MIN_P_VALUE


def _peeking_draft(pipe):
    draft = Planner.draft

    def peeking(self, session, num_tokens, room, feed=1):
        proposal, predicted = draft(self, session, num_tokens, room, feed)
        if not len(proposal) or proposal.draft_probs is None:
            return proposal, predicted
        committed = session.ctx.committed
        raw = pipe.target.forward(pipe.target.new_cache(), committed.tokens, keep=1)  # [1, vocab]
        counts = CommittedCounts.start(committed.tokens[: committed.num_prompt], len(committed.seen),
                                       torch.device("cpu"))
        counts.commit(committed.tokens[committed.num_prompt:])
        target_p = float(pipe.stack.probs(raw, History(counts, [], 1))[0, proposal.tokens[0]])
        keep = 0 if target_p < float(proposal.draft_probs[0, proposal.tokens[0]]) else len(proposal)
        return chain_prefix(proposal, keep), predicted

    return peeking


@pytest.mark.parametrize("policy", ["prefill rounds plain", "control: prefill rounds draft"])
def test_a_prefill_round_asks_a_shadowing_drafter_nothing(policy, monkeypatch):
    """One token a request, from a 6-token prompt: its only round prefills, so the n-gram drafter (a
    shadowing one) is asked for no shadow token either, single or batched (its index would read the
    whole prompt inside the time to first token). A 1-token prompt's round feeds one token, drafts
    nothing (one token left) and shadows. The control lets prefill rounds draft, and then they ask."""
    from specgen.drafters.ngram import NgramSession

    if policy.startswith("control"):
        monkeypatch.setattr("specgen.planning.planner.prefills", lambda feed: False)
        monkeypatch.setattr("specgen.batch.drafting.prefills", lambda feed: False)
    asked = []
    propose = NgramSession.propose
    monkeypatch.setattr(NgramSession, "propose", lambda self, budget: asked.append(budget) or propose(self, budget))
    pipe = tiny_pipeline(drafter="ngram")
    quantized = specgen.pipeline(*TINY, "dtype=int8", "drafter=ngram", progress=False)
    assert pipe.drafter.num_tokens == quantized.drafter.num_tokens == "auto"
    prompt = [1, 2, 3, 1, 2, 3]
    pipe.generate(prompt_ids=prompt, max_new_tokens=1)
    quantized.generate_batch([dict(prompt_ids=prompt, max_new_tokens=1)] * 4, batch_size=4)
    if policy.startswith("control"):
        assert asked
    else:
        assert asked == []
        pipe.generate(prompt_ids=[1], max_new_tokens=1)
        assert asked == [1]


@pytest.mark.parametrize("policy", ["prefill rounds plain", "control: prefill rounds draft"])
def test_a_planned_round_that_prefills_drafts_nothing(policy, monkeypatch):
    """Two tokens a request: the first round prefills the 3-token prompt, so it drafts nothing (its
    first token waits on the prefill alone) and the second has no room to. Single requests, and
    batched rows on a cache that feeds a fresh prompt in its row's first step (int8; torch float
    prefills a row apart, and its first step feeds one token). A 1-token prompt's first round feeds
    one token and drafts. The control lets prefill rounds draft, and then rows do."""
    if policy.startswith("control"):
        monkeypatch.setattr("specgen.planning.planner.prefills", lambda feed: False)
        monkeypatch.setattr("specgen.batch.drafting.prefills", lambda feed: False)
    pipe = tiny_pipeline("target.source.vocab_size=8", "drafter.source.vocab_size=8", "sampling.temperature=1.0")
    quantized = specgen.pipeline(*TINY, "dtype=int8", "drafter=tiny", "sampling.temperature=1.0", progress=False)
    assert pipe.drafter.num_tokens == quantized.drafter.num_tokens == "auto"
    assert not quantized.target.new_batch(8, 64).prefills_apart
    requests = [dict(prompt_ids=[1, 2, 3], max_new_tokens=2, seed=s) for s in range(8)]
    single = [pipe.generate(**r).stats.drafted for r in requests]
    batched = [g.stats.drafted for g in quantized.generate_batch(requests, batch_size=8)]
    one_token = [pipe.generate(prompt_ids=[1], max_new_tokens=2, seed=s).stats.drafted for s in range(8)]
    assert sum(one_token) > 0
    if policy.startswith("control"):
        assert sum(single) > 0 and sum(batched) > 0, (single, batched)
    else:
        assert single == [0] * 8 and batched == [0] * 8, (single, batched)
        first = next(iter(pipe.stream(prompt_ids=[1, 2, 3], max_new_tokens=8, seed=0)))
        assert first.kind == "plain" and first.gamma == 0 and first.round == 1
