"""The planner (pure) and the cost model's caching, without timed assertions.

Costs come from hand-written tables or an injected fake timer, so nothing here
depends on this machine's speed.
"""

from __future__ import annotations

import random

import pytest

from specgen.planning import (
    AcceptanceHistory,
    ChainStopper,
    CostTable,
    expected_tokens,
    interpolate,
    pays_to_go_on,
    plan_budget,
    truncate_chain,
    truncate_tree,
)

FLAT = CostTable(chain=tuple([1.0] * 16), tree=tuple([1.0] * 16))  # verifying more is free (a GPU-like curve)
STEEP = CostTable(chain=tuple(1.0 + 0.6 * n for n in range(16)), tree=tuple(1.0 + 0.6 * n for n in range(16)))


def _history(rate: float, rounds: int = 300, depth: int = 8, seed: int = 0) -> AcceptanceHistory:
    """A history whose drafts were each accepted with probability ``rate`` given the earlier ones were."""
    rng, history = random.Random(seed), AcceptanceHistory()
    for _ in range(rounds):
        accepted = 0
        while accepted < depth and rng.random() < rate:
            accepted += 1
        history.observe([None] * depth, accepted)
    return history


def test_expected_tokens():
    assert expected_tokens([]) == [1.0]
    assert expected_tokens([1.0, 1.0]) == [1.0, 2.0, 3.0]
    assert expected_tokens([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])


def test_cost_table_extrapolates_and_adds_overhead():
    table = CostTable(chain=(1.0, 1.2, 1.5), tree=(1.0, 1.3), overhead=0.1)
    assert table.verify(2) == pytest.approx(1.2 + 0.2)
    assert table.verify(5) == pytest.approx(1.5 + 2 * 0.3 + 0.5)  # last slope continued
    assert table.verify(2, tree=True) == pytest.approx(1.3 + 0.2)
    assert table.draft(0) == 0.0


def test_one_interpolation_rule():
    """Knots exact, linear between, continued past the ends; a rising tail never falls past the last knot."""
    xs, ys = (1, 2, 4), (1.0, 1.5, 1.2)
    assert [interpolate(xs, ys, x) for x in xs] == list(ys)
    assert interpolate(xs, ys, 3) == pytest.approx(1.35)
    assert interpolate(xs, ys, 6) == pytest.approx(0.9) and interpolate(xs, ys, 40) == 0.0  # never below 0
    assert interpolate(xs, ys, 6, rising_tail=True) == 1.2
    assert interpolate((2,), (3.0,), 5) == pytest.approx(7.5)  # one knot: proportional
    steep = CostTable(chain=(1.0, 2.0, 1.5), tree=())
    assert steep.verify(5) == 1.5  # a falling last segment is not continued downwards


def test_the_stopping_rule_compares_longer_lengths_with_stopping():
    def cost(k):
        return 1.0 + 0.5 * k

    assert pays_to_go_on([0.9, 0.9], cost, 0, 2)  # 1.9 / 1.5 > 1 / 1
    assert not pays_to_go_on([0.1, 0.1], cost, 0, 2)
    assert not pays_to_go_on([0.9, 0.9], cost, 2, 2)  # nothing longer to try


def test_budget_grows_with_acceptance_and_shrinks_with_cost():
    good, bad = _history(0.9), _history(0.05)
    assert plan_budget(FLAT, good, 8) >= 6
    assert plan_budget(STEEP, good, 8) < plan_budget(FLAT, good, 8)
    assert plan_budget(STEEP, bad, 8) == 0  # nothing pays: a plain step
    assert plan_budget(FLAT, good, 0) == 0


def test_expensive_drafter_is_not_asked_to_draft_at_low_acceptance():
    costly = CostTable(chain=FLAT.chain, tree=FLAT.tree, draft_per_token=0.5)
    assert plan_budget(costly, _history(0.3), 8) == 0
    assert plan_budget(costly, _history(0.95), 8) >= 2


GENTLE = CostTable(chain=tuple(1.0 + 0.1 * n for n in range(16)), tree=tuple(1.0 + 0.1 * n for n in range(16)))


