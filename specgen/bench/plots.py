"""PNG plots of a benchmark's rows (matplotlib, non-interactive backend).

``acceptance_per_position.png``  share of drafts accepted at each draft position,
                                 one line per speculative cell, one panel per task;
``speedup_vs_gamma.png``         median paired speedup over specgen plain against
                                 gamma, one line per temperature (solid: specgen,
                                 dashed: HF's counterpart), one panel per task;
``time_split.png``               milliseconds per round in draft / verify /
                                 process / grammar (constrained runs) / commit /
                                 other, one bar per cell (labelled with the
                                 grammar's share of wall time under a grammar).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.ticker import MaxNLocator

from specgen.bench.summary import STAGES

PLOT_FILES = ("acceptance_per_position.png", "speedup_vs_gamma.png", "time_split.png")


def write_plots(rows: Sequence[Mapping], out_dir: Path, title: str = "") -> list[Path]:
    """Write the three PNGs into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    tasks = sorted({row["task"] for row in rows})
    paths = []
    for name, draw in zip(PLOT_FILES, (_acceptance, _speedup, _time_split)):
        if draw is _time_split:
            fig, axes = plt.subplots(1, 1, figsize=(9, 0.45 * max(4, len(_split_rows(rows))) + 1.5), squeeze=False)
        else:
            fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
        draw(rows, tasks, axes[0])
        if title:
            fig.suptitle(textwrap.fill(title, 110), fontsize=8)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _acceptance(rows, tasks, axes) -> None:
    for ax, task in zip(axes, tasks):
        for row in rows:
            rates = (row.get("engine") or {}).get("acceptance_per_position")
            if row["task"] != task or row["method"] != "specgen" or not rates:
                continue
            positions = [i + 1 for i, r in enumerate(rates) if r is not None]
            ax.plot(positions, [r for r in rates if r is not None], marker="o",
                    label=f"T={row['temperature']:g} γ={row['gamma']}")
        ax.set(title=task, xlabel="draft position", ylabel="accepted share", ylim=(0, 1.05))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _legend(ax)


def _speedup(rows, tasks, axes) -> None:
    for ax, task in zip(axes, tasks):
        temperatures = sorted({row["temperature"] for row in rows if row["task"] == task})
        for index, temperature in enumerate(temperatures):
            colour = f"C{index}"
            for method, style in (("specgen", "-"), ("hf_assisted", "--"), ("hf_prompt_lookup", ":")):
                cell = [row for row in rows if row["task"] == task and row["temperature"] == temperature
                        and row["method"] == method and row["speedup_vs_plain"]]
                points = sorted((row["gamma"], row["speedup_vs_plain"]["median"]) for row in cell
                                if not isinstance(row["gamma"], str))
                if points:
                    ax.plot(*zip(*points), style, color=colour, marker="o", label=f"{method} T={temperature:g}")
                for row in cell:
                    if isinstance(row["gamma"], str):  # γ = auto: one level across the fixed-γ axis
                        ax.axhline(row["speedup_vs_plain"]["median"], color=colour, linestyle="-.",
                                   label=f"{method} γ=auto T={temperature:g}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=task, xlabel="γ (draft tokens per round)", ylabel="speedup vs specgen plain")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _legend(ax)


def _split_rows(rows):
    return [row for row in rows if row.get("engine")]


def _time_split(rows, tasks, axes) -> None:
    ax = axes[0]
    chosen = _split_rows(rows)
    labels = [f"{r['task']} T={r['temperature']:g} " + (f"γ={r['gamma']}" if r["gamma"] else r["method"])
              + _grammar_label(r) for r in chosen]
    left = [0.0] * len(chosen)
    for index, stage in enumerate((*STAGES, "other")):
        widths = [max(0.0, r["engine"]["per_round_ms"].get(stage, 0.0)) for r in chosen]
        if stage == "grammar" and not any(widths):
            continue  # no constrained cell: keep the legend to the stages that ran
        ax.barh(range(len(chosen)), widths, left=left, color=f"C{index}", label=stage)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(chosen)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms per round (plain: per step)", title="time split per round")
    _legend(ax)


def _grammar_label(row: Mapping) -> str:
    """", grammar 2.1%" for a constrained cell (its share of wall time), else ""."""
    share = (row.get("grammar") or {}).get("share")
    return "" if share is None else f", grammar {100 * share:.1f}%"


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot_costs(tables: Mapping[str, object], path: Path, title: str = "") -> Path:
    """v(n) of each cost table (specgen.planning.CostTable), chain solid and tree dashed, one
    colour per label, in units of that table's own 1-token forward; write ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, table) in enumerate(tables.items()):
        colour = f"C{i}"
        ms = 1e3 * table.step_s
        ax.plot(range(1, len(table.chain) + 1), table.chain, marker="o", color=colour,
                label=f"{label} chain (v(1) = {ms:.1f} ms)")
        if table.tree:
            ax.plot(range(1, len(table.tree) + 1), table.tree, marker="x", linestyle="--", color=colour,
                    label=f"{label} tree")
    ax.set(xlabel="tokens verified in one forward (n)", ylabel="v(n) = cost / cost of 1 token", ylim=(0, None))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(textwrap.fill(title, 90), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
