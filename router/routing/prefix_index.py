"""The global prefix index: which worker holds which block key in which tier, from KV events.

Each worker's events arrive as numbered batches (kv_store.events); the index applies them in
order and reports a gap (``EventGap``) so the caller fetches that worker's snapshot and goes on.
For a prompt's block keys it answers, per worker, the longest run of consecutive cached blocks
from the start, split by the tier each block would be served from (its own pool first, then its
CPU tier, then the Redis tier, which every worker shares)::

    keys      k0   k1   k2   k3   k4
    worker A  pool pool cpu  --            -> run 3: pool 2, cpu 1
    worker B  --   (k0 in Redis) ...       -> Redis counts for everyone: run from Redis

A ``KeyTable`` (numpy open addressing) maps each key to worker bitmasks, one per tier lane.
Up to 16 workers the four lanes share one uint64 (a lookup is memory-bound: a 16-byte slot
keeps the table small); past that each lane has 64 workers to a word (column ``word * 4 + lane``)::

    packed:  value = pool | cpu << 16 | redis_writers << 32 | remembered << 48
    words:   row = pool_mask, cpu_mask, redis_writers, remembered   (then the next 64 workers' four)

so a lookup is one vectorized probe of all of a prompt's keys and a numpy search for runs of
equal rows: Python only runs where the tier pattern changes, not per key (a 32k-token prompt
on 16-token blocks is 2,048 keys). A router may also ``remember`` where it just sent a prompt's
blocks, before any event says so; those count as pool blocks until ``forget_expired`` (the
table's ``times`` hold each key's end of memory, NaN when it has none). A routing step looks a
prompt's keys up once (``lookup``) for both: the ``Lookup`` it matches is the one it remembers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kv_store.events import EventGap, EventKind, KeySets, KVEventBatch, KVSnapshot, Tier
from router.routing.block_hashing import shared_prefix_length
from router.routing.key_table import KeyTable

_TIER_LANE = {Tier.POOL: 0, Tier.CPU: 1, Tier.REDIS: 2}
_REMEMBERED = 3
_LANES = 4
_WORD_BITS = 64
_PACKED_BITS = 16
"""Lane width while every worker fits in it: the four lanes are one uint64."""
_GROW_AT = 0.375
"""Share of the table's slots in use past which ``forget_expired`` grows it (``insert`` would at 1/2)."""
_NUM_RECENT_LOOKUPS = 256
"""Prompts (by first key) whose lookups a next turn starts from."""
UNKNOWN = -2
"""A ``Lookup`` slot not looked for."""


