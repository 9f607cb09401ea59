"""Statistical exactness: speculative output sequences follow the target's distribution.

Each case enumerates the exact distribution of whole 3-token outputs of the tiny
target (vocabulary 8, EOS included) through the pipeline's processor stack, draws
1200 speculative generations with seeds 0..1199, and requires a chi-square
p-value above 1e-3. The negative control shows the same test rejects a sampler
that resamples from p instead of the residual.

Power at 1200 (was 2000; measured on the "temperature" case, seeds 0..N-1): the
negative control gives p = 1e-16 (2000: 4e-38), and a subtler bug that resamples
from half residual, half p is still caught (p = 3e-4; 2000: 1e-4).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_pipeline
from exact import exact_distribution, goodness_of_fit, sample_counts
from specgen.sampling import rejection, sample_token

VOCAB8 = ("target.source.vocab_size=8", "drafter.source.vocab_size=8")
PROMPT = [1, 2, 3]
REPEATING_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
NUM_SAMPLES = 1200
LENGTH = 3
MIN_P_VALUE = 1e-3

CASES = {
    "temperature": ("tiny", ("sampling.temperature=1.0",), PROMPT),
    "temperature+top_k+top_p": ("tiny", ("sampling.temperature=0.8", "sampling.top_k=5", "sampling.top_p=0.9"), PROMPT),
    "penalties": ("tiny", ("sampling.temperature=1.0", "sampling.repetition_penalty=1.8",
                           "sampling.presence_penalty=0.7", "sampling.frequency_penalty=0.5"), PROMPT),
    "min_p": ("tiny", ("sampling.temperature=1.3", "sampling.min_p=0.15"), PROMPT),
    "min_new_tokens+bad_words": ("tiny", ("sampling.temperature=1.0", "sampling.min_new_tokens=2",
                                          "sampling.bad_words=[[3]]"), PROMPT),
    "ngram_one_hot_q": ("ngram", ("sampling.temperature=1.0",), REPEATING_PROMPT),
    "ngram+penalties": ("ngram", ("sampling.temperature=0.9", "sampling.repetition_penalty=1.5",
                                  "sampling.top_k=6"), REPEATING_PROMPT),
}


@pytest.fixture(autouse=True)
def draft_in_prefill_rounds(monkeypatch):
    """The prefill round drafts here too (by default it drafts nothing:
    :func:`specgen.planning.planner.prefills`), so a 3-token output has three drafted positions."""
    monkeypatch.setattr("specgen.planning.planner.prefills", lambda feed: False)


def _pipeline(drafter: str, overrides: tuple[str, ...]):
    vocab = VOCAB8 if drafter == "tiny" else VOCAB8[:1]
    return tiny_pipeline(*vocab, *overrides, drafter=drafter)


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_matches_target_distribution(name):
    drafter, overrides, prompt = CASES[name]
    pipe = _pipeline(drafter, overrides)
    assert str(pipe.guarantee) == "exact"
    expected = exact_distribution(pipe, prompt, LENGTH)
    assert sum(expected.values()) == pytest.approx(1.0, abs=1e-6)
    counts = sample_counts(pipe, prompt, LENGTH, NUM_SAMPLES)
    drafted = pipe.generate(prompt_ids=prompt, max_new_tokens=LENGTH, seed=0).stats.drafted
    assert drafted > 0, "the drafter must actually propose for this test to mean anything"
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > MIN_P_VALUE, f"{name}: chi-square p={p_value:.2e}, TV={tv:.3f}"


def test_plain_path_matches_target_distribution():
    pipe = _pipeline("tiny", ("sampling.temperature=1.0", "sampling.top_k=6"))
    expected = exact_distribution(pipe, PROMPT, LENGTH)
    counts = sample_counts(pipe, PROMPT, LENGTH, NUM_SAMPLES, speculative=False)
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > MIN_P_VALUE, f"plain: p={p_value:.2e}, TV={tv:.3f}"


def test_negative_control_detects_wrong_residual(monkeypatch):
    """Resampling from p (not the residual) after a rejection must fail the same test."""
    pipe = _pipeline("tiny", ("sampling.temperature=1.0",))
    expected = exact_distribution(pipe, PROMPT, LENGTH)
    monkeypatch.setattr(rejection, "positive_residual", lambda target_probs, draft_probs: target_probs)
    counts = sample_counts(pipe, PROMPT, LENGTH, NUM_SAMPLES)
    p_value, _ = goodness_of_fit(counts, expected)
    assert p_value < MIN_P_VALUE


def test_negative_control_detects_a_fresh_draw_after_a_coupled_mismatch(monkeypatch):
    """A deterministic draft is verified by coupling (the drawn token decides and is emitted). Emitting
    a fresh draw from p after a mismatch (the rejected token not removed) must fail the same test."""
    drafter, overrides, prompt = CASES["ngram_one_hot_q"]
    pipe = _pipeline(drafter, overrides)
    expected = exact_distribution(pipe, prompt, LENGTH)
    verify_coupled, rng = rejection._verify_coupled, torch.Generator().manual_seed(0)

    def fresh_draw(target_probs, draft_tokens, reads, generator):
        verdict = verify_coupled(target_probs, draft_tokens, reads, generator)
        if verdict.kind != "resampled":
            return verdict
        return dataclasses.replace(verdict, next_token=sample_token(target_probs[verdict.num_accepted], rng))

    monkeypatch.setattr(rejection, "_verify_coupled", fresh_draw)
    counts = sample_counts(pipe, prompt, LENGTH, NUM_SAMPLES)
    p_value, _ = goodness_of_fit(counts, expected)
    assert p_value < MIN_P_VALUE
