"""The ``specgen-bench`` command: run the matrix, print the table, write results.

stdout gets the markdown tables only; progress, notes and the results path go
to stderr. With ``bench.out_dir`` set (default ``bench_results``) each run
writes ``<out_dir>/<time>-<target>-<drafter>/`` holding ``results.jsonl`` (one
row per cell), ``samples.jsonl`` (one per timed generation), ``table.md`` and
the PNG plots. Errors a user can cause exit with status 2 and one line.
Ctrl-C exits with status 130 after printing and writing what was measured.

    specgen-bench target=tiny drafter=tiny threads=1 bench.gammas=[2,4] bench.temperatures=[0,0.7]
    specgen-bench -m drafter=ngram,none bench.temperatures=[0]        # Hydra multirun
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specgen.bench.batching import batch_markdown, summarise_batches
from specgen.bench.plots import write_plots
from specgen.bench.report import LEGEND, header, markdown, run_config, write_jsonl
from specgen.bench.runner import run_matrix
from specgen.bench.settings import Settings
from specgen.bench.summary import summarise
from specgen.config.checks import check_run_config
from specgen.config.compose import compose, conf_dir, exits_on_error, run_console, to_container
from specgen.errors import ConfigError
from specgen.config.paths import check_output_dir

CONFIG_NAME = "bench"


@dataclass
class BenchResult:
    """rows: one per cell (written to results.jsonl); out_dir: None when nothing was written.

    interrupted: Ctrl-C ended the run early; the rows cover the prompts measured before it.
    """

    rows: list[dict]
    samples: list[dict]
    table: str
    notes: list[str]
    out_dir: Path | None
    interrupted: bool = False


def compose_bench(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the bench config like the command line does (for scripts and tests)."""
    return compose(overrides, config_name=CONFIG_NAME)


def run_bench(cfg: DictConfig, names: Mapping[str, str] | None = None, *, out=None, err=None) -> BenchResult:
    """Run the matrix ``cfg`` describes, print the table to ``out`` and write the results.

    names: the chosen target/drafter config names (labels for rows and folders).
    ``bench.out_dir`` is checked before anything runs (ConfigError when it is a
    file or cannot be created). Ctrl-C stops the matrix: what was measured is
    printed and written and the result says ``interrupted``; with nothing
    measured yet, KeyboardInterrupt propagates.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    resolved = to_container(cfg)
    check_run_config(resolved)
    bench = resolved["bench"]
    settings = Settings.from_config(bench)
    if bench.get("costs_only"):
        return _show_costs(cfg, settings, out)
    if settings.quality:
        return _show_quality(cfg, resolved, settings, names or {}, out, err)
    if bench.get("out_dir"):
        check_output_dir(Path(str(bench["out_dir"])), "bench.out_dir")
    run = run_matrix(cfg, settings, progress=bool(bench["progress"]))
    if run.interrupted and not (run.samples or run.batch_samples):
        raise KeyboardInterrupt
    if settings.batch_sizes:
        return _batch_result(run, resolved, names, bench, out, err)
    if run.interrupted:
        run.notes.append("interrupted by Ctrl-C: the rows cover only the prompts measured before it")
    config = run_config(resolved, names or {})
    rows = summarise(run.samples, run.hf_spec_method, run.calibration)
    for row in rows:
        row.update(target=config["target"], drafter=config["drafter"], config=config, environment=run.environment,
                   calibration=run.calibration)
    num_prompts = len({s["prompt_index"] for s in run.samples})
    title = header(config, run.environment, num_prompts)
    table = markdown(rows)
    plots = (lambda out_dir: write_plots(rows, out_dir, title)) if bench["plots"] else None
    out_dir = _publish(run, bench, config, title, table, rows, run.samples, out, err, legend=LEGEND, plots=plots)
    return BenchResult(rows, run.samples, table, run.notes, out_dir, run.interrupted)


def _publish(run, bench: Mapping, config: Mapping, title: str, table: str, rows: list[dict], samples: list[dict],
             out, err, legend: str = "", plots=None) -> Path | None:
    """Print the table (stdout) and the notes (stderr); with ``bench.out_dir`` write the run's
    folder (results.jsonl, samples.jsonl, table.md, and ``plots(folder)``) -> that folder or None."""
    out.write(f"{title}\n\n{table}")
    out.flush()
    for note in run.notes:
        err.write(f"specgen-bench: {note}\n")
    if not bench.get("out_dir"):
        return None
    out_dir = _new_run_dir(Path(str(bench["out_dir"])), config)
    write_jsonl(out_dir / "results.jsonl", rows)
    write_jsonl(out_dir / "samples.jsonl", samples)
    notes = "".join(f"- {note}\n" for note in run.notes)
    (out_dir / "table.md").write_text(f"{title}\n\n{table}\n{legend}\n" + (f"\nNotes:\n{notes}" if notes else ""))
    if plots is not None:
        plots(out_dir)
    if not run.interrupted:
        err.write(f"specgen-bench: results in {out_dir}\n")
    return out_dir


def _batch_result(run, resolved: Mapping, names, bench: Mapping, out, err) -> BenchResult:
    """Print and write the batch section's table (``bench.batch_sizes``)."""
    config = run_config(resolved, names or {})
    rows = summarise_batches(run.batch_samples)
    for row in rows:
        row.update(target=config["target"], drafter=config["drafter"], config=config, environment=run.environment)
    title = header(config, run.environment, None)
    table = batch_markdown(rows)
    if run.interrupted:
        run.notes.append("interrupted by Ctrl-C: the rows cover only the repeats measured before it")
    out_dir = _publish(run, bench, config, title, table, rows, run.batch_samples, out, err)
    return BenchResult(rows, run.batch_samples, table, run.notes, out_dir, run.interrupted)


