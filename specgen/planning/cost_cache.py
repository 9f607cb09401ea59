"""Cost tables served from memory, the disk cache or a fixed file, measured when missing.

:func:`cost_table` and :func:`batch_cost_table` serve a :class:`Subject`'s tables
from ``<cache_root>/costs/<key>.json``, keyed by :func:`specgen.planning.measure.facts`;
``refresh=True`` measures again. A cache file that does not load (another
format, a torn write) is measured over, never an error. With
``$SPECGEN_COST_TABLE`` naming a JSON file in the cache's format, every pipeline
plans with that fixed table instead (its optional ``"batch"`` entry the batched
one): nothing is measured or cached, and :func:`observer` corrects nothing. One
serialisation serves both kinds: :func:`to_dict` / :func:`from_dict` (the dataclass
fields as JSON values). While a table is measured, a progress line goes to stderr
(``progress``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import tempfile
import time
import typing
from collections.abc import Callable

from specgen.errors import ConfigError
from specgen.planning.costs import BatchCostTable, CostTable
from specgen.planning.measure import (BATCH_WIDTHS, BatchCache, Progress, Subject, batch_facts, batch_shape, facts,
                                      measure, measure_batch, table_size)
from specgen.planning.observed import ObservedCosts

#: Names a JSON cost table that replaces measurement for every pipeline (unset or empty: measure).
FIXED_TABLE_ENV = "SPECGEN_COST_TABLE"
_MEMO: dict[str, CostTable | BatchCostTable] = {}
Table = typing.TypeVar("Table", CostTable, BatchCostTable)


def to_dict(table: CostTable | BatchCostTable) -> dict:
    """The table's fields as JSON values, and when it was written."""
    return dict(dataclasses.asdict(table), measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))


