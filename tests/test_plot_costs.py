"""The v(n) plot of scripts/plot_costs.py (specgen.bench.plots.plot_costs)."""

from __future__ import annotations

from specgen.bench.plots import plot_costs
from specgen.planning import CostTable


def test_plot_costs_writes_a_png(tmp_path):
    tables = {"float32": CostTable(chain=(1.0, 1.1, 1.6, 2.1), tree=(1.0, 1.2, 1.7), step_s=0.06),
              "bfloat16": CostTable(chain=(1.0, 1.1, 1.1, 1.12), tree=(), step_s=0.06)}
    path = plot_costs(tables, tmp_path / "costs.png", title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
