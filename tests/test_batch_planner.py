"""The batch planner (specgen.planning.batch, specgen.batch.drafting): joint draft lengths for a batched step.

Pure tests use hand-written tables (nothing depends on this machine's speed): the
plan is optimal against brute force, never below plain batched decoding under its
table, all-plain when batched verify is expensive and acceptance low, and its
stopping rule is non-anticipating. Engine tests run the batched path with
num_tokens=auto: greedy rows equal single requests, sampled rows follow the exact
law (chi-square) and an anticipating truncation is caught by the same test.
"""

from __future__ import annotations

import itertools
import random

import pytest
from conftest import tiny_pipeline
from exact import exact_distribution, goodness_of_fit

from specgen.planning import (BatchCostTable, DraftedRow, RowPlan, batch_rate, plan_batch, token_values,
                              truncate_batch)
from specgen.drafters import Proposal
from specgen.drafters.small_model import SmallModelSession

#: Shaped like SmolLM2-135M float32 on this project's 2-core CPU (one thread): at 8 rows, one
#: draft token per row more than doubles the forward (measured 3.0 -> 8.6).
MEASURED = BatchCostTable((1, 2, 4, 8), (1, 2, 3, 5, 9),
                          ((1.0, 1.58, 1.79, 2.17, 2.48), (1.43, 2.5, 2.54, 2.94, 3.76),
                           (2.32, 3.72, 5.09, 5.13, 6.27), (3.04, 8.64, 8.64, 8.64, 10.71)), head=0.016)
#: A GPU-like table: width is nearly free at any batch size.
FLAT = BatchCostTable((1, 8), (1, 9), ((1.0, 1.1), (1.2, 1.4)), head=0.0)


def _rows(rates: list[float], depth: int = 8, **kwargs) -> list[RowPlan]:
    return [RowPlan((rate,) * depth, **kwargs) for rate in rates]


def test_table_interpolates_and_extrapolates():
    assert MEASURED.verify(8, 1) == pytest.approx(3.04)
    assert MEASURED.verify(6, 1) == pytest.approx((2.32 + 3.04) / 2)
    assert MEASURED.verify(1, 4) == pytest.approx((2.17 + 1.79) / 2)
    assert MEASURED.verify(8, 2, logits_rows=16) == pytest.approx(8.64 + 8 * 0.016)
    assert MEASURED.verify(16, 1) == pytest.approx(3.04 + 8 * (3.04 - 2.32) / 4)  # linear past the last size
    stand_in = BatchCostTable.from_chain((1.0, 1.5, 2.0))
    assert stand_in.verify(2, 2) == pytest.approx(2.0 + 0.5)  # 4 tokens: the chain's slope continued


#: MEASURED with linear layers skipping padding: one row w wide and the rest 1 token cost less.
RAGGED = BatchCostTable(MEASURED.sizes, MEASURED.widths, MEASURED.body, head=MEASURED.head,
                        ragged=((1.0, 1.58, 1.79, 2.17, 2.48), (1.43, 2.0, 2.1, 2.3, 2.8),
                                (2.32, 2.6, 2.9, 3.2, 3.6), (3.04, 3.4, 3.6, 4.0, 4.6)))


def test_real_tokens_price_between_ragged_and_uniform():
    assert RAGGED.verify(8, 3) == MEASURED.verify(8, 3) == pytest.approx(8.64)  # no tokens given: all real
    assert RAGGED.verify(8, 3, tokens=10) == pytest.approx(3.6)  # one row 3 wide, seven 1: the ragged cell
    assert RAGGED.verify(8, 3, tokens=24) == pytest.approx(8.64)
    assert RAGGED.verify(8, 3, tokens=17) == pytest.approx(3.6 + (8.64 - 3.6) * 7 / 14)  # linear in between
    assert RAGGED.padding_saving(8, 3) == pytest.approx((8.64 - 3.6) / 14)
    assert MEASURED.padding_saving(8, 3) == 0.0 and MEASURED.verify(8, 3, tokens=10) == pytest.approx(8.64)
    assert RAGGED.padding_saving(1, 5) == 0.0 and RAGGED.padding_saving(8, 1) == 0.0
    wide = BatchCostTable((1, 8), (1, 2), ((1.0, 1.2), (1.5, 2.0)), wide=((1.4, 2.0), (3.0, 5.0)),
                          slots=(100, 800), ragged=((1.0, 1.2), (1.5, 1.6)))
    ragged = [v for line in wide.at(800).ragged for v in line]
    assert ragged == pytest.approx([1.4, 2.0, 3.0, 4.6])  # the slots cost padded and ragged forwards alike
    assert wide.at(800).verify(8, 2, tokens=9) == pytest.approx(4.6)


