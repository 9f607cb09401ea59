"""Hand-built cases for the acceptance rule, the residual and its fallback."""

from __future__ import annotations

import pytest
import torch

from specgen.errors import NumericalError
from specgen.sampling import positive_residual, sample_token, verify_chain, verify_chain_greedy
from specgen.sampling.rejection import RESIDUAL_EPS


def probs(*values):
    return torch.tensor(values, dtype=torch.float64)


def _uniform_draws(generator: torch.Generator, count: int) -> list[float]:
    state = generator.get_state()
    draws = [float(torch.rand((), generator=generator)) for _ in range(count)]
    generator.set_state(state)
    return draws


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_accept_all_then_bonus():
    target = probs(0.1, 0.9, 0.0).repeat(3, 1)  # [3, 3]
    draft = probs(0.1, 0.9, 0.0).repeat(2, 1)  # p == q: always accept
    verdict = verify_chain(target, draft, [1, 1], _generator(0))
    assert verdict.num_accepted == 2
    assert verdict.kind == "bonus"
    assert verdict.accept_probs == (1.0, 1.0)
    assert verdict.next_token in (0, 1)


def test_first_position_reject_samples_residual():
    # p puts all mass on token 0, the draft proposed token 1: accept prob 0, residual = [1, 0].
    target = torch.stack([probs(1.0, 0.0), probs(0.5, 0.5)])
    draft = probs(0.2, 0.8).unsqueeze(0)
    for seed in range(20):
        verdict = verify_chain(target, draft, [1], _generator(seed))
        assert verdict == verdict.__class__(0, 0, "resampled", (0.0,))


def test_accept_probability_matches_min_ratio():
    target = torch.stack([probs(0.3, 0.7), probs(0.5, 0.5)])
    draft = probs(0.6, 0.4).unsqueeze(0)
    verdict = verify_chain(target, draft, [0], _generator(1))
    assert verdict.accept_probs[0] == pytest.approx(0.5)
    accepted = sum(verify_chain(target, draft, [0], _generator(s)).num_accepted for s in range(4000))
    assert abs(accepted / 4000 - 0.5) < 0.03


def test_uniform_decides_acceptance():
    target = torch.stack([probs(0.3, 0.7), probs(0.5, 0.5)])
    draft = probs(0.6, 0.4).unsqueeze(0)
    for seed in range(50):
        u = _uniform_draws(_generator(seed), 1)[0]
        verdict = verify_chain(target, draft, [0], _generator(seed))
        assert verdict.num_accepted == (1 if u < 0.5 else 0)
        if verdict.num_accepted == 0:
            assert verdict.next_token == 1  # residual (p - q)+ = [0, 0.3] -> token 1


def test_p_zero_is_always_rejected_and_never_resampled():
    target = torch.stack([probs(0.0, 0.5, 0.5), probs(1 / 3, 1 / 3, 1 / 3)])
    draft = probs(1.0, 0.0, 0.0).unsqueeze(0)
    for seed in range(30):
        verdict = verify_chain(target, draft, [0], _generator(seed))
        assert verdict.num_accepted == 0
        assert verdict.next_token in (1, 2)


def test_q_zero_token_is_refused():
    target = torch.stack([probs(0.5, 0.5), probs(0.5, 0.5)])
    draft = probs(1.0, 0.0).unsqueeze(0)
    with pytest.raises(NumericalError, match="zero draft probability"):
        verify_chain(target, draft, [1], _generator(0))


def test_deterministic_draft_is_one_hot():
    # q one-hot on token 2: accept with p(2) = 0.25, else sample p without token 2.
    target = torch.stack([probs(0.5, 0.25, 0.25), probs(1.0, 0.0, 0.0)])
    outcomes = {0: 0, 1: 0, 2: 0}
    for seed in range(6000):
        verdict = verify_chain(target, None, [2], _generator(seed))
        first = 2 if verdict.num_accepted else verdict.next_token
        outcomes[first] += 1
    observed = [outcomes[k] / 6000 for k in (0, 1, 2)]
    assert observed == pytest.approx([0.5, 0.25, 0.25], abs=0.025)


def test_middle_rejection_keeps_prefix():
    target = torch.stack([probs(0.0, 1.0), probs(1.0, 0.0), probs(0.5, 0.5)])
    verdict = verify_chain(target, None, [1, 1], _generator(0))
    assert (verdict.num_accepted, verdict.next_token, verdict.kind) == (1, 0, "resampled")
    assert verdict.accept_probs == (1.0, 0.0)


def test_residual_is_normalised_positive_part():
    residual = positive_residual(probs(0.5, 0.3, 0.2), probs(0.2, 0.5, 0.3))
    assert residual.tolist() == pytest.approx([1.0, 0.0, 0.0])
    residual = positive_residual(probs(0.4, 0.4, 0.2), probs(0.1, 0.3, 0.6))
    assert residual.tolist() == pytest.approx([0.75, 0.25, 0.0])


def test_residual_round_off_fallback_is_target():
    target = probs(0.25, 0.25, 0.5)
    almost = target + probs(RESIDUAL_EPS / 10, -RESIDUAL_EPS / 10, 0.0)
    fallback = positive_residual(target, almost)
    assert fallback.tolist() == pytest.approx(target.tolist())
    assert float(positive_residual(target, target).sum()) == pytest.approx(1.0)


def test_sample_token_never_picks_zero_mass():
    dist = probs(0.0, 0.5, 0.0, 0.5, 0.0)
    picks = {sample_token(dist, _generator(s)) for s in range(200)}
    assert picks == {1, 3}


def test_shape_checks():
    with pytest.raises(ValueError):
        verify_chain(probs(0.5, 0.5).unsqueeze(0), None, [0], _generator(0))
    with pytest.raises(ValueError):
        verify_chain(probs(0.5, 0.5).repeat(2, 1), probs(0.5, 0.5, 0.0).unsqueeze(0), [0], _generator(0))


def test_greedy_chain():
    assert verify_chain_greedy([3, 4, 5], [3, 4]).num_accepted == 2
    verdict = verify_chain_greedy([3, 4, 5], [3, 9])
    assert (verdict.num_accepted, verdict.next_token, verdict.kind) == (1, 4, "resampled")
    verdict = verify_chain_greedy([7], [])
    assert (verdict.num_accepted, verdict.next_token, verdict.kind) == (0, 7, "bonus")
