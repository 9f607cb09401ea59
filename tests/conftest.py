"""Shared fixtures: tiny pipelines (single-threaded, float32) and helpers."""

from __future__ import annotations

import pytest

import specgen
from specgen.planner import CostTable

TINY = ("target=tiny", "threads=1", "dtype=float32")
#: The cost table every test pipeline plans with (num_tokens=auto): fixed, so plans never depend on
#: this machine's speed, and cheap enough that the planner speculates. test_costmodel measures for real.
TEST_COSTS = CostTable(chain=tuple(1 + 0.05 * n for n in range(17)), tree=tuple(1 + 0.05 * n for n in range(17)),
                       draft_per_token=0.05, step_s=1e-3)


@pytest.fixture(autouse=True)
def _fixed_cost_table(monkeypatch):
    monkeypatch.setattr("specgen.costmodel.cost_table", lambda pipe, **kwargs: TEST_COSTS)


def tiny_pipeline(*overrides: str, drafter: str = "tiny"):
    """A pipeline on the tiny random models with extra CLI-style overrides."""
    return specgen.pipeline(*TINY, f"drafter={drafter}", *overrides, progress=False)


@pytest.fixture
def make_tiny():
    return tiny_pipeline