def test_a_ragged_table_lets_one_good_row_draft_alone():
    rows = _rows([0.95] + [0.05] * 7)
    assert plan_batch(MEASURED, rows) == [0] * 8  # padded: one good row cannot widen 8
    plan = plan_batch(RAGGED, rows)
    assert plan[0] >= 4 and plan[1:] == [0] * 7  # ragged: it drafts, the others stay plain
    assert batch_rate(RAGGED, rows, plan) > batch_rate(RAGGED, rows, [0] * 8)


def test_token_values_weigh_a_draining_batch_by_its_laggards():
    assert token_values(RAGGED, [10, 50, 50], draining=False) == [1.0] * 3  # requests wait: throughput counts
    assert token_values(RAGGED, [50] * 8, draining=True) == pytest.approx([1.0] * 8)  # all tied: the same
    assert token_values(RAGGED, [7], draining=True) == [1.0]
    values = token_values(RAGGED, [10] + [50] * 7, draining=True)
    average = RAGGED.verify(8, 1) / 8
    assert values[0] == pytest.approx((RAGGED.verify(8, 1) - RAGGED.verify(7, 1)) / average)
    assert values[1:] == pytest.approx([RAGGED.verify(7, 1) / 7 / average] * 7)
    assert values[0] < 1.0 < values[1]


def test_a_row_ahead_of_a_draining_batch_does_not_draft():
    """A confident row that would finish before the others only idles sooner: with nothing
    waiting for its slot, it is not worth widening the batch's forward."""
    rates = [0.95] + [0.05] * 7
    assert plan_batch(RAGGED, _rows(rates))[0] >= 4  # tokens interchangeable: it drafts
    ahead = token_values(RAGGED, [10] + [50] * 7, draining=True)
    rows = [RowPlan((rate,) * 8, value=value) for rate, value in zip(rates, ahead, strict=True)]
    assert plan_batch(RAGGED, rows) == [0] * 8
    behind = token_values(RAGGED, [50] + [10] * 7, draining=True)  # the same row as the batch's last
    rows = [RowPlan((rate,) * 8, value=value) for rate, value in zip(rates, behind, strict=True)]
    assert plan_batch(RAGGED, rows)[0] >= 4


def test_expensive_batched_verify_and_low_acceptance_run_plain():
    assert plan_batch(MEASURED, _rows([0.3] * 8)) == [0] * 8
    assert plan_batch(MEASURED, _rows([0.6] * 8)) == [0] * 8  # 2.5 tokens a row cannot pay 10.7 / 3.04
    assert plan_batch(MEASURED, _rows([0.3])) == [0]  # a single row at 0.3: v(2) = 1.58 does not pay either


def test_cheap_batched_verify_drafts():
    assert plan_batch(FLAT, _rows([0.8] * 8)) == [8] * 8
    assert plan_batch(MEASURED, _rows([0.9] * 8)) == [8] * 8  # 6.1 tokens a row pay even the widest forward
    assert plan_batch(MEASURED, _rows([0.9])) == [8]  # one row alone: the single-row curve is gentle
    one_good = plan_batch(FLAT, _rows([0.95] + [0.05] * 7))
    assert one_good[0] == 8  # the width is paid by the good row; with head = 0 the others ride along
    assert plan_batch(MEASURED, _rows([0.95] + [0.05] * 7)) == [0] * 8  # one good row cannot widen 8


def _model_cost(b: int, w: int, tokens: int) -> float:
    return 1.0 + 0.1 * tokens + 0.05 * b + 0.03 * b * w + 0.02 * w


#: A table of the shape planning.fit.fit_forwards gives (RAGGED's hand-written cells are not: interpolated
#: between its sizes, a wider forward can be priced below a narrower one with the same real tokens).
FITTED = BatchCostTable(MEASURED.sizes, MEASURED.widths,
                        tuple(tuple(_model_cost(b, w, b * w) / _model_cost(1, 1, 1) for w in MEASURED.widths)
                              for b in MEASURED.sizes), head=0.01,
                        ragged=tuple(tuple(_model_cost(b, w, b - 1 + w) / _model_cost(1, 1, 1) for w in MEASURED.widths)
                                     for b in MEASURED.sizes))