@dataclass(frozen=True)
class Lookup:
    """A prompt's keys and their table slots, found once for ``match`` and then ``remember``
    (at 2,048 keys a find is most of either); stale once the table has changed since."""

    keys: np.ndarray
    """uint64."""
    slots: np.ndarray
    """The table slot of each key, -1 where the table does not hold it, ``UNKNOWN`` where it
    was not looked for (only ever past a -1: no cached run reaches it)."""
    version: int
    """The table's version when they were found."""

    def __len__(self) -> int:
        return len(self.keys)

    def suffix(self, start: int) -> Lookup:
        """The keys from ``start`` on, with their slots."""
        return Lookup(self.keys[start:], self.slots[start:], self.version)


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
    """Per-worker key sets (for exact sequencing) and one ``key -> tier lanes of worker bits`` table."""

    def __init__(self, capacity: int = 131_072) -> None:
        """``capacity``: keys the table holds before it first grows (it grows as needed)."""
        self._sets: dict[str, KeySets] = {}
        self._bits: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._table = KeyTable(1, capacity, keep=_holds_something)
        self._packed = True
        """Lanes of ``_PACKED_BITS`` in one column, until a 17th worker bit is taken."""
        self._remember_order: deque[tuple[float, np.ndarray]] = deque()
        self._unsettled: deque[tuple[str, np.ndarray | Lookup, float]] = deque()
        """``remember`` calls not in the table yet: ``settle`` applies them."""
        self._recent: dict[int, Lookup] = {}
        """First key -> the latest lookup of a prompt that starts with it (oldest first)."""
        self._recent_rows_version = self._table.rows_version

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
        self.settle()
        sets = self._sets.pop(worker_id, None)
        if sets is None:
            return
        bit = self._bits.pop(worker_id)
        for tier, keys in sets.keys.items():
            self._drop(tier, keys, bit)
        column, flag = self._column(bit, _REMEMBERED)
        self._table.values[:, column] &= ~flag
        self._free_bits.append(bit)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply a worker's next batch; EventGap if one is missing (then ``load_snapshot``)."""
        self.settle()
        self.add_worker(batch.worker_id)
        sets = self._sets[batch.worker_id]
        if batch.seq <= sets.seq:
            return
        if batch.seq != sets.seq + 1:
            raise EventGap(f"worker {batch.worker_id!r}: expected batch {sets.seq + 1}, got {batch.seq}")
        bit = self._bits[batch.worker_id]
        for event in batch.events:
            keys = sets.keys[event.tier]
            if event.kind is EventKind.STORED:  # setting a bit that is set, or clearing one that is not, changes nothing
                keys.update(event.keys)
                self._add(event.tier, event.keys, bit)
            elif event.kind is EventKind.REMOVED:
                keys.difference_update(event.keys)
                self._drop(event.tier, event.keys, bit)
            else:
                self._drop(event.tier, keys, bit)
                keys.clear()
        sets.seq = batch.seq

    def load_snapshot(self, snapshot: KVSnapshot) -> None:
        """Replace a worker's key sets with a snapshot (after a gap, or when it joins)."""
        self.remove_worker(snapshot.worker_id)  # it settles first
        self.add_worker(snapshot.worker_id)
        bit = self._bits[snapshot.worker_id]
        fresh = KeySets.from_snapshot(snapshot)
        self._sets[snapshot.worker_id] = fresh
        for tier, keys in fresh.keys.items():
            self._add(tier, keys, bit)

    def lookup(self, keys: Sequence[int] | np.ndarray) -> Lookup:
        """Where the table holds ``keys``: pass it to ``match`` and ``remember`` instead of the keys.

        A session's next turn repeats its previous prompt's keys, and a held key keeps its slot
        until rows move, so the keys the latest lookup through the same first key found (or
        ``remember`` placed) keep their slots; only the others are looked for. And only as far
        as a cached run can reach: past the first key the table does not hold, none is looked
        for (a new conversation's 2,048 keys cost one probe); ``remember`` finds those."""
        self.settle()
        return self._lookup(keys)

    def _lookup(self, keys: Sequence[int] | np.ndarray) -> Lookup:
        """``lookup`` of the table as it is (``settle`` runs this, so it must not settle)."""
        keys = _key_array(keys).copy()  # kept for the next turn, and by ``remember``: no caller may change them
        table = self._table
        if self._recent_rows_version != table.rows_version:
            self._recent.clear()
            self._recent_rows_version = table.rows_version
        recent = self._recent.pop(int(keys[0]), None) if len(keys) else None
        if recent is None:
            slots = np.full(len(keys), UNKNOWN, dtype=np.int64)
        else:
            num_shared = shared_prefix_length(recent.keys, keys)
            slots = np.concatenate([recent.slots[:num_shared], np.full(len(keys) - num_shared, UNKNOWN, dtype=np.int64)])
        _find_up_to_a_miss(table, keys, slots, np.flatnonzero(slots < 0))
        found = Lookup(keys, slots, table.version)
        if len(keys):
            self._recent[int(keys[0])] = found
            if len(self._recent) > _NUM_RECENT_LOOKUPS:
                del self._recent[next(iter(self._recent))]
        return found

    def remember(self, worker_id: str, keys: Sequence[int] | np.ndarray | Lookup, until_s: float) -> None:
        """Count ``keys`` as in ``worker_id``'s pool until ``until_s`` (this router just sent them
        there; the KV events will say so later).

        Placing a new prompt's keys is most of a routing step (~300 us at 2,048 keys), and the
        request has no need of it: it only informs the next step. So the keys go into the table
        at ``settle``, which the router runs once the request is sent, and which every other
        method here runs first: nothing can see the index without them."""
        if not len(keys):
            return
        self.add_worker(worker_id)
        self._unsettled.append((worker_id, keys if isinstance(keys, Lookup) else _key_array(keys).copy(), until_s))

    @property
    def num_unsettled(self) -> int:
        """``remember`` calls whose keys are not in the table yet."""
        return len(self._unsettled)

    def settle(self) -> None:
        """Put the keys of every ``remember`` so far in the table (a no-op when there are none)."""
        while self._unsettled:
            self._remember_now(*self._unsettled.popleft())

    def _remember_now(self, worker_id: str, keys: np.ndarray | Lookup, until_s: float) -> None:
        found = self._current(keys)
        keys = found.keys  # a lookup's own copy: the order below may hold it
        unknown = np.flatnonzero(found.slots == UNKNOWN)
        found.slots[unknown] = self._table.find(keys[unknown])
        slots = self._table.insert(keys, found.slots)
        if self._table.rows_version == self._recent_rows_version:
            found.slots[:] = slots  # the recent lookup it belongs to learns where they went
        column, flag = self._column(self._bits[worker_id], _REMEMBERED)
        self._table.values[slots, column] |= flag
        self._table.times[slots] = until_s
        self._remember_order.append((until_s, keys))

    def forget_expired(self, now_s: float) -> None:
        """Drop remembered keys whose last ``remember`` ended by ``now_s``. It runs at load
        reports, off the requests' path: a table that fills up grows here first."""
        self.settle()
        order, table = self._remember_order, self._table
        if len(table) > _GROW_AT * table.capacity:
            table.compact()
        while order and order[0][0] <= now_s:
            slots = table.find(order.popleft()[1])
            slots = slots[slots >= 0]
            slots = slots[table.times[slots] <= now_s]
            if self._packed:
                table.values[slots, 0] &= np.uint64((1 << 3 * _PACKED_BITS) - 1)
            else:
                table.values[slots, _REMEMBERED :: _LANES] = 0
            table.times[slots] = np.nan

    def oldest_remembered_s(self) -> float | None:
        """When the oldest remembered keys expire (None: nothing remembered)."""
        self.settle()
        return self._remember_order[0][0] if self._remember_order else None

    def match(self, keys: Sequence[int] | np.ndarray | Lookup, workers: Iterable[str] | None = None) -> dict[str, CachedRun]:
        """Each worker's longest cached run of ``keys`` from the first, split by serving tier."""
        self.settle()
        names = list(self._sets) if workers is None else list(workers)
        known = [w for w in names if w in self._bits]  # a worker with no events yet holds nothing
        alive = 0
        for name in known:
            alive |= 1 << self._bits[name]
        counts = {name: [0, 0, 0] for name in names}
        runs = self._runs(keys) if alive and len(keys) else ()
        segment, length = None, 0
        for (pool, cpu, redis, remembered), num_keys in runs:
            in_pool = (pool | remembered) & alive
            in_cpu = cpu & alive & ~in_pool
            in_redis = alive & ~in_pool & ~in_cpu if redis else 0
            alive = in_pool | in_cpu | in_redis
            if not alive:
                break
            pattern = (in_pool, in_cpu, in_redis)
            if pattern != segment:
                self._credit(counts, known, segment, length)
                segment, length = pattern, 0
            length += num_keys
        self._credit(counts, known, segment, length)
        return {name: CachedRun(*c) if any(c) else _NO_RUN for name, c in counts.items()}

    def _current(self, keys: Sequence[int] | np.ndarray | Lookup) -> Lookup:
        """``keys`` found in the table as it is now (a Lookup found since it changed is kept)."""
        if isinstance(keys, Lookup) and keys.version == self._table.version:
            return keys
        return self._lookup(keys.keys if isinstance(keys, Lookup) else keys)

    def _runs(self, keys: Sequence[int] | np.ndarray | Lookup) -> list[tuple[tuple[int, int, int, int], int]]:
        """``((pool, cpu, redis, remembered) masks, count)`` for each run of equal rows of
        ``keys``, up to the first key no worker holds. Python steps once per run."""
        slots = self._current(keys).slots
        misses = np.flatnonzero(slots < 0)
        end = int(misses[0]) if len(misses) else len(slots)
        if end == 0:
            return []
        rows = self._table.values_at(slots[:end])
        if self._packed:
            return _packed_runs(rows[:, 0])
        nonzero = _any_per_row(rows != 0)
        if not nonzero.all():
            end = int(np.argmin(nonzero))
            if end == 0:
                return []
            rows = rows[:end]
        starts = [0, *(np.flatnonzero(_any_per_row(rows[1:] != rows[:-1])) + 1).tolist(), end]
        return [(_lanes(row), b - a) for row, a, b in zip(rows[starts[:-1]].tolist(), starts, starts[1:])]

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
        array = _key_array(keys)
        if len(array):
            slots = self._table.insert(array)  # before ``values`` is read: inserting may replace it
            column, flag = self._column(bit, _TIER_LANE[tier])
            self._table.values[slots, column] |= flag

    def _drop(self, tier: Tier, keys: Iterable[int], bit: int) -> None:
        array = _key_array(keys)
        if len(array):
            slots = self._table.find(array)
            column, flag = self._column(bit, _TIER_LANE[tier])
            self._table.values[slots[slots >= 0], column] &= ~flag

    def _take_bit(self) -> int:
        bit = self._next_bit
        self._next_bit += 1
        if self._packed and bit >= _PACKED_BITS:
            self._unpack_lanes()
        if not self._packed and bit >= _WORD_BITS * (self._table.values.shape[1] // _LANES):
            self._table.add_columns(_LANES)  # 64 more workers: one more word per lane
        return bit

    def _column(self, bit: int, lane: int) -> tuple[int, np.uint64]:
        """The table column and the flag within it of worker ``bit``'s ``lane``."""
        if self._packed:
            return 0, np.uint64(1 << (lane * _PACKED_BITS + bit))
        return bit // _WORD_BITS * _LANES + lane, np.uint64(1 << bit % _WORD_BITS)

    def _unpack_lanes(self) -> None:
        """A 17th worker: from one packed column to a word per lane."""
        self._table.add_columns(_LANES - 1)
        values = self._table.values
        packed = values[:, 0].copy()
        for lane in range(_LANES):
            values[:, lane] = packed >> np.uint64(lane * _PACKED_BITS) & np.uint64((1 << _PACKED_BITS) - 1)
        self._packed = False


_NO_RUN = CachedRun()


def _find_up_to_a_miss(table: KeyTable, keys: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> None:
    """``slots[positions] = table.find(keys[positions])`` (``positions`` ascending), except that
    when the first of them is not held, the rest stay ``UNKNOWN``: every run stops there."""
    if not len(positions):
        return
    first = slots[positions[0]] = table.find_one(int(keys[positions[0]]))
    if first >= 0 and len(positions) > 1:
        slots[positions[1:]] = table.find(keys[positions[1:]])


def _packed_runs(values: np.ndarray) -> list[tuple[tuple[int, int, int, int], int]]:
    """``_runs`` over packed rows (one uint64 each), up to the first that no worker holds:
    1-D arrays all through (a lookup's few numpy calls on memory it last touched a turn ago)."""
    empty = np.flatnonzero(values == 0)
    end = int(empty[0]) if len(empty) else len(values)
    values = values[:end]
    starts = [0, *(np.flatnonzero(values[1:] != values[:-1]) + 1).tolist(), end] if end else [0]
    return [(_unpack(value), b - a) for value, a, b in zip(values[starts[:-1]].tolist(), starts, starts[1:])]


def _unpack(value: int) -> tuple[int, int, int, int]:
    """A packed row's value as one Python int of worker bits per lane."""
    mask = (1 << _PACKED_BITS) - 1
    return value & mask, value >> _PACKED_BITS & mask, value >> 2 * _PACKED_BITS & mask, value >> 3 * _PACKED_BITS


def _lanes(row: list[int]) -> tuple[int, int, int, int]:
    """A table row (``word * 4 + lane`` columns) as one Python int of worker bits per lane."""
    if len(row) == _LANES:
        return tuple(row)
    return tuple(sum(word << _WORD_BITS * i for i, word in enumerate(row[lane::_LANES])) for lane in range(_LANES))


def _any_per_row(flags: np.ndarray) -> np.ndarray:
    """``flags.any(axis=1)`` for rows of 1 or 4 * words bools, the latter read as words of 4
    bytes: numpy's ``any`` over a short axis is several times slower."""
    if flags.shape[1] == 1:
        return flags[:, 0]
    words = np.ascontiguousarray(flags).view(np.uint32)
    return words[:, 0] != 0 if words.shape[1] == 1 else words.any(axis=1)


def _key_array(keys: Iterable[int]) -> np.ndarray:
    if isinstance(keys, np.ndarray):
        return keys.astype(np.uint64, copy=False)
    return np.fromiter(keys, dtype=np.uint64, count=len(keys)) if hasattr(keys, "__len__") else np.fromiter(keys, dtype=np.uint64)


def _holds_something(table: KeyTable) -> np.ndarray:
    """Rows a compaction keeps: those with a worker bit (a zeroed row is a key nobody holds)."""
    return table.values.any(axis=1)
