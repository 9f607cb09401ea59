"""A counting hook for host reads: a CPU stand-in for ``torch.cuda.set_sync_debug_mode``.

On a GPU every value read back to Python (``.item()``, ``.tolist()``, ``float(t)``,
``int(t)``, ``bool(t)``, ``.nonzero()``, ``.cpu()``, ``.numpy()``) stalls the stream.
:func:`counting_reads` counts calls of those tensor methods, in specgen and in the
libraries it calls, while its block runs. Used by tests/test_syncs.py and
scripts/gpu_check.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: The tensor methods that read a value back to the host.
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "cpu", "numpy")


@contextlib.contextmanager
def counting_reads() -> Iterator[list[int]]:
    """Count calls of the tensor methods in :data:`READS` while the block runs -> [count].

    Patches ``torch.Tensor`` process-wide for the duration, so it is not thread-safe."""
    count = [0]
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(method):
        def wrapper(self, *args, **kwargs):
            count[0] += 1
            return method(self, *args, **kwargs)
        return wrapper

    for name, method in saved.items():
        setattr(torch.Tensor, name, counted(method))
    try:
        yield count
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
