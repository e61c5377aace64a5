"""The CPU tier: a fixed-size host-memory pool of KV blocks with LRU eviction.

Blocks arrive when the KV pool evicts them and leave, least recently used first, when space is
needed; an evicted block is handed to ``on_evict`` (the Redis spill) before its slot is reused.
One buffer ``[num_slots, block_bytes]``, pinned for a GPU pool so that copies to and from it run
asynchronously (``kv_store/block_copier.py``); ``before_reuse`` lets such a copy land before a
slot's bytes are read or replaced. Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch


class CPUTier:
    """``capacity_bytes // block_bytes`` block slots keyed by block key, in LRU order."""

    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: int,
        on_evict: Callable[[int, torch.Tensor], None] | None = None,
        *,
        pin_memory: bool | None = None,
        bytes_elsewhere: bool = False,
    ) -> None:
        """``pin_memory``: page-lock the buffer (for a GPU pool); None pins it when CUDA is present.
        ``bytes_elsewhere``: keep only the bookkeeping, the slots' bytes live in another process
        (a data-parallel replica's rank mirrors this tier's slots, engine/parallel/tier_mirror.py):
        the buffer is a ``meta`` tensor, and ``put`` and ``get`` are refused."""
        if block_bytes < 1:
            raise ValueError(f"block_bytes: must be >= 1, got {block_bytes}")
        self.num_slots = capacity_bytes // block_bytes
        if self.num_slots < 1:
            raise ValueError(f"capacity_bytes: {capacity_bytes} holds no block of {block_bytes} bytes")
        self.block_bytes = block_bytes
        self.on_evict = on_evict
        self.on_evict_slot: Callable[[int, int], None] | None = None
        """Called with (key, slot) of a victim before ``on_evict``: the slot's copies on the other
        ranks of a multi-rank replica (which mirror this tier's slots) go down the same way."""
        self.before_reuse: Callable[[int], None] | None = None
        """Called with a slot before its bytes go to ``on_evict`` or it is given to another key:
        a copy into it still in flight must land first (``BlockCopier.wait_slot``)."""
        if bytes_elsewhere:
            self.buffer = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, device="meta")
        elif torch.cuda.is_available() if pin_memory is None else pin_memory:
            self.buffer = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=True)
        else:  # calloc'd: pages cost nothing until a block lands in them
            self.buffer = torch.from_numpy(np.zeros((self.num_slots, block_bytes), dtype=np.uint8))
        self._rows = self.buffer.numpy() if not bytes_elsewhere else None
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.num_evictions = 0

    def __contains__(self, key: int) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> list[int]:
        return list(self._slots)

    def run_length(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, the tier holds (their order of use is kept)."""
        return next((i for i, key in enumerate(keys) if key not in self._slots), len(keys))

    def claim(self, key: int) -> int:
        """A slot for ``key``, a key not held, now most recently used; the caller fills it. When
        every slot is taken, the least recently used key's goes to ``on_evict`` first."""
        if key in self._slots:
            raise ValueError(f"key: {key} is already in the CPU tier; refresh it with slot_of")
        evicted = None if self._free else self._slots.popitem(last=False)
        slot = self._free.pop() if evicted is None else evicted[1]
        if self.before_reuse is not None:
            self.before_reuse(slot)
        if evicted is not None:
            if self.on_evict_slot is not None:
                self.on_evict_slot(evicted[0], slot)
            if self.on_evict is not None:
                self.on_evict(evicted[0], self.buffer[slot])
            self.num_evictions += 1
        self._slots[key] = slot
        return slot

    def put(self, key: int, block: torch.Tensor) -> list[int]:
        """Store a copy of ``block`` (host ``uint8 [block_bytes]``) under ``key`` as most recently
        used; returns the keys evicted to make room. A key already held is only refreshed."""
        if self._rows is None:
            raise ValueError("put: this CPU tier keeps only bookkeeping; its bytes live on another rank")
        if block.numel() != self.block_bytes:
            raise ValueError(f"block: {block.numel()} bytes, the tier holds blocks of {self.block_bytes}")
        if key in self._slots:
            self._slots.move_to_end(key)
            return []
        evicted = [] if self._free else [next(iter(self._slots))]
        np.copyto(self._rows[self.claim(key)], block.reshape(-1).numpy())
        return evicted

    def slot_of(self, key: int) -> int | None:
        """The slot holding ``key``, now most recently used; None when the tier lacks it."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
        return slot

    def get(self, key: int) -> torch.Tensor | None:
        """The block under ``key`` (a view into the tier; copy it before the next ``put``), now most recently used."""
        slot = self.slot_of(key)
        if slot is not None and self._rows is None:
            raise ValueError("get: this CPU tier keeps only bookkeeping; its bytes live on another rank")
        return None if slot is None else self.buffer[slot]

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
