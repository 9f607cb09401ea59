"""Shared fixtures: tiny pipelines (single-threaded, float32) and helpers."""

from __future__ import annotations

import pytest

import specgen

TINY = ("target=tiny", "threads=1", "dtype=float32")


def tiny_pipeline(*overrides: str, drafter: str = "tiny"):
    """A pipeline on the tiny random models with extra CLI-style overrides."""
    return specgen.pipeline(*TINY, f"drafter={drafter}", *overrides, progress=False)


@pytest.fixture
def make_tiny():
    return tiny_pipeline
