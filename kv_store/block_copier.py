"""Moving KV blocks between the pool and the CPU tier's host slots, one implementation per device.

``TieredKVStore`` decides what moves and keeps the books (the same code on every device); a
``BlockCopier`` moves the bytes and says when they have landed:

- ``HostBlockCopier``: the pool is in host memory. Each copy is one numpy memcpy on the calling
  thread, done when the call returns.
- ``CudaBlockCopier``: the pool is on a GPU, the slots in pinned host memory. Copies run on a side
  stream, each after the work the engine's stream (the *compute* stream) holds when it is issued,
  and the compute stream waits for them on the device; the host waits only for a slot it reads.

::

    engine thread   schedule: evict b (save) ... load b' (load) ─ fence ─ build inputs ─ launch step
                                    │                   │          │
    side stream           ●wait ── D2H b→slot ── H2D slot→b' ──────●
                          │(what the compute              │         (every copy so far)
                          │ stream held: step N)          ▼
    compute stream  ─ step N ─┘··························· wait ─── step N+1 (writes b, reads b') ──

The engine reads every step's tokens on the host, so the GPU is idle while the next step is
scheduled: copies issued then run while the engine thread schedules the rest and builds the
step's inputs, and the compute stream's wait (a device-side event wait, never a host sync) costs
the step only what the copies outlast that work.

The contract ``TieredKVStore`` keeps, and that ``tests/unit/kv_store/test_block_copier.py``
checks with a copier that defers every copy until it is waited for:

- a slot's bytes are read on the host (the Redis spill) or the slot is given to another block
  only after ``wait_slot(slot)``;
- a pool block a copy writes or reads is touched by a step only after ``fence()``;
- a writer outside the compute stream (a NIXL peer) writes pool blocks only after ``synchronize()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch


class BlockCopier(ABC):
    """Copies whole blocks between rows of the pool (``uint8 [num_blocks, block_bytes]``) and
    rows of the CPU tier's slots (``uint8 [num_slots, block_bytes]``, or None without a CPU tier)."""

    @abstractmethod
    def save(self, block_id: int, slot: int) -> None:
        """Copy pool block ``block_id`` into ``slot``, after every write to the block issued so far.

        The slot's previous contents must have been waited for (``wait_slot``). Its new bytes may
        be read on the host only after ``wait_slot(slot)``; the block may be overwritten by a
        step only after ``fence()``."""

    @abstractmethod
    def load(self, slot: int, block_id: int) -> None:
        """Copy ``slot`` into pool block ``block_id`` (after any ``save`` into the slot); the
        block is the new bytes for a step only after ``fence()``."""

    @abstractmethod
    def load_bytes(self, data: bytes, block_id: int) -> None:
        """Copy ``data`` (``block_bytes`` bytes from the host, e.g. a Redis value) into pool block
        ``block_id``; ``data`` may be dropped when this returns; visible to a step after ``fence()``."""

    @abstractmethod
    def block_bytes(self, block_id: int) -> bytes:
        """Pool block ``block_id``'s bytes as every write issued so far left them (waits for them)."""

    @abstractmethod
    def wait_slot(self, slot: int) -> None:
        """Return once the last ``save`` into ``slot`` has landed in it."""

    @abstractmethod
    def fence(self) -> None:
        """Make every step issued from now on wait for every copy issued so far (not the host)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Return once every copy issued so far has landed."""


class HostBlockCopier(BlockCopier):
    """A pool in host memory: each copy is one memcpy on this thread, done when the call returns.

    numpy's copy is one memcpy on the calling thread; torch's ``copy_`` of a uint8 row goes
    through the OpenMP team and took milliseconds instead of ~20 us when other processes held
    the cores."""

    def __init__(self, pool: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        self._pool_rows = pool.numpy()
        self._slot_rows = slots.numpy() if slots is not None else None

    def save(self, block_id: int, slot: int) -> None:
        np.copyto(self._slot_rows[slot], self._pool_rows[block_id])

    def load(self, slot: int, block_id: int) -> None:
        np.copyto(self._pool_rows[block_id], self._slot_rows[slot])

    def load_bytes(self, data: bytes, block_id: int) -> None:
        self._pool_rows[block_id] = np.frombuffer(data, dtype=np.uint8)

    def block_bytes(self, block_id: int) -> bytes:
        return self._pool_rows[block_id].tobytes()

    def wait_slot(self, slot: int) -> None:
        pass

    def fence(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaBlockCopier(BlockCopier):
    """A pool on a GPU and slots in pinned host memory: copies on a side stream (module docstring).

    The compute stream is the engine thread's current stream on the pool's device, read at each
    call: the stream the engine launches its steps on.
    """

    def __init__(self, pool: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        if slots is not None and not slots.is_pinned():
            raise ValueError("slots: the CPU tier's buffer must be pinned for copies from a GPU pool to run asynchronously")
        self._pool = pool
        self._slots = slots
        self._device = pool.device
        self._stream = torch.cuda.Stream(device=pool.device)
        self._slot_events: dict[int, torch.cuda.Event] = {}
        """The event after each slot's last save not yet waited for."""

    def save(self, block_id: int, slot: int) -> None:
        self._after_compute()
        with torch.cuda.stream(self._stream):
            self._slots[slot].copy_(self._pool[block_id], non_blocking=True)
        self._slot_events[slot] = self._stream.record_event()

    def load(self, slot: int, block_id: int) -> None:
        self._after_compute()
        with torch.cuda.stream(self._stream):
            self._pool[block_id].copy_(self._slots[slot], non_blocking=True)

    def load_bytes(self, data: bytes, block_id: int) -> None:
        self._after_compute()
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        with torch.cuda.stream(self._stream):
            self._pool[block_id].copy_(source)  # from pageable memory, synchronously: the Redis path, slow anyway

    def block_bytes(self, block_id: int) -> bytes:
        self._after_compute()
        with torch.cuda.stream(self._stream):
            host = self._pool[block_id].to("cpu")  # waits for the side stream
        return host.numpy().tobytes()

    def wait_slot(self, slot: int) -> None:
        event = self._slot_events.pop(slot, None)
        if event is not None:
            event.synchronize()

    def fence(self) -> None:
        torch.cuda.current_stream(self._device).wait_stream(self._stream)

    def synchronize(self) -> None:
        self._stream.synchronize()
        self._slot_events.clear()

    def _after_compute(self) -> None:
        """The side stream's next copy waits for what the compute stream holds now (the last
        step's writes to the block, a step still reading it)."""
        self._stream.wait_stream(torch.cuda.current_stream(self._device))


def block_copier(pool: torch.Tensor, slots: torch.Tensor | None = None) -> BlockCopier:
    """The copier for ``pool``'s device: host memcpys for a CPU pool, side-stream copies for a CUDA one."""
    if pool.dim() != 2 or pool.dtype != torch.uint8:
        raise ValueError(f"pool: expected uint8 [num_blocks, block_bytes], got {pool.dtype} {list(pool.shape)}")
    if slots is not None and (slots.device.type != "cpu" or slots.dtype != torch.uint8 or slots.dim() != 2 or slots.shape[1] != pool.shape[1]):
        raise ValueError(f"slots: expected host uint8 [num_slots, {pool.shape[1]}], got {slots.dtype} {list(slots.shape)} on {slots.device}")
    if pool.device.type == "cpu":
        return HostBlockCopier(pool, slots)
    if pool.device.type == "cuda":
        return CudaBlockCopier(pool, slots)
    raise ValueError(f"pool: on {pool.device}; KV tiers copy blocks from cpu or cuda pools")