@pytest.mark.parametrize("table, gap", [(GENTLE, 8), (STEEP, 30)])  # a rejected probe costs 0.1 / 0.6 steps
def test_plain_streak_triggers_a_probe(table, gap):
    history = _history(0.0)
    assert plan_budget(table, history, 8) == 0
    for _ in range(gap - 1):
        history.observe([], 0)
    assert not history.probe_due and plan_budget(table, history, 8) == 0
    history.observe([], 0)
    assert history.probe_due and plan_budget(table, history, 8) == 1
    history.observe([None], 0)
    assert not history.probe_due


def test_probing_never_costs_more_than_its_share():
    """A drafter that is never right: whatever the cost table, probes cost at most 2 % of the plain steps."""
    for table in (FLAT, STEEP, CostTable(chain=(1.0, 1.7, 2.1), tree=(1.0, 1.5))):
        history, extra, steps = AcceptanceHistory(), 0.0, 0
        for _ in range(5000):
            budget = plan_budget(table, history, 8)
            steps += 1
            if budget:
                extra += table.verify(budget + 1) - table.verify(1)
            history.observe([None] * budget, 0)
        assert extra <= 0.02 * steps + 1e-9, (table, extra / steps)


def _probe_share(table: CostTable, catch_up: float, steps: int = 5000) -> float:
    """Extra cost per step of a never-right drafter's probes, each paying ``catch_up`` per token
    committed since the drafter last drafted (a draft model's prefill of what it skipped)."""
    history, extra, streak = AcceptanceHistory(), 0.0, 0
    for _ in range(steps):
        budget = plan_budget(table, history, 8)
        if budget:
            extra += table.draft(budget) + table.verify(budget + 1) - table.verify(1) + streak * catch_up
            streak = 0
        streak += 1
        history.observe([None] * budget, 0)
    return extra / steps


@pytest.mark.parametrize("catch_up", [0.0, 0.01, 0.03])
def test_probes_price_a_draft_models_catch_up(catch_up):
    table = CostTable(chain=(1.0, 1.4, 2.2), tree=(), draft_per_token=0.3, draft_catch_up=catch_up)
    assert _probe_share(table, catch_up) <= 0.02 + 1e-9
    blind = CostTable(chain=(1.0, 1.4, 2.2), tree=(), draft_per_token=0.3)  # negative control: catch-up not priced
    assert catch_up < 0.02 or _probe_share(blind, catch_up) > 0.02


def test_a_catch_up_beyond_the_probe_share_stops_probes():
    table = CostTable(chain=(1.0, 1.4, 2.2), tree=(), draft_per_token=0.3, draft_catch_up=0.05)
    history = AcceptanceHistory()
    assert plan_budget(table, history, 8) == 0
    for _ in range(1000):
        history.observe([], 0)
        assert plan_budget(table, history, 8) == 0


@pytest.mark.parametrize("second, probes", [(2.05, False), (1.95, True)])
def test_no_probe_where_no_draft_could_pay_even_if_always_accepted(second, probes):
    """v(1 + k) >= 1 + k for every k (a CPU whose wider forwards cost a full step a token): nothing could
    pay, so a streak of plain steps never probes; the control with v(2) just under 2 still probes."""
    table = CostTable(chain=(1.0, second, *(1.0 + 1.05 * n for n in range(2, 16))), tree=())
    assert (table.ceiling(8) > 1.0) is probes and table.ceiling(0) == 0.0
    history = _history(1.0)  # every past draft accepted
    budgets = []
    for _ in range(300):
        budgets.append(plan_budget(table, history, 8))
        history.observe([None] * budgets[-1], budgets[-1])
    assert any(budgets) is probes


def test_an_undrafted_position_starts_from_its_predecessor():
    history = AcceptanceHistory()
    for _ in range(50):
        history.observe([None], 1)  # only position 0 was ever drafted, always accepted
    assert history.estimate(1) > 0.9 and history.estimate(3) > 0.9
    assert plan_budget(STEEP, history, 8) > 1  # long drafts are worth trying