def from_dict(kind: type[Table], data: dict) -> Table:
    """A ``kind`` table from :func:`to_dict`'s form (unknown keys ignored); ValueError, KeyError or
    TypeError when a field is missing, mistyped or the grids disagree."""
    hints = typing.get_type_hints(kind)
    values = {f.name: _coerce(hints[f.name], data[f.name]) for f in dataclasses.fields(kind)
              if f.name in data or f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return kind(**values)


def _coerce(hint, value):
    """``value`` (JSON) as the field type ``hint``: float, int, dict, or (nested) tuples of them."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        return tuple(_coerce(typing.get_args(hint)[0], item) for item in value)
    if hint is dict or origin is dict:
        return dict(value or {})
    if hint in (float, int):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {type(value).__name__}")
        return hint(value)
    return value


def cache_key(fact: dict) -> str:
    return hashlib.sha256(json.dumps(fact, sort_keys=True).encode()).hexdigest()[:20]


def stderr_progress(what: str) -> Progress:
    """A :data:`Progress` that writes ``specgen: measuring <what> ...`` lines to stderr."""

    def report(line: str) -> None:
        print(f"specgen: measuring {what} (once for this machine, then cached): {line}", file=sys.stderr, flush=True)

    return report


def observer(observe_costs: bool) -> ObservedCosts | None:
    """The running verify timings a pipeline plans through (:mod:`specgen.planning.observed`); None
    where plans come from the table alone: ``observe_costs`` false (the run config's), or a fixed table."""
    if os.environ.get(FIXED_TABLE_ENV) or not observe_costs:
        return None
    return ObservedCosts()


def cost_table(subject: Subject, *, refresh: bool = False, clock: Callable[[], float] | None = None,
               progress: Progress | None = None) -> CostTable:
    """The subject's cost table: ``$SPECGEN_COST_TABLE``'s if set (ConfigError if unreadable), else
    from memory, else from the disk cache, else measured (and cached)."""
    fixed = os.environ.get(FIXED_TABLE_ENV)
    if fixed:
        return fixed_table(fixed)
    report = progress or stderr_progress("the cost table")
    return _cached(CostTable, cache_key(facts(subject)), refresh,
                   lambda: measure(subject, clock=clock), report)


def batch_cost_table(subject: Subject, size: int, new_batch: Callable[[int], BatchCache], *,
                     refresh: bool = False, clock: Callable[[], float] | None = None,
                     progress: Progress | None = None) -> BatchCostTable:
    """The batched step's cost table for batches of ``size`` rows (any size: measured with
    :func:`specgen.planning.measure.table_size` rows): from ``$SPECGEN_COST_TABLE`` (its "batch"
    entry, else :meth:`BatchCostTable.from_chain` of its chain) if set, else from memory, the
    disk cache or measured on ``new_batch(rows)`` caches (and cached)."""
    rows = table_size(size)
    fixed = os.environ.get(FIXED_TABLE_ENV)
    if fixed:
        return _fixed_batch(fixed, rows)
    report = progress or stderr_progress("the batched cost table")
    key = "batch-" + cache_key(batch_facts(subject, rows))
    return _cached(BatchCostTable, key, refresh,
                   lambda: measure_batch(subject, rows, new_batch, clock=clock, progress=report), report)


def _cached(kind: type[Table], key: str, refresh: bool, measure_now: Callable[[], Table], report: Progress) -> Table:
    """The table under ``key``: from memory, else the disk cache, else ``measure_now()`` (then cached
    in both). ``refresh`` skips the lookups; a cache file that does not load is measured over."""
    from specgen.models.loading import cache_root

    if not refresh and key in _MEMO:
        return _MEMO[key]
    path = cache_root() / "costs" / f"{key}.json"
    table = None
    if not refresh and path.is_file():
        try:
            table = from_dict(kind, json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            table = None
    if table is None:
        began = time.perf_counter()
        report("started")
        table = measure_now()
        report(f"done in {time.perf_counter() - began:.0f} s")
        try:
            _write_atomic(path, json.dumps(to_dict(table), indent=1))
        except OSError:
            pass  # an unwritable cache only costs a re-measurement next time
    _MEMO[key] = table
    return table


def _write_atomic(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename: a process reading
    the cache while another writes it sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_fixed(path: str) -> dict:
    try:
        data = json.loads(pathlib.Path(path).expanduser().read_text())
    except OSError as error:
        raise ConfigError(f"{FIXED_TABLE_ENV}={path}: cannot read it ({error.strerror or error})") from None
    except ValueError as error:
        raise ConfigError(f"{FIXED_TABLE_ENV}={path}: not a cost table ({type(error).__name__}: {error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{FIXED_TABLE_ENV}={path}: not a cost table (a JSON object is needed)")
    return data


def fixed_table(path: str) -> CostTable:
    """The cost table stored at ``path`` (the cache's JSON format); ConfigError naming it if unusable."""
    data = _read_fixed(path)
    try:
        return from_dict(CostTable, data)
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{FIXED_TABLE_ENV}={path}: not a cost table ({type(error).__name__}: {error})") from None


def _fixed_batch(path: str, rows: int) -> BatchCostTable:
    """The fixed file's "batch" table, else a stand-in from its chain; ConfigError naming it if unusable."""
    single = fixed_table(path)
    data = _read_fixed(path)
    if "batch" not in data:
        return BatchCostTable.from_chain(single.chain, batch_shape(rows, BATCH_WIDTHS[-1])[0])
    try:
        return from_dict(BatchCostTable, data["batch"])
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{FIXED_TABLE_ENV}={path}: not a batch cost table "
                          f"({type(error).__name__}: {error})") from None


def describe(table: CostTable) -> str:
    """A few lines for humans: v(n) for chains and trees, and the drafting cost."""
    chain = " ".join(f"{v:.2f}" for v in table.chain)
    tree = " ".join(f"{v:.2f}" for v in table.tree)
    fact = table.facts
    return (f"cost table ({fact.get('dtype')}, {fact.get('device')}, {fact.get('threads')} threads; "
            f"unit: one 1-token forward = {1e3 * table.step_s:.2f} ms)\n"
            f"  v(n) chain, n = 1..{len(table.chain)}: {chain}\n"
            f"  v(n) tree (n - 1 nodes):      {tree}\n"
            f"  draft: {table.draft_fixed:.3f} per proposal + {table.draft_per_token:.3f} per token")


def describe_batch(table: BatchCostTable) -> str:
    """One line for humans: the batched verify cost per (rows, width), in 1-row 1-token forwards."""
    def cells(body) -> str:
        return "; ".join(f"B={b}: " + " ".join(f"{v:.2f}" for v in line) for b, line in zip(table.sizes, body))

    text = (f"batch cost table (unit {1e3 * table.step_s:.1f} ms; widths {','.join(map(str, table.widths))}; "
            f"+{table.head:.3f} per extra logits row)")
    ragged = f"; one row w wide, the others 1: {cells(table.ragged)}" if table.ragged else ""
    if table.wide and len(table.slots) == 2:
        return (f"{text}: {table.slots[0]} shared slots: {cells(table.body)}; {table.slots[1]} slots: "
                f"{cells(table.wide)}{ragged}")
    return f"{text}: {cells(table.body)}{ragged}"
