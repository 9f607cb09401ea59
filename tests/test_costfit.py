"""The batched cost table's fit (specgen.planning.fit): exact on model data, monotone, robust to one bad cell."""

from __future__ import annotations

import itertools

import pytest

from specgen.planning.fit import fit_forwards

SIZES, WIDTHS = (1, 2, 4, 8), (1, 2, 3, 5, 9)


def _model(b: int, w: int, t: int) -> float:
    return 0.030 + 0.0012 * t + 0.0008 * b + 0.0002 * b * w + 0.0015 * w


def _cells(cost=_model, ragged: bool = True):
    cells = [(b, w, b * w, cost(b, w, b * w)) for b, w in itertools.product(SIZES, WIDTHS)]
    if ragged:
        cells += [(b, w, b - 1 + w, cost(b, w, b - 1 + w)) for b, w in itertools.product(SIZES[1:], WIDTHS[1:])]
    return cells


def test_the_fit_recovers_model_costs_exactly():
    fit = fit_forwards(_cells())
    for b, w in itertools.product(SIZES, WIDTHS):
        for t in {b * w, b - 1 + w}:
            assert fit(b, w, t) == pytest.approx(_model(b, w, t), rel=1e-9)


def test_uniform_cells_alone_fit_tokens_and_padded_shape_as_one():
    fit = fit_forwards(_cells(ragged=False))
    for b, w in itertools.product(SIZES, WIDTHS):
        assert fit(b, w, b * w) == pytest.approx(_model(b, w, b * w), rel=1e-9)


def test_one_cell_read_high_does_not_invert_the_table():
    """4 rows x 1 token read 60 % high (as on a busy machine) made a plain step look dearer than
    a 2-wide one; the fit keeps every width and row count non-decreasing."""
    def noisy(b, w, t):
        return _model(b, w, t) * (1.6 if (b, w) == (4, 1) else 1.0)

    cells = _cells(noisy)
    raw = {(b, w): s for b, w, t, s in cells if t == b * w}
    assert raw[(4, 1)] > raw[(4, 2)]  # the inversion the planner used to see
    fit = fit_forwards(cells)
    for b, w in itertools.product(SIZES, WIDTHS):
        assert fit(b, w, b * w) >= fit(b, w, b - 1 + w) - 1e-15  # ragged never dearer than uniform
        if w > 1:
            earlier = WIDTHS[WIDTHS.index(w) - 1]
            assert fit(b, w, b * w) >= fit(b, earlier, b * earlier)
        if b > 1:
            fewer = SIZES[SIZES.index(b) - 1]
            assert fit(b, w, b * w) >= fit(fewer, w, fewer * w)
    assert abs(fit(4, 1, 4) / _model(4, 1, 4) - 1) < 0.15  # the bad cell is pulled back near the truth


def test_coefficients_stay_non_negative():
    """Timings that fall with more rows (impossible, noise) give a flat fit in rows, not a falling one."""
    def falling(b, w, t):
        return 0.05 + 0.001 * w - 0.002 * b

    fit = fit_forwards(_cells(falling))
    assert fit(8, 3, 24) >= fit(1, 3, 3) - 1e-12
    assert all(fit(b, w, b * w) > 0 for b, w in itertools.product(SIZES, WIDTHS))


def test_nothing_to_fit_is_an_error():
    with pytest.raises(ValueError, match="no measured"):
        fit_forwards([])