def test_truncation_follows_confidence():
    history = AcceptanceHistory()
    for _ in range(100):  # high-confidence drafts were accepted, low-confidence ones were not
        history.observe([0.95, 0.95, 0.05], 2)
    assert truncate_chain(STEEP, history, [0.95, 0.95, 0.95, 0.05, 0.95]) == 3
    assert truncate_chain(STEEP, history, [0.05, 0.95]) == 0


def test_truncation_is_a_stopping_rule():
    """Whether token i is kept never depends on confidences after i."""
    history = _history(0.6)
    for prefix in ([0.9], [0.9, 0.2], [0.9, 0.2, 0.7]):
        cut = truncate_chain(STEEP, history, prefix)
        for tail in ([0.0], [1.0, 1.0], [0.5] * 4):
            longer = truncate_chain(STEEP, history, prefix + tail)
            assert min(longer, len(prefix)) == cut or (cut == len(prefix) and longer >= cut)


def test_tree_truncation_keeps_ancestors_and_best_scores():
    parents = [-1, -1, 0, 0, 2, 4]
    scores = [0.9, 0.3, 0.8, 0.1, 0.7, 0.6]
    history = _history(0.8)
    for table in (FLAT, STEEP):
        kept, predicted = truncate_tree(table, history, scores, parents)
        assert all(parents[i] < 0 or parents[i] in kept for i in kept)
        assert predicted >= 0
    flat_kept, _ = truncate_tree(FLAT, history, scores, parents)
    steep_kept, _ = truncate_tree(STEEP, history, scores, parents)
    assert len(flat_kept) == len(scores) and set(steep_kept) <= {0, 2, 4, 5}
    orphan, _ = truncate_tree(FLAT, history, [0.1, 0.9], [-1, 0])  # a child scored above its parent
    assert orphan == [0, 1]


def test_a_never_verified_confident_draft_is_still_tried():
    """Rejected weak drafts must not stop the planner from verifying a strong one (a long n-gram match):
    a cheap drafter keeps drafting its budget, and truncation judges each draft by its confidence."""
    table = CostTable(chain=(1.0, 1.5, 1.57, 1.49, 1.66, 1.77, 1.97, 1.94), tree=(1.0, 1.5))
    history = AcceptanceHistory()
    for _ in range(3):
        history.observe([0.25, 0.25, 0.25], 0)  # three rejected 1-gram drafts
    assert history.estimate(0) < 0.3
    assert plan_budget(table, history, 7) == 7  # drafting is free: draft, then judge
    assert truncate_chain(table, history, [0.25] * 7) == 0
    assert truncate_chain(table, history, [0.75] * 7) >= 3  # a bin never verified starts near the drafter's claim
    for _ in range(20):
        history.observe([0.75, 0.75, 0.75], 0)  # ... and learns when the claim is wrong
    assert truncate_chain(table, history, [0.75] * 7) == 0


#: A draft model's costs: 0.35 target steps a drafted token, verifying nearly flat (the Qwen pair on a CPU).
DRAFT_MODEL = CostTable(chain=(1.0, 1.07, 1.16, 1.11, 1.15, 1.19, 1.31, 1.38), tree=(), draft_per_token=0.35)


def _drafted(stopper: ChainStopper, confidences: list[float]) -> tuple[int, int]:
    """Drive a stopper like a drafter does -> (tokens kept, drafts computed, i.e. paid for)."""
    kept = computed = 0
    for confidence in confidences:
        computed += 1
        if not stopper.keep(confidence):
            break
        kept += 1
        if not stopper.more():
            break
    return kept, computed


def test_an_online_drafter_is_planned_its_whole_budget_when_drafting_can_pay():
    assert plan_budget(DRAFT_MODEL, _history(0.9), 8, online=True) == 8
    assert plan_budget(DRAFT_MODEL, _history(0.9), 8) < 8  # paying before seeing confidences: shorter
    assert plan_budget(STEEP, _history(0.05), 8, online=True) == 0  # nothing pays: a plain step


