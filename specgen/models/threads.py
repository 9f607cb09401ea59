"""How many CPU threads a run uses when ``threads=auto``.

``auto`` is the physical cores this process may run on, less the cores other
processes keep busy when the run starts. A thread pool wider than the idle
cores makes every parallel region wait for its slowest, descheduled thread, so
on a loaded machine fewer threads run faster than one per core (the figures:
docs/benchmarks.md, "Threads under load"). The count is decided once, at start;
``threads=N`` pins it.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from specgen.machine import logical_cpus

#: Samples of the run queue taken at start, this many seconds apart.
SAMPLES, INTERVAL_S = 5, 0.02
LOADAVG = Path("/proc/loadavg")



def physical_cores() -> int:
    """Physical cores available to this process (falls back to logical CPUs)."""
    available = logical_cpus()
    try:
        siblings = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list").read_text()
        per_core = len([s for s in siblings.replace("-", ",").split(",") if s.strip()])
        return max(1, available // max(per_core, 1))
    except OSError:
        return available


def runnable_others() -> float | None:
    """Runnable tasks other than this one, the median of a few samples of /proc/loadavg; None where unknown."""
    samples = []
    for i in range(SAMPLES):
        try:
            fields = LOADAVG.read_text().split()
            running = int(fields[3].split("/")[0])  # "R/T": runnable tasks now, this reader among them
        except (OSError, IndexError, ValueError):
            return None
        samples.append(max(0, running - 1))
        if i + 1 < SAMPLES:
            time.sleep(INTERVAL_S)
    return statistics.median(samples)


def auto_threads(cores: int, busy: float | None) -> int:
    """Threads for ``cores`` physical cores of which ``busy`` (None: unknown) run other work: at least one."""
    if busy is None:
        return cores
    return max(1, min(cores, cores - round(busy)))


def resolve_auto_threads() -> int:
    """``threads=auto`` on this machine now."""
    return auto_threads(physical_cores(), runnable_others())