def test_plan_is_optimal_and_never_below_plain():
    """Optimal against brute force under every table whose cost does not fall with the width at a
    fixed number of real tokens; never below all-plain under any table (RAGGED included)."""
    rng = random.Random(0)
    for _ in range(80):
        rows = [RowPlan(tuple(rng.random() for _ in range(rng.randint(0, 3))), feed=rng.choice((1, 1, 2)),
                        draft_fixed=rng.choice((0.0, 0.1)), draft_per_token=rng.choice((0.0, 0.05, 0.3)),
                        value=rng.choice((1.0, 1.0, 0.3, 1.7)))
                for _ in range(rng.randint(1, 3))]
        table = rng.choice((MEASURED, FLAT, FITTED, RAGGED,
                            BatchCostTable.from_chain(tuple(1 + 0.3 * n for n in range(30)))))
        plan = plan_batch(table, rows)
        assert batch_rate(table, rows, plan) >= batch_rate(table, rows, [0] * len(rows)) * (1 - 1e-12)
        if table is not RAGGED:
            best = max(batch_rate(table, rows, lengths)
                       for lengths in itertools.product(*[range(len(row.rates) + 1) for row in rows]))
            assert batch_rate(table, rows, plan) == pytest.approx(best, rel=1e-9)


def test_low_forces_drafts_and_others_use_the_paid_width():
    plan = plan_batch(MEASURED, [RowPlan((0.1,) * 4, low=1)] + _rows([0.6] * 7, depth=4))
    assert plan[0] >= 1
    assert all(k >= 1 for k in plan[1:])  # width 2 is paid anyway: the better rows take a token


def test_truncation_is_a_stopping_time():
    """Whether row i keeps token t depends on known[:t + 1] only: changing what a row's drafter
    said about tokens after its cut never changes the cut."""
    rng = random.Random(1)
    for _ in range(40):
        rows = [DraftedRow(tuple(rng.random() for _ in range(n)), tuple(0.5 for _ in range(n)))
                for n in (rng.randint(0, 6) for _ in range(rng.randint(1, 4)))]
        table = rng.choice((MEASURED, FLAT, RAGGED, BatchCostTable.from_chain(tuple(1 + 0.2 * n for n in range(30)))))
        kept = truncate_batch(table, rows)
        for i, row in enumerate(rows):
            if kept[i] + 1 < len(row.known):
                changed = list(row.known)
                for t in range(kept[i] + 1, len(changed)):
                    changed[t] = rng.random()
                other = rows[:i] + [DraftedRow(tuple(changed), row.later)] + rows[i + 1:]
                assert truncate_batch(table, other)[i] == kept[i]


def test_truncation_cuts_unlikely_tails_and_keeps_low():
    rows = [DraftedRow((0.9, 0.9, 0.02, 0.9), (0.5,) * 4), DraftedRow((0.01,), (0.5,), low=1)]
    assert truncate_batch(FLAT, rows) == [2, 1]


# --- the batched engine with num_tokens=auto -------------------------------------------------------------

VOCAB8 = ("target.source.vocab_size=8", "drafter.source.vocab_size=8")
PROMPT = [1, 2, 3]
LENGTH = 3
NUM_SAMPLES = 1200
MIN_P_VALUE = 1e-3
TOKEN = 1  # as tests/test_planner_exact.py: cutting a draft before this token biases the first token


@pytest.mark.parametrize("drafter", ["tiny", "ngram"])
def test_greedy_auto_rows_equal_single_requests(drafter):
    pipe = tiny_pipeline("target.source.init_scale=3", drafter=drafter)
    assert pipe.drafter.num_tokens == "auto"
    prompts = [dict(prompt_ids=p, max_new_tokens=n) for p, n in
               (([1, 2, 3], 30), ([2, 9, 2, 9, 2, 9], 25), ([7], 12), ([4, 4, 4], 30), ([5, 6], 8))]
    single = [pipe.generate(**p).token_ids for p in prompts]
    batch = pipe.generate_batch(prompts, batch_size=3)
    assert [g.token_ids for g in batch] == single
    assert sum(g.stats.drafted for g in batch) > 0 and sum(g.stats.planned_plain for g in batch) >= 0


def _p_value(pipe) -> tuple[float, list]:
    gens = pipe.generate_batch([dict(prompt_ids=PROMPT, seed=s, max_new_tokens=LENGTH) for s in range(NUM_SAMPLES)],
                               batch_size=8)
    from collections import Counter

    counts = Counter(tuple(g.token_ids) for g in gens)
    return goodness_of_fit(counts, exact_distribution(pipe, PROMPT, LENGTH))[0], gens