def test_a_costly_online_drafter_starts_only_where_drafting_pays_on_average():
    """Its first token is paid before the stopper sees its confidence: a drafter whose confident drafts
    would pay, but whose drafts on average do not, is not started (it cost a 0.47-step draft a round)."""
    steep_pair = CostTable(chain=(1.0, 1.45, 1.91, 2.35, 2.76, 3.16, 3.56, 4.52, 4.96), tree=(), draft_per_token=0.465)
    rng, history = random.Random(0), AcceptanceHistory()
    for _ in range(300):  # half the drafts sure and right, half doubtful and wrong
        sure = rng.random() < 0.5
        history.observe([0.99 if sure else 0.1] * 8, 8 if sure else 0)
    assert not history.probe_due
    assert plan_budget(steep_pair, history, 8, online=True) == 0
    cheap_pair = CostTable(chain=steep_pair.chain, tree=(), draft_per_token=0.02)
    assert plan_budget(cheap_pair, history, 8, online=True) == 8  # a cheap one still drafts on confidence


def _calibrated_history(rounds: int = 300, depth: int = 8, seed: int = 0) -> AcceptanceHistory:
    """A history of mostly confident drafts, each accepted with probability its confidence."""
    rng, history = random.Random(seed), AcceptanceHistory()
    for _ in range(rounds):
        confidences = [rng.random() ** 0.2 for _ in range(depth)]
        accepted = 0
        while accepted < depth and rng.random() < confidences[accepted]:
            accepted += 1
        history.observe(confidences, accepted)
    return history


def test_the_stopper_drafts_while_confident_and_stops_at_a_doubtful_token():
    costs = CostTable(chain=tuple(1.0 + 0.08 * n for n in range(16)), tree=(), draft_per_token=0.2)
    history = _calibrated_history()
    for _ in range(10):
        history.observe([0.99, 0.02], 1)  # doubtful drafts were rejected
    kept, computed = _drafted(ChainStopper(costs, history, 8), [0.99] * 8)
    assert kept >= 3 and computed == kept
    kept, computed = _drafted(ChainStopper(costs, history, 8), [0.99, 0.99, 0.02, 0.99, 0.99])
    assert kept == 2 and computed == 3  # the doubtful draft was computed (paid), then not drawn


def test_costlier_drafting_stops_sooner():
    history = _history(0.8)
    lengths = []
    for per_token in (0.0, 0.2, 0.5, 1.0):
        costs = CostTable(chain=DRAFT_MODEL.chain, tree=(), draft_per_token=per_token)
        lengths.append(_drafted(ChainStopper(costs, history, 8), [0.9] * 8)[0])
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]


def test_the_stopper_ramps_up_from_a_cold_start():
    """A new request learns within a few rounds that a confident draft model pays several tokens
    a round (it used to verify one token a round for ~9 rounds with a 0.35-step drafter)."""
    history, lengths = AcceptanceHistory(), []
    for _ in range(6):
        budget = plan_budget(DRAFT_MODEL, history, 8, online=True)
        stopper = ChainStopper(DRAFT_MODEL, history, budget)
        kept, _ = _drafted(stopper, [0.95] * budget)
        history.observe([0.95] * kept, kept)  # all accepted
        lengths.append(kept)
    assert lengths[0] >= 1 and max(lengths[3:]) >= 4


def test_a_stopper_decision_reads_only_the_confidences_given_so_far():
    """Whatever comes later, the same prefix of confidences gets the same decisions (a stopping time)."""
    rng, history = random.Random(3), _history(0.7)
    for _ in range(200):
        prefix = [rng.random() for _ in range(rng.randint(1, 5))]
        tail = [rng.random() for _ in range(3)]
        first = _drafted(ChainStopper(DRAFT_MODEL, history, 8), prefix)
        longer = _drafted(ChainStopper(DRAFT_MODEL, history, 8), prefix + tail)
        if first[1] < len(prefix):  # stopped inside the prefix: nothing later can change that
            assert longer == first


