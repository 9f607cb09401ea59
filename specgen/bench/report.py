"""Rows out: the environment record, JSONL files and the markdown tables.

Every JSONL row is self-describing: the cell, its metrics (see summary.py),
the run's config (target, drafter, sampling, bench settings) and environment
(torch/transformers versions, threads, dtype, device, the CPU's capability: specgen.models.cpu).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from specgen.bench.summary import STAGES
from specgen.models import cpu


def environment(pipe) -> dict:
    """Versions, threads, dtype and device the pipeline runs with."""
    import transformers

    import specgen

    device = pipe.device
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = cpu.model_name() or "cpu"
    return {
        "torch": torch.__version__, "transformers": transformers.__version__, "specgen": specgen.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "dtype": str(pipe.target.dtype).replace("torch.", ""), "backend": pipe.target.backend,
        "numerics": pipe.target.describe()["dtype"],  # the path that runs, e.g. "int8 (torch _weight_int8pack_mm, ...)"
        "device": str(device), "device_name": device_name, "cpu": cpu.describe(),
    }


def run_config(cfg: Mapping, names: Mapping[str, str]) -> dict:
    """The part of the resolved config that defines a cell's numbers."""
    return {
        "target": names.get("target") or cfg["target"].get("name"),
        "drafter": names.get("drafter") or cfg["drafter"].get("kind"),
        "drafter_config": {k: v for k, v in cfg["drafter"].items() if k != "_target_"},
        "sampling": dict(cfg["sampling"]),
        "device": cfg.get("device"), "dtype": cfg.get("dtype"), "threads": cfg.get("threads"),
        "bench": dict(cfg["bench"]),
    }


def write_jsonl(path: Path, records: Sequence[Mapping]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, default=str) + "\n")


