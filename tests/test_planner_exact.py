"""The planner keeps the guarantee: exactness with num_tokens=auto, and negative controls.

Truncation rules are injected by wrapping the drafter's ``propose`` (what the
planner does after drafting). A rule is legal when the kept length is a
stopping time of the drafter's information: "stop after the first token t"
decides to keep token i from tokens before it. Two controls must be caught by
the same chi-square test: "stop *before* the first token t" judges a sampled
token by its own value, and a peeking planner cuts before a token whose target
probability is below the draft's (the drafts it might reject).
"""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_pipeline
from exact import exact_distribution, goodness_of_fit, peeking_draw, sample_counts
from specgen.drafters import Proposal
from specgen.drafters.chain_draw import ChainDraws
from specgen.drafters.small_model import SmallModelSession
from specgen.planning import ChainStopper, CostTable
from specgen.processors import CommittedCounts, History

VOCAB8 = ("target.source.vocab_size=8", "drafter.source.vocab_size=8")
PROMPT = [1, 2, 3]
LENGTH = 3
NUM_SAMPLES = 1200
MIN_P_VALUE = 1e-3
TOKEN = 1  # q = 0.59 where p = 0.02 after PROMPT: cutting before it moves the first token by TV 0.11


def _cut(proposal: Proposal, keep: int) -> Proposal:
    probs = None if proposal.draft_probs is None else proposal.draft_probs[:keep]
    confidence = None if proposal.confidence is None else proposal.confidence[:keep]
    return Proposal(proposal.tokens[:keep], probs, None, confidence)


def _after_token(proposal: Proposal, session) -> int:
    tokens = proposal.tokens
    return tokens.index(TOKEN) + 1 if TOKEN in tokens else len(tokens)


def _before_token(proposal: Proposal, session) -> int:
    tokens = proposal.tokens
    return tokens.index(TOKEN) if TOKEN in tokens else len(tokens)


def _peeking(pipe):
    """Drop the whole draft when the target may reject its first token, p(x) < q(x) (illegal: reads p)."""

    def rule(proposal: Proposal, session) -> int:
        committed, tokens = session.ctx.committed, proposal.tokens
        if not tokens:
            return 0
        raw = pipe.target.forward(pipe.target.new_cache(), committed.tokens, keep=1)  # [1, vocab]
        counts = CommittedCounts.start(committed.tokens[: committed.num_prompt], len(committed.seen),
                                       torch.device("cpu"))
        counts.commit(committed.tokens[committed.num_prompt :])
        target_p = float(pipe.stack.probs(raw, History(counts, [], 1))[0, tokens[0]])
        return 0 if target_p < float(proposal.draft_probs[0, tokens[0]]) else len(tokens)

    return rule


def _with_rule(monkeypatch, rule) -> None:
    propose = SmallModelSession.propose

    def truncated(self, budget: int, stopper=None) -> Proposal:
        proposal = propose(self, budget, stopper)
        return _cut(proposal, rule(proposal, self))

    monkeypatch.setattr(SmallModelSession, "propose", truncated)


def _p_value(pipe) -> float:
    expected = exact_distribution(pipe, PROMPT, LENGTH)
    counts = sample_counts(pipe, PROMPT, LENGTH, NUM_SAMPLES)
    return goodness_of_fit(counts, expected)[0]


@pytest.fixture(autouse=True)
def draft_in_prefill_rounds(monkeypatch):
    """These rules are tested where TOKEN's bias sits, the first token after PROMPT, so the prefill
    round drafts here too (by default it drafts nothing: :func:`specgen.planning.planner.prefills`)."""
    monkeypatch.setattr("specgen.planning.planner.prefills", lambda feed: False)


@pytest.fixture(scope="module")
def sampled():
    pipe = tiny_pipeline(*VOCAB8, "sampling.temperature=1.0")
    assert str(pipe.guarantee) == "exact" and pipe.drafter.num_tokens == "auto"
    return pipe


def test_auto_with_a_legal_token_stopping_rule_is_exact(sampled, monkeypatch):
    _with_rule(monkeypatch, _after_token)
    stats = [sampled.generate(prompt_ids=PROMPT, max_new_tokens=8, seed=s).stats for s in range(20)]
    assert sum(s.drafted for s in stats) > 20 and sum(s.planned_plain for s in stats) > 0
    assert _p_value(sampled) > MIN_P_VALUE


@pytest.mark.parametrize("control", ["judges_its_own_token", "peeks_at_target"])
def test_anticipating_truncation_is_caught(sampled, monkeypatch, control):
    _with_rule(monkeypatch, _before_token if control == "judges_its_own_token" else _peeking(sampled))
    assert _p_value(sampled) < MIN_P_VALUE


