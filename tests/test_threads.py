"""threads=auto: the idle physical cores at start, at least one, whatever the machine."""

from __future__ import annotations

import pytest
import torch

from specgen.engine.assemble import set_threads
from specgen.errors import ConfigError
from specgen.models import threads


@pytest.mark.parametrize("cores, busy, expected", [
    (2, 0, 2), (2, 1, 1), (2, 5, 1), (8, 2.5, 6), (8, 2.4, 6), (8, 2.6, 5), (4, None, 4), (1, 0, 1)])
def test_auto_threads_leaves_busy_cores_out(cores, busy, expected):
    assert threads.auto_threads(cores, busy) == expected


def test_run_queue_samples_exclude_the_reader(tmp_path, monkeypatch):
    lines = iter(["0.50 0.40 0.30 3/120 999\n", "0.50 0.40 0.30 1/120 999\n", "0.50 0.40 0.30 3/120 999\n",
                  "0.50 0.40 0.30 2/120 999\n", "0.50 0.40 0.30 3/120 999\n"])
    fake = tmp_path / "loadavg"

    class Reader:
        def read_text(self):
            fake.write_text(next(lines))
            return fake.read_text()

    monkeypatch.setattr(threads, "LOADAVG", Reader())
    monkeypatch.setattr(threads, "INTERVAL_S", 0.0)
    assert threads.runnable_others() == 2  # median of 2, 0, 2, 1, 2 others
    monkeypatch.setattr(threads, "LOADAVG", tmp_path / "missing")
    assert threads.runnable_others() is None


def test_set_threads_auto_follows_the_idle_cores(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "physical_cores", lambda: 4)
        monkeypatch.setattr("specgen.machine.logical_cpus", lambda: 4)
        monkeypatch.setattr(threads, "runnable_others", lambda: 3)
        assert set_threads("auto") == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(threads, "runnable_others", lambda: 0)
        assert set_threads("auto") == 4
        assert set_threads(3) == 3
        with pytest.raises(ConfigError, match="threads must be a positive integer or auto"):
            set_threads(0)
        with pytest.raises(ConfigError, match="threads=5 is more than the 4 CPUs this process may run on"):
            set_threads(5)  # 100000 made the thread pool raise MemoryError
    finally:
        torch.set_num_threads(before)
