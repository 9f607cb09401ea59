"""Facts about the machine this process runs on, read without importing torch or the models."""

from __future__ import annotations

import os


def logical_cpus() -> int:
    """Logical CPUs this process may run on: the most threads that can run at once."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
