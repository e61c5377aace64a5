"""A count of the Triton kernels the engine launches, for tests and bench.kernels.

Every Triton wrapper in ``engine/kernels`` calls ``record(name)`` right before it launches its
kernel. Outside a ``LaunchCounter`` block that is one global lookup; inside one, the launch is
counted by name. Torch's own kernels are counted apart, by a ``TorchDispatchMode``
(``engine/device_path.py``), so the two together are what a step launches on the device.
"""

from __future__ import annotations

from collections import Counter

_active: list[Counter] = []


def record(name: str) -> None:
    """Count one launch of the Triton kernel ``name`` in every open ``LaunchCounter``."""
    for counter in _active:
        counter[name] += 1


class LaunchCounter:
    """``with LaunchCounter() as launches:`` counts the Triton launches made inside the block by name."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def __enter__(self) -> Counter:
        _active.append(self.counts)
        return self.counts

    def __exit__(self, *exc) -> None:
        _active.remove(self.counts)
