"""KV events: which block keys a worker holds in which tier, as an ordered, numbered stream.

Every change to a tier's key set is an event (``stored``, ``removed``, ``cleared``); events are
sealed into batches numbered 1, 2, 3, ... per worker. A consumer (the router's prefix index)
applies batches in order; on a gap (a batch number it did not expect, or a restart) it asks for a
snapshot, which carries the number of the last batch it includes, and goes on from there::

    snapshot(seq=41) + batch 42 + batch 43 ...  ==  the worker's key sets, exactly

No torch and no I/O here: the tiers record, the worker publishes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum


class Tier(str, Enum):
    """Where a block lives. POOL is the worker's KV pool (GPU memory on a GPU)."""

    POOL = "pool"
    CPU = "cpu"
    REDIS = "redis"


class EventKind(str, Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"
    """Every key of the tier is gone (``keys`` is empty)."""


@dataclass(frozen=True)
class KVEvent:
    kind: EventKind
    tier: Tier
    keys: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVEventBatch:
    """Events of one worker, in order; ``seq`` numbers the batches of that worker from 1."""

    worker_id: str
    seq: int
    events: tuple[KVEvent, ...]


@dataclass(frozen=True)
class KVSnapshot:
    """A worker's key sets per tier as of batch ``seq`` (0: before any batch)."""

    worker_id: str
    seq: int
    keys: Mapping[Tier, frozenset[int]]


class EventGap(Exception):
    """A batch is missing between what a consumer has and what it received: take a snapshot."""


@dataclass
class KeySets:
    """Key sets per tier, rebuilt from a snapshot and batches (what a consumer keeps)."""

    worker_id: str
    seq: int = 0
    keys: dict[Tier, set[int]] = field(default_factory=lambda: {t: set() for t in Tier})

    @classmethod
    def from_snapshot(cls, snapshot: KVSnapshot) -> KeySets:
        return cls(snapshot.worker_id, snapshot.seq, {t: set(snapshot.keys.get(t, ())) for t in Tier})

    def apply(self, batch: KVEventBatch) -> None:
        """Apply the next batch; EventGap if it is not ``seq + 1`` (an older one is ignored)."""
        if batch.worker_id != self.worker_id:
            raise ValueError(f"batch of worker {batch.worker_id!r} applied to the key sets of {self.worker_id!r}")
        if batch.seq <= self.seq:
            return
        if batch.seq != self.seq + 1:
            raise EventGap(f"worker {self.worker_id!r}: expected batch {self.seq + 1}, got {batch.seq}")
        for event in batch.events:
            keys = self.keys[event.tier]
            if event.kind is EventKind.STORED:
                keys.update(event.keys)
            elif event.kind is EventKind.REMOVED:
                keys.difference_update(event.keys)
            else:
                keys.clear()
        self.seq = batch.seq


class KVEventLog:
    """Collects a worker's events and seals them into numbered batches; keeps the latest
    ``retain`` batches for consumers that fell behind. Thread-safe."""

    def __init__(self, worker_id: str, retain: int = 1024) -> None:
        if retain < 1:
            raise ValueError(f"retain: must be >= 1, got {retain}")
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._pending: list[KVEvent] = []
        self._batches: deque[KVEventBatch] = deque(maxlen=retain)
        self._seq = 0

    def record(self, kind: EventKind, tier: Tier, keys: Iterable[int] = ()) -> None:
        """Add an event to the open batch; consecutive events of one kind and tier merge."""
        keys = tuple(keys)
        if kind is not EventKind.CLEARED and not keys:
            return
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if last is not None and last.kind is kind and last.tier is tier and kind is not EventKind.CLEARED:
                self._pending[-1] = KVEvent(kind, tier, last.keys + keys)
            else:
                self._pending.append(KVEvent(kind, tier, keys))

    def flush(self) -> KVEventBatch | None:
        """Seal the open events into the next batch (None if there were none)."""
        with self._lock:
            return self._flush_locked()

    def since(self, seq: int) -> list[KVEventBatch]:
        """Sealed batches after ``seq``, in order; EventGap if some of them are no longer kept."""
        with self._lock:
            if seq >= self._seq:
                return []
            oldest = self._batches[0].seq if self._batches else self._seq + 1
            if seq + 1 < oldest:
                raise EventGap(f"worker {self.worker_id!r}: batches {seq + 1}..{oldest - 1} are no longer kept")
            return [b for b in self._batches if b.seq > seq]

    def snapshot(self, keys: Mapping[Tier, Iterable[int]]) -> KVSnapshot:
        """Seal open events, then pair ``keys`` (the tiers' current sets, read by the caller
        while no event can be recorded) with the number of the batch they include."""
        with self._lock:
            self._flush_locked()
            return KVSnapshot(self.worker_id, self._seq, {t: frozenset(keys.get(t, ())) for t in Tier})

    @property
    def seq(self) -> int:
        """Number of the last sealed batch."""
        return self._seq

    def _flush_locked(self) -> KVEventBatch | None:
        if not self._pending:
            return None
        self._seq += 1
        batch = KVEventBatch(self.worker_id, self._seq, tuple(self._pending))
        self._pending = []
        self._batches.append(batch)
        return batch
