"""A smooth model of batched forward costs, fitted to noisy timings (pure: no models, no clocks).

Timings of one shape vary between runs, and a single cell read high or low
(4 rows x 1 token priced above 4 rows x 2 tokens) would send the batch planner
the wrong way. Every cell of a batched table is therefore read from one
least-squares fit over all of them,

    seconds = a + c * T + d * b + e * b * w + f * w        (every coefficient >= 0)

for b rows fed w tokens each (padded), T of them real: ``a`` the fixed cost of a
forward, ``c`` a real token's linear layers, ``d`` a row's own work, ``e`` the
work done on the padded shape (attention, norms, rotary embeddings) and ``f`` what
width costs whatever the rows (a few rows' tokens use the matrix kernels less
well than many rows' do). Where no cell is ragged (T = b * w everywhere) ``c``
and ``e`` cannot be told apart and one coefficient is fitted. Non-negative
coefficients make the fitted table non-decreasing in rows, widths and real tokens, and a ragged forward never
dearer than the uniform one of the same shape. Residuals are relative, so the
small cells weigh as much as the large ones. The model is linear in b for a fixed
w, so it prices batches of more rows than were measured by its continuation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

#: One measured forward: (rows b, width w, real tokens T, seconds).
Cell = tuple[int, int, int, float]


def fit_forwards(cells: Sequence[Cell]) -> Callable[[int, int, int], float]:
    """Fit the model above to ``cells``; -> cost(b, w, T) in seconds.

    Coefficients are kept non-negative by an active set: a coefficient the fit
    makes negative is fixed at 0 and the rest refitted.
    """
    if not cells:
        raise ValueError("no measured forwards to fit")
    ragged = any(t != b * w for b, w, t, _ in cells)
    columns = [lambda b, w, t: 1.0, lambda b, w, t: float(t), lambda b, w, t: float(b), lambda b, w, t: float(w)]
    if ragged:
        columns.append(lambda b, w, t: float(b * w))
    seconds = torch.tensor([s for *_, s in cells], dtype=torch.float64)  # [cells]
    design = torch.tensor([[f(b, w, t) for f in columns] for b, w, t, _ in cells],
                          dtype=torch.float64)  # [cells, columns]
    weight = 1.0 / seconds.clamp(min=1e-12)  # relative residuals
    free = list(range(len(columns)))
    coef = torch.zeros(len(columns), dtype=torch.float64)
    while free:
        system = design[:, free] * weight[:, None]  # [cells, free]
        solution = torch.linalg.lstsq(system, (seconds * weight)[:, None], driver="gelsd").solution[:, 0]
        if bool((solution >= 0).all()):
            coef.zero_()
            coef[free] = solution
            break
        free.pop(int(solution.argmin()))
    values = [float(x) for x in coef]

    def cost(b: int, w: int, tokens: int) -> float:
        return sum(v * f(b, w, tokens) for v, f in zip(values, columns, strict=True))

    return cost
