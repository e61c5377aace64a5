"""The global prefix index: which worker holds which block key in which tier, from KV events.

Each worker's events arrive as numbered batches (kv_store.events); the index applies them in
order and reports a gap (``EventGap``) so the caller fetches that worker's snapshot and goes on.
For a prompt's block keys it answers, per worker, the longest run of consecutive cached blocks
from the start, split by the tier each block would be served from (its own pool first, then its
CPU tier, then the Redis tier, which every worker shares)::

    keys      k0   k1   k2   k3   k4
    worker A  pool pool cpu  --            -> run 3: pool 2, cpu 1
    worker B  --   (k0 in Redis) ...       -> Redis counts for everyone: run from Redis

Key membership is kept as one bit per worker in ``key -> bitmask`` maps, so a lookup costs a
few dict reads per key plus work only where the tier pattern changes, not per worker per key.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kv_store.events import EventGap, EventKind, KeySets, KVEventBatch, KVSnapshot, Tier


@dataclass(frozen=True)
class CachedRun:
    """A worker's longest cached run from the start of a prompt, in blocks per tier."""

    pool: int = 0
    cpu: int = 0
    redis: int = 0

    @property
    def blocks(self) -> int:
        return self.pool + self.cpu + self.redis


class PrefixIndex:
    """Per-worker key sets (for exact sequencing) and per-tier ``key -> worker bitmask`` maps."""

    def __init__(self) -> None:
        self._sets: dict[str, KeySets] = {}
        self._bits: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._masks: dict[Tier, dict[int, int]] = {t: {} for t in Tier}

    @property
    def workers(self) -> list[str]:
        return list(self._sets)

    def seq(self, worker_id: str) -> int:
        """Number of the last batch applied for ``worker_id`` (0 before any)."""
        return self._sets[worker_id].seq

    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._sets:
            return
        bit = self._free_bits.pop() if self._free_bits else self._take_bit()
        self._bits[worker_id] = bit
        self._sets[worker_id] = KeySets(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that left (its Redis writes stay known through other workers only)."""
        sets = self._sets.pop(worker_id, None)
        if sets is None:
            return
        bit = self._bits.pop(worker_id)
        for tier, keys in sets.keys.items():
            self._drop(tier, keys, bit)
        self._free_bits.append(bit)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply a worker's next batch; EventGap if one is missing (then ``load_snapshot``)."""
        self.add_worker(batch.worker_id)
        sets = self._sets[batch.worker_id]
        if batch.seq <= sets.seq:
            return
        if batch.seq != sets.seq + 1:
            raise EventGap(f"worker {batch.worker_id!r}: expected batch {sets.seq + 1}, got {batch.seq}")
        bit = self._bits[batch.worker_id]
        for event in batch.events:
            keys = sets.keys[event.tier]
            if event.kind is EventKind.STORED:
                fresh = [k for k in event.keys if k not in keys]
                keys.update(fresh)
                self._add(event.tier, fresh, bit)
            elif event.kind is EventKind.REMOVED:
                gone = [k for k in event.keys if k in keys]
                keys.difference_update(gone)
                self._drop(event.tier, gone, bit)
            else:
                self._drop(event.tier, keys, bit)
                keys.clear()
        sets.seq = batch.seq

    def load_snapshot(self, snapshot: KVSnapshot) -> None:
        """Replace a worker's key sets with a snapshot (after a gap, or when it joins)."""
        self.remove_worker(snapshot.worker_id)
        self.add_worker(snapshot.worker_id)
        bit = self._bits[snapshot.worker_id]
        fresh = KeySets.from_snapshot(snapshot)
        self._sets[snapshot.worker_id] = fresh
        for tier, keys in fresh.keys.items():
            self._add(tier, keys, bit)

    def match(self, keys: Sequence[int], workers: Iterable[str] | None = None) -> dict[str, CachedRun]:
        """Each worker's longest cached run of ``keys`` from the first, split by serving tier."""
        names = list(self._sets) if workers is None else list(workers)
        known = [w for w in names if w in self._bits]  # a worker with no events yet holds nothing
        wanted = 0
        for name in known:
            wanted |= 1 << self._bits[name]
        counts = {name: [0, 0, 0] for name in names}
        pool, cpu, redis = (self._masks[t] for t in Tier)
        alive = wanted
        segment = None
        length = 0
        for key in keys:
            in_pool = pool.get(key, 0) & alive
            in_cpu = cpu.get(key, 0) & alive & ~in_pool
            in_redis = alive & ~in_pool & ~in_cpu if redis.get(key, 0) else 0
            pattern = (in_pool, in_cpu, in_redis)
            if pattern != segment:
                self._credit(counts, known, segment, length)
                segment, length = pattern, 0
            length += 1
            alive = in_pool | in_cpu | in_redis
            if not alive:
                break
        self._credit(counts, known, segment, length)
        return {name: CachedRun(*c) for name, c in counts.items()}

    def num_keys(self, worker_id: str, tier: Tier = Tier.POOL) -> int:
        sets = self._sets.get(worker_id)
        return len(sets.keys[tier]) if sets is not None else 0

    def _credit(self, counts, names, segment, length) -> None:
        if segment is None or length == 0:
            return
        for tier_index, mask in enumerate(segment):
            if mask:
                for name in names:
                    if mask >> self._bits[name] & 1:
                        counts[name][tier_index] += length

    def _add(self, tier: Tier, keys: Iterable[int], bit: int) -> None:
        masks = self._masks[tier]
        flag = 1 << bit
        for key in keys:
            masks[key] = masks.get(key, 0) | flag

    def _drop(self, tier: Tier, keys: Iterable[int], bit: int) -> None:
        masks = self._masks[tier]
        clear = ~(1 << bit)
        for key in keys:
            mask = masks.get(key, 0) & clear
            if mask:
                masks[key] = mask
            else:
                masks.pop(key, None)

    def _take_bit(self) -> int:
        bit = self._next_bit
        self._next_bit += 1
        return bit