def _shadowed_round(history: AcceptanceHistory, table: CostTable, rng: random.Random, rate: float,
                    shadows: bool = True) -> int:
    """One planned round of a cheap drafter whose drafts (confidence 0.5) are each accepted with
    probability ``rate``, as :func:`specgen.engine.round.plan_and_draft` runs it: plan, draft, truncate,
    and where nothing is verified the first draft shadows the plain step. -> drafts verified."""
    budget = plan_budget(table, history, 8)
    keep = truncate_chain(table, history, [0.5] * budget) if budget else 0
    if keep:
        accepted = 0
        while accepted < keep and rng.random() < rate:
            accepted += 1
        history.observe([0.5] * keep, accepted)
        return keep
    if shadows:
        history.expect(7, 0.5)
    history.observe([], 0)
    history.settle(7 if rng.random() < rate else 8)
    return 0


def test_a_shadow_is_a_position_0_observation_and_makes_probes_unnecessary():
    history = AcceptanceHistory()
    history.expect(5, 0.9)
    history.observe([], 0)
    history.settle(5)
    assert history.shadowed == 1 and history.pending is None and history.plain_streak == 0
    assert history.positions[0].accepted == 1.0 and history.by_bin[9].seen == 1.0
    history.expect(5, None)
    history.settle(6)  # rejected: counted, no bin
    assert history.positions[0].seen == 1.0 * history.decay + 1.0 and history.positions[0].accepted == history.decay
    history.expect(None)
    history.settle(5)  # nothing was expected: nothing learnt
    history.expect(5)
    history.settle(None)  # the step committed nothing
    assert history.shadowed == 2 and history.pending is None


@pytest.mark.parametrize("table", [GENTLE, STEEP])
def test_a_never_right_shadowing_drafter_never_probes(table):
    """Shadows tell the planner what probes would, at no verify cost: once the prior has given way
    (a few rounds where drafting pays at the prior's 0.5), no draft is verified again in 2000 rounds.
    Control: the same drafter without shadows keeps probing."""
    rng = random.Random(0)
    shadowed = AcceptanceHistory()
    verified = [_shadowed_round(shadowed, table, rng, 0.0) for _ in range(2000)]
    assert not any(verified[10:]) and shadowed.shadowed > 1900
    blind = AcceptanceHistory()
    assert sum(_shadowed_round(blind, table, rng, 0.0, shadows=False) > 0 for _ in range(2000)) > 10


def test_a_shadowing_drafter_starts_drafting_once_its_shadows_are_accepted():
    rng, history = random.Random(1), AcceptanceHistory(prior=0.05)
    verified = [_shadowed_round(history, STEEP, rng, 0.95) for _ in range(60)]
    assert verified[0] == 0 and history.shadowed >= 1 and sum(v > 0 for v in verified[-10:]) >= 8


def test_optimistic_all_is_the_best_bin_estimate():
    rng = random.Random(2)
    for trial in range(50):
        history = AcceptanceHistory()
        for _ in range(rng.randrange(0, 60)):
            depth = rng.randrange(0, 5)
            history.observe([rng.random() if rng.random() < 0.8 else None for _ in range(depth)],
                            rng.randrange(0, depth + 1))
        bases = history.bases(6)
        reference = [max([base] + [history.estimate(i, (b + 0.5) / history.bins, base) if history.by_bin else base
                                   for b in range(history.bins)]) for i, base in enumerate(bases)]
        assert history.optimistic_all(bases) == pytest.approx(reference, abs=1e-12), trial


def test_cached_verify_costs_equal_the_interpolation_rule():
    table = CostTable(chain=(1.0, 1.3, 1.9, 2.2), tree=(1.0, 1.1), overhead=0.01)
    for n in range(0, 12):
        for tree in (False, True):
            knots = table.tree if tree else table.chain
            expected = interpolate(range(1, len(knots) + 1), knots, max(1, n), rising_tail=True) + 0.01 * max(1, n)
            assert table.verify(n, tree) == pytest.approx(expected, abs=1e-12)