def _num(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _median(block: Mapping | None, digits: int = 2) -> str:
    return "–" if not block else _num(block["median"], digits)


def _with_spread(block: Mapping | None, digits: int = 1) -> str:
    if not block:
        return "–"
    return f"{block['median']:.{digits}f} [{block['p25']:.{digits}f}–{block['p75']:.{digits}f}]"


def _method_label(row: Mapping) -> str:
    return row["method"] if row["gamma"] is None else f"{row['method']} γ={row['gamma']}"


def _model_caption(calibration: Mapping | None) -> str:
    text = "Speed model: predicted speedup = E[K]·(1 + o_plain) / (v + γ̄·c + o), in target forwards of 1 token"
    if calibration:
        text += (f" ({1e3 * calibration['step_s']:.1f} ms, measured at {calibration['context_tokens']} context tokens;"
                 " v and c measured the same way)")
    return text


def header(config: Mapping, env: Mapping, num_prompts: int | None) -> str:
    """One line naming the models, machine and run size (``num_prompts`` None: left out)."""
    size = "" if num_prompts is None else f"{num_prompts} prompt(s), "
    kernels = f" {env['cpu']['torch_capability']}" if env.get("cpu") and env["device"] == "cpu" else ""
    return (f"target={config['target']} drafter={config['drafter']} | {env['device']} ({env['device_name']}{kernels}), "
            f"{env.get('backend', 'torch')} {env['dtype']}, {env['threads']} thread(s) | torch {env['torch']}, transformers "
            f"{env['transformers']} | {size}{config['bench']['max_new_tokens']} new tokens each")


def split_stages(rows: Sequence[Mapping]) -> tuple[str, ...]:
    """The time split's columns: STAGES and "other", without "grammar" when no row ran under a grammar."""
    constrained = any(row.get("grammar") for row in rows)
    return tuple(stage for stage in (*STAGES, "other") if constrained or stage != "grammar")


def markdown(rows: Sequence[Mapping]) -> str:
    """The main table (one line per cell), the grammar table for constrained cells and the
    speed-model table for speculative cells."""
    stages = split_stages(rows)
    lines = [
        "| task | T | method | tok/s median [IQR] | ×plain | ×llama.cpp | ×HF generate | ×HF spec | τ "
        f"| acceptance by position | ms/round {'·'.join(stages)} | TTFT ms | TPOT ms | =plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        engine = row.get("engine") or {}
        accept = " ".join(_num(a) for a in engine.get("acceptance_per_position") or []) or "–"
        split = "·".join(_num(engine["per_round_ms"].get(stage, 0.0), 1) for stage in stages) if engine else "–"
        lines.append(
            f"| {row['task']} | {row['temperature']:g} | {_method_label(row)} | {_with_spread(row['tokens_per_s'])} "
            f"| {_median(row['speedup_vs_plain'])} | {_median(row.get('speedup_vs_llama_cpp'))} "
            f"| {_median(row['speedup_vs_hf_generate'])} "
            f"| {_median(row['speedup_vs_hf_spec'])} | {_num(engine.get('tau'))} | {accept} | {split} "
            f"| {_median(row['ttft_ms'], 1)} | {_median(row['tpot_ms'], 1)} | {_num(row['matches_plain'])} |"
        )
    lines += _grammar_table(rows)
    model_rows = [row for row in rows if row.get("speed_model")]
    if model_rows:
        lines += ["", _model_caption(model_rows[0].get("calibration")), "",
                  "| task | T | γ | E[K] | v | γ̄ | c | o | predicted | measured | median ×plain | decode ×plain "
                  "| drafter MB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in model_rows:
            m = row["speed_model"]
            lines.append(
                f"| {row['task']} | {row['temperature']:g} | {row['gamma']} | {_num(m['E_K'])} | {_num(m['v'])} "
                f"| {_num(m['gamma'])} | {_num(m['c'], 3)} | {_num(m['o'])} | {_num(m['predicted'])} "
                f"| {_num(m['measured'])} | {_median(row['speedup_vs_plain'])} "
                f"| {_median(row['decode_speedup_vs_plain'])} | {row['drafter_memory_bytes'] / 2**20:.1f} |"
            )
    return "\n".join(lines) + "\n"


def _grammar_table(rows: Sequence[Mapping]) -> list[str]:
    """Lines of the grammar table (share of wall time, mask time per position); none without a constrained cell."""
    constrained = [row for row in rows if row.get("grammar")]
    if not constrained:
        return []
    lines = ["", "| task | T | method | grammar % of wall | mask p50 µs | mask p99 µs | masked positions |",
             "|---|---|---|---|---|---|---|"]
    for row in constrained:
        g = row["grammar"]
        share = "–" if g["share"] is None else f"{100 * g['share']:.1f}"
        lines.append(f"| {row['task']} | {row['temperature']:g} | {_method_label(row)} | {share} "
                     f"| {_num(g['mask_p50_us'], 0)} | {_num(g['mask_p99_us'], 0)} | {g['positions']} |")
    return lines


LEGEND = (
    "tok/s: new tokens / wall time per prompt (median, [25th–75th percentile]). ×plain, ×llama.cpp, ×HF generate: "
    "median over prompts of the paired ratio to specgen plain / llama.cpp's own plain decoding (llama-cpp-python's "
    "Llama.generate on the same GGUF) / HF generate() on the same prompt. ×HF spec: specgen speculative "
    "vs HF's counterpart (assisted generation or prompt lookup) at the same γ. τ: tokens per target call. "
    "=plain: share of prompts whose greedy output equals specgen plain token for token. Speed model: E[K] tokens per "
    "round, γ̄ mean draft tokens per round, v a target forward of k+1 tokens averaged over the rounds' draft lengths k, "
    "c a draft token, o (o_plain) the rest "
    "of a round (of a plain step): process, grammar, commit, loop; measured: aggregate tokens/s ratio to plain "
    "(prefill included); decode ×plain: median paired ratio of 1/TPOT (prefill excluded, like the prediction); "
    "drafter MB: weights the drafter adds. Under a grammar: grammar is the mask work (target and drafter sides, taken out of "
    "process and draft); grammar % of wall: its seconds over wall seconds summed over the cell's prompts; mask "
    "p50/p99: time per masked position, pooled over the cell's prompts."
)