@pytest.mark.parametrize("table", ["measured here", "ragged"])
def test_sampled_auto_rows_follow_their_law(table, monkeypatch):
    """Rows planned together follow their exact law; with a ragged table (real tokens priced,
    padding skipped) rows draft different lengths in one step, and still do."""
    if table == "ragged":
        flat_ragged = BatchCostTable((1, 8), (1, 9), ((1.0, 1.1), (1.2, 1.8)), ragged=((1.0, 1.1), (1.2, 1.3)))
        monkeypatch.setattr("specgen.planning.cost_cache.batch_cost_table", lambda *args, **kwargs: flat_ragged)
    pipe = tiny_pipeline(*VOCAB8, "sampling.temperature=1.0")
    assert str(pipe.guarantee) == "exact" and pipe.drafter.num_tokens == "auto"
    p_value, gens = _p_value(pipe)
    drafted = [g.stats.drafted for g in gens]
    assert sum(drafted) > NUM_SAMPLES // 2 and len(set(drafted)) > 1, "rows draft, some more than others"
    assert p_value > MIN_P_VALUE


def test_anticipating_truncation_is_caught_in_a_batch(monkeypatch):
    """The control: cutting a sampled draft *before* TOKEN judges the token by its own value."""
    propose = SmallModelSession.propose

    def before_token(self, budget: int) -> Proposal:
        proposal = propose(self, budget)
        keep = proposal.tokens.index(TOKEN) if TOKEN in proposal.tokens else len(proposal)
        return Proposal(proposal.tokens[:keep], proposal.draft_probs[:keep], None,
                        None if proposal.confidence is None else proposal.confidence[:keep])

    monkeypatch.setattr(SmallModelSession, "propose", before_token)
    pipe = tiny_pipeline(*VOCAB8, "sampling.temperature=1.0")
    assert _p_value(pipe)[0] < MIN_P_VALUE


def test_expensive_batch_runs_plain_but_for_probes(monkeypatch):
    """With the measured-like table, 8 rows of a low-acceptance drafter speculate only in probes."""
    monkeypatch.setattr("specgen.planning.cost_cache.batch_cost_table", lambda *args, **kwargs: MEASURED)
    pipe = tiny_pipeline(*VOCAB8, "sampling.temperature=1.0")
    gens = pipe.generate_batch([dict(prompt_ids=PROMPT, seed=s, max_new_tokens=40) for s in range(8)], batch_size=8)
    rounds = sum(g.stats.rounds for g in gens)
    drafted = sum(g.stats.drafted for g in gens)
    assert drafted <= rounds / 4, (drafted, rounds)
    assert all(g.stats.planned_plain > 0 for g in gens)


@pytest.mark.parametrize("shadows", [True, False])
def test_batched_lookup_rows_learn_from_shadows_not_probes(shadows, monkeypatch, settled_shadows):
    """Rows of a shadowing drafter that is never right (it always drafts a banned token) learn that
    from their plain steps' shadows and stop drafting after a cold start of a few rounds; the control
    without shadows keeps probing. Either way greedy rows equal their requests alone."""
    from specgen.drafters.ngram import NgramSession

    monkeypatch.setattr("specgen.planning.cost_cache.batch_cost_table", lambda *args, **kwargs: MEASURED)
    monkeypatch.setattr(NgramSession, "shadows", shadows)
    monkeypatch.setattr(NgramSession, "propose", lambda self, budget: Proposal([6] * budget, None, None,
                                                                               [0.5] * budget))
    pipe = tiny_pipeline(VOCAB8[0], "target.source.init_scale=3", "sampling.bad_words=[[6]]", drafter="ngram")
    prompts = [dict(prompt_ids=[1 + s % 5, 2, 3], max_new_tokens=80) for s in range(8)]
    gens = pipe.generate_batch(prompts, batch_size=8)
    shadowed, drafted = sum(settled_shadows), sum(g.stats.drafted for g in gens)
    assert [g.token_ids for g in gens] == [pipe.generate(**p, speculative=False).token_ids for p in prompts]
    assert sum(g.stats.accepted for g in gens) == 0
    if shadows:
        assert shadowed > 150 and drafted <= 8, (shadowed, drafted)
    else:
        assert shadowed == 0 and drafted > 16, drafted
