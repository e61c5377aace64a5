"""A BlockCopier that plays a GPU's side stream on CPU, so the GPU tiers' ordering is tested here.

Copies are queued in issue order (one stream) and land only when the BlockCopier contract says
they must have: all of them at ``fence``/``synchronize``/``block_bytes``, those up to a slot's
last save at ``wait_slot``. A slot saved into shows the host 0xEE bytes until it is waited for
(the device's bytes are kept aside meanwhile), as pinned memory does while a copy is in flight
and ordering is not guaranteed. So a store that reads a slot, or lets a step touch a pool block,
before it may, reads or keeps wrong bytes, which the tests' exact byte checks catch; a slot saved
into again before it was waited for fails at once.
"""

from __future__ import annotations

import numpy as np
import torch

from kv_store.block_copier import BlockCopier

POISON = 0xEE


class FakeStreamCopier(BlockCopier):
    """Deferred copies between a CPU pool and CPU slots, with ``log`` of every call in order."""

    def __init__(self, pool: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        self._pool_rows = pool.numpy()
        self._slot_rows = slots.numpy() if slots is not None else None
        self._queue: list[tuple[str, int, int, bytes | None]] = []
        self._device_slots: dict[int, np.ndarray] = {}
        """Slots whose bytes the device wrote and the host has not waited for."""
        self._unwaited: set[int] = set()
        self.log: list[tuple] = []

    def save(self, block_id: int, slot: int) -> None:
        self.log.append(("save", block_id, slot))
        assert slot not in self._unwaited, f"slot {slot} reused before its copy was waited for"
        self._unwaited.add(slot)
        self._slot_rows[slot] = POISON
        self._queue.append(("save", block_id, slot, None))

    def load(self, slot: int, block_id: int) -> None:
        self.log.append(("load", slot, block_id))
        self._queue.append(("load", block_id, slot, None))

    def load_bytes(self, data: bytes, block_id: int) -> None:
        self.log.append(("load_bytes", block_id))
        self._queue.append(("load_bytes", block_id, -1, bytes(data)))

    def block_bytes(self, block_id: int) -> bytes:
        self.log.append(("block_bytes", block_id))
        self._land(len(self._queue))
        return self._pool_rows[block_id].tobytes()

    def wait_slot(self, slot: int) -> None:
        self.log.append(("wait_slot", slot))
        saves = [i for i, (kind, _, s, _) in enumerate(self._queue) if kind == "save" and s == slot]
        if saves:
            self._land(saves[-1] + 1)
        self._reveal(slot)

    def fence(self) -> None:
        self.log.append(("fence",))
        self._land(len(self._queue))

    def synchronize(self) -> None:
        self.log.append(("synchronize",))
        self._land(len(self._queue))
        for slot in list(self._unwaited):
            self._reveal(slot)

    @property
    def num_queued(self) -> int:
        """Copies issued and not landed."""
        return len(self._queue)

    def _land(self, count: int) -> None:
        for kind, block_id, slot, data in self._queue[:count]:
            if kind == "save":
                self._device_slots[slot] = self._pool_rows[block_id].copy()
            elif kind == "load":
                source = self._device_slots.get(slot)
                self._pool_rows[block_id] = self._slot_rows[slot] if source is None else source
            else:
                self._pool_rows[block_id] = np.frombuffer(data, dtype=np.uint8)
        del self._queue[:count]

    def _reveal(self, slot: int) -> None:
        if slot in self._device_slots:
            self._slot_rows[slot] = self._device_slots.pop(slot)
        self._unwaited.discard(slot)
