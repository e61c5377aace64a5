"""The CPU tier: a fixed-size host-memory pool of KV blocks with LRU eviction.

Blocks arrive when the KV pool evicts them and leave, least recently used first, when space is
needed; an evicted block is handed to ``on_evict`` (the Redis spill) before its slot is reused.
One buffer ``[num_slots, block_bytes]``, pinned when a GPU is present so that copies to and from
the GPU pool can run asynchronously. Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch


class CPUTier:
    """``capacity_bytes // block_bytes`` block slots keyed by block key, in LRU order."""

    def __init__(self, capacity_bytes: int, block_bytes: int, on_evict: Callable[[int, torch.Tensor], None] | None = None) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes: must be >= 1, got {block_bytes}")
        self.num_slots = capacity_bytes // block_bytes
        if self.num_slots < 1:
            raise ValueError(f"capacity_bytes: {capacity_bytes} holds no block of {block_bytes} bytes")
        self.block_bytes = block_bytes
        self.on_evict = on_evict
        if torch.cuda.is_available():
            self.buffer = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=True)
        else:  # calloc'd: pages cost nothing until a block lands in them
            self.buffer = torch.from_numpy(np.zeros((self.num_slots, block_bytes), dtype=np.uint8))
        self._rows = self.buffer.numpy()
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.num_evictions = 0

    def __contains__(self, key: int) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> list[int]:
        return list(self._slots)

    def put(self, key: int, block: torch.Tensor) -> list[int]:
        """Store a copy of ``block`` (``uint8 [block_bytes]``) under ``key`` as most recently used;
        returns the keys evicted to make room. A key already held is only refreshed."""
        if block.numel() != self.block_bytes:
            raise ValueError(f"block: {block.numel()} bytes, the tier holds blocks of {self.block_bytes}")
        if key in self._slots:
            self._slots.move_to_end(key)
            return []
        evicted = []
        if not self._free:
            old_key, slot = self._slots.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old_key, self.buffer[slot])
            self._free.append(slot)
            self.num_evictions += 1
            evicted.append(old_key)
        slot = self._free.pop()
        # numpy's copy is one memcpy on this thread; torch's copy_ of a uint8 row goes through the
        # OpenMP team and took milliseconds instead of ~20 us when other processes held the cores
        np.copyto(self._rows[slot], block.reshape(-1).numpy())
        self._slots[key] = slot
        return evicted

    def get(self, key: int) -> torch.Tensor | None:
        """The block under ``key`` (a view into the tier; copy it before the next ``put``), now most recently used."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        self._slots.move_to_end(key)
        return self.buffer[slot]

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
