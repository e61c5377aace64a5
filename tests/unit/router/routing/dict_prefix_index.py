"""The prefix index as it was before its table moved to numpy (router.routing.key_table): one dict of
``key -> int`` entries, lanes of 8 bits widened as workers join. Kept verbatim as the reference
that tests/unit/router/routing/test_key_table.py checks the new index against, answer for answer."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import compress, count, islice, repeat
from operator import ne, or_

import numpy as np

from kv_store.events import EventGap, EventKind, KeySets, KVEventBatch, KVSnapshot, Tier
from router.routing.prefix_index import CachedRun

_TIER_LANE = {Tier.POOL: 0, Tier.CPU: 1, Tier.REDIS: 2}


class DictPrefixIndex:
    """Per-worker key sets (for exact sequencing) and one ``key -> tier lanes of worker bits`` map."""

    def __init__(self) -> None:
        self._sets: dict[str, KeySets] = {}
        self._bits: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._lane_bits = 8
        """Bits per tier lane, widened as workers join: an entry stays a small int while it can."""
        self._entries: dict[int, int] = {}
        self._remembered_until: dict[int, float] = {}
        self._remember_order: deque[tuple[float, tuple[int, ...]]] = deque()

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
        for key, mask in self._remembered().items():
            self._set_remembered(key, mask & ~(1 << bit))
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

    def remember(self, worker_id: str, keys: Sequence[int], until_s: float) -> None:
        """Count ``keys`` as in ``worker_id``'s pool until ``until_s`` (this router just sent them
        there; the KV events will say so later)."""
        if not keys:
            return
        self.add_worker(worker_id)
        flag = 1 << self._bits[worker_id]
        entries = self._entries
        lane_flag = flag << 3 * self._lane_bits
        entries.update(zip(keys, map(or_, map(entries.get, keys, repeat(0)), repeat(lane_flag))))
        self._remembered_until.update(zip(keys, repeat(until_s)))
        self._remember_order.append((until_s, tuple(keys)))

    def forget_expired(self, now_s: float) -> None:
        """Drop remembered keys whose last ``remember`` ended by ``now_s``."""
        order, until = self._remember_order, self._remembered_until
        while order and order[0][0] <= now_s:
            for key in order.popleft()[1]:
                last = until.get(key)
                if last is not None and last <= now_s:
                    del until[key]
                    self._set_remembered(key, 0)

    def oldest_remembered_s(self) -> float | None:
        """When the oldest remembered keys expire (None: nothing remembered)."""
        return self._remember_order[0][0] if self._remember_order else None

    def match(self, keys: Sequence[int], workers: Iterable[str] | None = None) -> dict[str, CachedRun]:
        """Each worker's longest cached run of ``keys`` from the first, split by serving tier."""
        names = list(self._sets) if workers is None else list(workers)
        known = [w for w in names if w in self._bits]  # a worker with no events yet holds nothing
        alive = 0
        for name in known:
            alive |= 1 << self._bits[name]
        counts = {name: [0, 0, 0] for name in names}
        lane = self._lane_bits
        runs = self._runs(keys) if alive else ()
        segment, length = None, 0
        for value, num_keys in runs:
            in_pool = (value | value >> 3 * lane) & alive
            in_cpu = value >> lane & alive & ~in_pool
            in_redis = alive & ~in_pool & ~in_cpu if value >> 2 * lane & ((1 << lane) - 1) else 0
            alive = in_pool | in_cpu | in_redis
            if not alive:
                break
            pattern = (in_pool, in_cpu, in_redis)
            if pattern != segment:
                self._credit(counts, known, segment, length)
                segment, length = pattern, 0
            length += num_keys
        self._credit(counts, known, segment, length)
        return {name: CachedRun(*c) for name, c in counts.items()}

    def _runs(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """``(entry, count)`` for each run of equal entries of ``keys``, up to the first key no
        worker holds. Up to 15 workers an entry fits an int64 and numpy finds the run starts;
        beyond (lanes of 30 bits and more), C-level ``map``/``compress`` over the list does. Python steps once per run."""
        values = map(self._entries.get, keys, repeat(0))
        if 4 * self._lane_bits <= 63:
            array = np.fromiter(values, dtype=np.int64, count=len(keys))
            zeros = np.flatnonzero(array == 0)
            end = int(zeros[0]) if len(zeros) else len(array)
            if end == 0:
                return []
            starts = [0, *(np.flatnonzero(array[1:end] != array[: end - 1]) + 1).tolist(), end]
            return [(int(array[a]), b - a) for a, b in zip(starts, starts[1:]) if b > a]
        values = list(values)
        try:
            end = values.index(0)
        except ValueError:
            end = len(values)
        starts = [0, *compress(count(1), map(ne, islice(values, 1, end), values)), end]
        return [(values[a], b - a) for a, b in zip(starts, starts[1:]) if b > a]

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
        entries = self._entries
        flag = 1 << (bit + _TIER_LANE[tier] * self._lane_bits)
        for key in keys:
            entries[key] = entries.get(key, 0) | flag

    def _drop(self, tier: Tier, keys: Iterable[int], bit: int) -> None:
        entries = self._entries
        clear = ~(1 << (bit + _TIER_LANE[tier] * self._lane_bits))
        for key in keys:
            mask = entries.get(key, 0) & clear
            if mask:
                entries[key] = mask
            else:
                entries.pop(key, None)

    def _remembered(self) -> dict[int, int]:
        """Key -> the remembered lane's worker bits, for every key that has some."""
        shift, lane = 3 * self._lane_bits, (1 << self._lane_bits) - 1
        return {key: value >> shift & lane for key, value in self._entries.items() if value >> shift & lane}

    def _set_remembered(self, key: int, mask: int) -> None:
        """Write ``mask`` into the remembered lane of ``key``'s entry."""
        shift = 3 * self._lane_bits
        value = self._entries.get(key, 0) & ~(((1 << self._lane_bits) - 1) << shift) | mask << shift
        if value:
            self._entries[key] = value
        else:
            self._entries.pop(key, None)

    def _take_bit(self) -> int:
        bit = self._next_bit
        self._next_bit += 1
        if bit >= self._lane_bits:
            self._widen_lanes()
        return bit

    def _widen_lanes(self) -> None:
        """More workers than a lane has bits: widen the lanes (to 15 bits first, the most that
        keeps an entry in an int64) and re-encode every key."""
        remembered = self._remembered()
        self._lane_bits = 15 if self._lane_bits < 15 else self._lane_bits * 2
        self._entries = {}
        for worker_id, sets in self._sets.items():
            for tier, keys in sets.keys.items():
                self._add(tier, keys, self._bits[worker_id])
        for key, mask in remembered.items():
            self._set_remembered(key, mask)
