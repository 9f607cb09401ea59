"""Facts about the machine this process runs on, read without importing torch or the models."""

from __future__ import annotations

import os


def logical_cpus() -> int:
    """Logical CPUs this process may run on: the most threads that can run at once."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def available_memory() -> int | None:
    """Bytes of memory the kernel says can be allocated without swapping (``MemAvailable``), or the
    free physical pages where that is not reported; None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(count: float) -> str:
    """``count`` bytes for a message: ``1.5 GB``, ``94 MB``, ``512 kB``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{int(count)} B"