def _show_costs(cfg: DictConfig, settings: Settings, out) -> BenchResult:
    """``bench.costs_only=true``: print the pipeline's cost table (``bench.remeasure_costs=true``: measure again)."""
    from specgen.bench.runner import build_variant
    from specgen.planning.cost_cache import describe

    pipe = build_variant(cfg, settings.temperatures[0], settings, progress=False)
    if not pipe.speculative:
        raise ConfigError(f"bench.costs_only needs a drafter, but speculation is {pipe.guarantee}")
    text = describe(pipe.cost_table(refresh=settings.remeasure_costs))
    out.write(text + "\n")
    return BenchResult([], [], text, [], None)


def _show_quality(cfg: DictConfig, resolved: Mapping, settings: Settings, names: Mapping[str, str], out,
                  err) -> BenchResult:
    """``bench.quality=true``: print the quality report of ``bench.quality_paths`` (:mod:`specgen.bench.quality`)."""
    from specgen.bench.prompts import load_prompt_sets
    from specgen.bench.quality import quality_markdown, quality_title, run_quality

    notes: list[str] = []
    prompts = load_prompt_sets(settings.prompts, settings.num_prompts, notice=notes.append)
    results = run_quality(cfg, settings.quality_paths, [p.prompt for p in prompts], settings.max_new_tokens,
                          notes.append, progress=bool(resolved["bench"]["progress"]))
    target = names.get("target") or str(resolved["target"].get("name"))
    title = quality_title(target, list(dict.fromkeys(p.task for p in prompts)), len(prompts), settings.max_new_tokens, resolved.get("threads"))
    table = quality_markdown(results)
    out.write(f"{title}\n\n{table}")
    out.flush()
    for note in notes:
        err.write(f"specgen-bench: {note}\n")
    rows = [{"path": path, **vars(q)} for path, q in results.items()]
    return BenchResult(rows, [], table, notes, None)


def _new_run_dir(root: Path, config: Mapping) -> Path:
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{config['target']}-{config['drafter']}".replace("/", "_")
    root.mkdir(parents=True, exist_ok=True)
    for suffix in [""] + [f"-{i}" for i in range(2, 1000)]:
        path = root / f"{stem}{suffix}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise ConfigError(f"cannot create a new run folder under {root}")


@hydra.main(config_path=str(conf_dir()), config_name=CONFIG_NAME, version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    choices = HydraConfig.get().runtime.choices
    with exits_on_error("specgen-bench"):
        result = run_bench(cfg, {"target": choices.get("target"), "drafter": choices.get("drafter")})
    if result.interrupted:
        where = f"; results so far in {result.out_dir}" if result.out_dir else ""
        sys.stderr.write(f"specgen-bench: interrupted after {len(result.samples)} measured generations{where}\n")
        raise SystemExit(130)


def main() -> None:
    """Console entry point (``specgen-bench``): quote free-text overrides, quiet HF, hand over to Hydra."""
    run_console(_hydra_main, "specgen-bench", CONFIG_NAME)


if __name__ == "__main__":
    main()