@pytest.mark.parametrize("drafter", ["tiny", "ngram"])
def test_greedy_auto_equals_plain(drafter):
    pipe = tiny_pipeline("target.source.init_scale=3", "sampling.repetition_penalty=1.2", drafter=drafter)
    assert str(pipe.guarantee) == "greedy" and pipe.drafter.num_tokens == "auto"
    planned = 0
    for prompt in ([1, 2, 3], [2, 9, 2, 9, 2, 9], [7]):
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=40)
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=40, speculative=False)
        assert spec.token_ids == plain.token_ids
        planned += spec.stats.planned_drafts
        assert spec.stats.planner_summary.startswith("γ auto: mean")
    assert planned > 0


def test_fixed_gamma_is_not_planned():
    pipe = tiny_pipeline("drafter.num_tokens=3", "target.source.init_scale=3")
    stats = pipe.generate(prompt_ids=PROMPT, max_new_tokens=20).stats
    assert stats.planned_rounds == 0 and stats.planner_summary is None
    assert max(stats.proposed_per_position and [len(stats.proposed_per_position)]) == 3


#: A draft model's price (0.12 steps a token, verifying nearly flat): the online stopper, not the
#: budget, decides how long each chain gets, and its lengths vary with the drafter's confidence.
COSTLY_DRAFTS = CostTable(chain=tuple(1.0 + 0.02 * n for n in range(8)), tree=(), draft_per_token=0.12,
                          step_s=1e-3)


@pytest.fixture
def costly(monkeypatch):
    monkeypatch.setattr("specgen.planning.cost_cache.cost_table", lambda subject, **kwargs: COSTLY_DRAFTS)
    pipe = tiny_pipeline(*VOCAB8, "sampling.temperature=1.0")
    decisions: list[tuple[str, bool]] = []
    for name in ("keep", "more"):
        method = getattr(ChainStopper, name)

        def recording(self, *args, _method=method, _name=name):
            decision = _method(self, *args)
            decisions.append((_name, decision))
            return decision

        monkeypatch.setattr(ChainStopper, name, recording)
    return pipe, decisions


def test_a_draft_model_stopping_itself_online_is_exact(costly):
    pipe, decisions = costly
    stats = [pipe.generate(prompt_ids=PROMPT, max_new_tokens=8, seed=s).stats for s in range(30)]
    assert sum(s.drafted for s in stats) > 20
    assert ("keep", True) in decisions and ("more", True) in decisions  # chains of several tokens ...
    assert ("keep", False) in decisions or ("more", False) in decisions  # ... which the stopper also cut
    assert _p_value(pipe) > MIN_P_VALUE


def test_an_online_stop_that_peeks_at_the_target_is_caught(costly, monkeypatch):
    """The same online path, but a draw is dropped (and the chain stopped) when the target's p of the
    drawn token is below q: the drafts the verifier might reject never reach it."""
    pipe, _ = costly
    monkeypatch.setattr(ChainDraws, "draw", peeking_draw(pipe, 8))
    assert _p_value(pipe) < MIN_P_VALUE


#: Drafting pays only where acceptance is high (v(2) = 1.4): what the shadows teach decides.
SHADOW_TABLE = CostTable(chain=tuple(1.0 + 0.4 * n for n in range(8)), tree=(), step_s=1e-3)


def test_auto_prompt_lookup_learning_from_shadows_is_exact(monkeypatch, settled_shadows):
    """Prompt lookup at γ = auto learns from the plain steps' shadows (past rounds only), so the
    draft lengths it then chooses keep the target's law: chi-square against the enumeration."""
    from specgen.drafters.ngram import NgramSession

    monkeypatch.setattr("specgen.planning.cost_cache.cost_table", lambda subject, **kwargs: SHADOW_TABLE)
    pipe = tiny_pipeline(VOCAB8[0], "sampling.temperature=1.0", drafter="ngram")
    assert str(pipe.guarantee) == "exact" and pipe.drafter.num_tokens == "auto" and NgramSession.shadows
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    stats = [pipe.generate(prompt_ids=prompt, max_new_tokens=LENGTH, seed=s).stats for s in range(40)]
    assert sum(settled_shadows) > 10 and sum(s.drafted for s in stats) > 5 and sum(s.planned_plain for s in stats) > 10
    expected = exact_distribution(pipe, prompt, LENGTH)
    counts = sample_counts(pipe, prompt, LENGTH, NUM_SAMPLES)
    assert goodness_of_fit(counts, expected)[0] > MIN_P_VALUE
