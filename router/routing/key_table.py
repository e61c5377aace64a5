"""A hash table of 64-bit keys held in numpy arrays, looked up and filled a whole prompt at a time.

The router asks about every block key of a prompt at once (2,048 keys at 32k tokens on 16-token
blocks). A dict answers one key per Python step, each a cache miss; this table answers them all
in a few vectorized passes of linear probing::

    home(key) = (key * 0x9E3779B97F4A7C15 mod 2^64) >> (64 - log2(capacity))    Fibonacci hashing
    probe home, home+1, ... until the key or an unused slot, 8 slots a step   all keys in step

    slots:  [0 ........ capacity) [overflow: _OVERFLOW) [always unused: 8) [the key 0's row]

Probes never wrap around: a path may run into the overflow slots, and one that would run past
them makes the table grow. An unused slot holds key 0; the key 0 itself has the last row.
Rows are never deleted one by one: a caller zeroes a row's values instead, and ``compact`` (run
when the table fills) drops the rows its ``keep`` test refuses while it re-inserts the rest. So a
key's probe path never has a hole in it, which is what makes lookups without tombstones correct.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_FIBONACCI = np.uint64(0x9E3779B97F4A7C15)
_FIBONACCI_INT = 0x9E3779B97F4A7C15
_U64_MASK = 2**64 - 1
_MAX_LOAD = 0.5
_WINDOW = 8
"""Slots a probe reads per step: a row of 8 bools reads as one uint64."""
_ONE = np.uint64(1)
_LITTLE_U64 = np.dtype("<u8")
_BYTE_INDICES = np.uint64(0x0001020304050607)
_TOP_BYTE = np.uint64(56)
_OVERFLOW = 256
"""Slots past the capacity that probe paths may run into before the table grows."""
_FEW_KEYS = 32
"""Up to this many keys, a probe loop in Python beats ~20 numpy calls' fixed cost."""


class KeyTable:
    """Keys (uint64) -> a row of ``num_columns`` uint64 values and one float64 ``times`` value.

    ``values`` and ``times`` are plain arrays indexed by the slots ``find``/``insert`` return;
    growing replaces them (and moves the rows), so a slot, and the arrays themselves, are valid
    only until the next ``insert``: insert first, then read ``values``."""

    def __init__(self, num_columns: int, capacity: int = 1024, keep: Callable[[KeyTable], np.ndarray] | None = None) -> None:
        if num_columns < 1:
            raise ValueError(f"num_columns: must be >= 1, got {num_columns}")
        self._keep = keep
        """Which rows survive a compaction (a bool per row, the key 0's row last); None: all used ones."""
        self.version = 0
        """Changes whenever a key is placed or rows move: a ``find`` made at another version is stale."""
        self.rows_version = 0
        """Changes whenever rows move (growth, compaction): until then a held key keeps its slot."""
        self._allocate(_power_of_two(capacity), num_columns)

    def __len__(self) -> int:
        return self.num_used

    @property
    def capacity(self) -> int:
        return self._capacity

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each of ``keys`` (uint64), or -1 where the table does not hold it.

        A key sits before the first unused slot of its probe path (slots never empty again), so
        the first slot of the path that holds the key or nothing answers. Most keys' home slot
        does; the others read the path 8 slots at a time."""
        keys = np.asarray(keys, dtype=np.uint64)
        if len(keys) <= _FEW_KEYS:
            return np.array([self.find_one(key) for key in keys.tolist()], dtype=np.int64)
        homes = self._home(keys)
        stored = self.keys[homes]
        result = np.where(stored == keys, homes, -1)
        pending = np.flatnonzero((result < 0) & (stored != 0))
        starts = homes[pending] + 1
        while len(pending) > _FEW_KEYS:
            column = self._first_stop(keys[pending], starts)
            decided = column >= 0
            slots = starts[decided] + column[decided]
            result[pending[decided]] = np.where(self.keys[slots] == keys[pending[decided]], slots, -1)
            onward = ~decided
            pending, starts = pending[onward], starts[onward] + _WINDOW
        if len(pending):
            result[pending] = [self.find_one(key) for key in keys[pending].tolist()]
        if not keys.all():  # the key 0 reads as an unused slot: it has a row of its own
            result[keys == 0] = self._zero_row if self._has_zero else -1
        return result

    def find_one(self, key: int) -> int:
        """``find`` of one key (a Python int), slot by slot: no numpy call."""
        if key == 0:
            return self._zero_row if self._has_zero else -1
        slot, column = self._home_of(key), self.keys
        while True:
            held = int(column[slot])
            if held == key:
                return slot
            if held == 0:
                return -1
            slot += 1

    def values_at(self, slots: np.ndarray) -> np.ndarray:
        """``values[slots]``, gathered from the contiguous rows (several times faster than
        indexing the ``values`` view)."""
        return np.take(self._rows, slots, axis=0)[:, 1:]

    def insert(self, keys: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """The slot of each of ``keys``, adding those not held yet (values 0, times NaN).
        ``slots``: what ``find`` said of ``keys`` at this ``version``, so it need not look again."""
        keys = np.asarray(keys, dtype=np.uint64)
        while True:
            slots = self.find(keys) if slots is None else slots.copy()
            missing = np.flatnonzero(slots < 0)
            if not len(missing):
                return slots
            if self.num_used + len(missing) <= _MAX_LOAD * self.capacity:
                placed = self._place(keys[missing])
                if placed is not None:
                    slots[missing] = placed
                    return slots
            self.compact(len(keys))  # it moves rows, and may drop some of ``keys``: look again
            slots = None

    def used_rows(self) -> np.ndarray:
        """A bool per row (the key 0's row last): which hold a key."""
        used = self.keys != 0
        used[-1] = self._has_zero
        return used

    def compact(self, room: int = 0) -> None:
        """Rebuild without the rows ``keep`` refuses, at a capacity that fits ``room`` more keys."""
        kept = self.used_rows() if self._keep is None else self.used_rows() & self._keep(self)
        keys, values, times = self.keys[kept], self.values[kept], self.times[kept]
        capacity = _power_of_two(2 * int((len(keys) + room) / _MAX_LOAD) + 1)  # a quarter full: it doubles before it fills again
        while True:
            self._allocate(capacity, self.values.shape[1])
            slots = self._place(keys)
            if slots is not None:
                break
            capacity *= 2  # a probe path ran past the overflow slots
        self.values[slots] = values
        self.times[slots] = times

    def add_columns(self, num_columns: int) -> None:
        """Widen every row by ``num_columns`` zero values (after the existing ones)."""
        self._set_rows(np.concatenate([self._rows, np.zeros((len(self._rows), num_columns), dtype=np.uint64)], axis=1))

    def _set_rows(self, rows: np.ndarray) -> None:
        """A slot's key and values side by side, so a lookup that reads the key has its values
        in the same cache line: at 2,048 keys a lookup is mostly waiting for memory."""
        self._rows = rows
        self.keys = rows[:, 0]
        self.values = rows[:, 1:]
        self._windows = np.lib.stride_tricks.sliding_window_view(self.keys[:-1], _WINDOW)
        """Row ``s``: the keys of slots ``s .. s+7`` (a view: it sees every write to ``keys``)."""

    def _allocate(self, capacity: int, num_columns: int) -> None:
        num_rows = capacity + _OVERFLOW + _WINDOW + 1
        self._set_rows(_touched_zeros((num_rows, 1 + num_columns), np.uint64))
        self.times = np.full(num_rows, np.nan)
        self._claims = _touched_zeros(num_rows, np.int64)
        self._capacity = capacity
        self._zero_row = num_rows - 1
        self._last_slot = capacity + _OVERFLOW - 1
        self._has_zero = False
        self.num_used = 0
        self._shift = np.uint64(64 - (capacity.bit_length() - 1))
        self._shift_int = int(self._shift)
        self.version += 1
        self.rows_version += 1

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _FIBONACCI) >> self._shift).astype(np.int64)

    def _place(self, keys: np.ndarray) -> np.ndarray | None:
        """Put ``keys`` (none held yet; repeats allowed) in the first unused slot of their paths
        and return their slots; None if a path ran past the overflow slots (grow, then again).
        Keys that race for one slot each write their claim; the last claim written takes it
        (and repeats of its key with it), the others look again from the same place."""
        self.version += 1
        if len(keys) <= _FEW_KEYS:
            return self._place_few(keys)
        result = np.full(len(keys), -1, dtype=np.int64)
        zero = keys == 0
        if zero.any():
            result[zero] = self._zero_row
            self.num_used += not self._has_zero
            self._has_zero = True
        pending = np.flatnonzero(~zero)
        starts = self._home(keys[pending])
        free = self.keys[starts] == 0  # most keys find their home slot unused: one plain gather
        done = self._claim(keys, pending[free], starts[free], result)
        retry = ~free
        retry[np.flatnonzero(free)[~done]] = True
        pending, starts = pending[retry], starts[retry]
        while len(pending) > _FEW_KEYS:
            free = _first_of_8(self._windows[starts] == 0)
            onward = free < 0
            claimed = starts[~onward] + free[~onward]
            if len(claimed) and claimed.max() > self._last_slot:
                return None
            done = self._claim(keys, pending[~onward], claimed, result)
            starts[onward] += _WINDOW
            retry = onward.copy()
            retry[np.flatnonzero(~onward)[~done]] = True
            pending, starts = pending[retry], starts[retry]
        if len(pending):
            placed = self._place_few(keys[pending])
            if placed is None:
                return None
            result[pending] = placed
        return result

    def _place_few(self, keys: np.ndarray) -> np.ndarray | None:
        """``_place`` slot by slot (a repeat of a key finds it placed)."""
        result, column = [], self.keys
        for key in keys.tolist():
            if key == 0:
                self.num_used += not self._has_zero
                self._has_zero = True
                result.append(self._zero_row)
                continue
            slot = self._home_of(key)
            while column[slot] != 0 and column[slot] != key:
                slot += 1
            if slot > self._last_slot:
                return None
            if column[slot] == 0:
                column[slot] = key
                self.num_used += 1
            result.append(slot)
        return np.array(result, dtype=np.int64)

    def _home_of(self, key: int) -> int:
        """``_home`` of one key (a Python int)."""
        return (key * _FIBONACCI_INT & _U64_MASK) >> self._shift_int

    def _first_stop(self, keys: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """For each key, the column of the first slot holding it or nothing in the window of 8
        slots from its start; -1 where the window holds neither."""
        windows = self._windows[starts]
        stops = windows == keys[:, None]
        stops |= windows == 0
        return _first_of_8(stops)

    def _claim(self, keys: np.ndarray, claimants: np.ndarray, claimed: np.ndarray, result: np.ndarray) -> np.ndarray:
        """Claimants (indices into ``keys``) each take their unused ``claimed`` slot; where
        several want one, the last claim written wins. Which claimants now hold their key."""
        self._claims[claimed] = claimants
        won = self._claims[claimed] == claimants
        self.keys[claimed[won]] = keys[claimants[won]]
        self.num_used += int(np.count_nonzero(won))
        done = self.keys[claimed] == keys[claimants]
        result[claimants[done]] = claimed[done]
        return done


def _first_of_8(flags: np.ndarray) -> np.ndarray:
    """The column of the first True of each row of an (n, 8) bool array; -1 where none.

    A row read as a little-endian uint64 has byte ``j`` set to 1 for each True column ``j``, so
    its lowest set bit is ``2^(8j)`` for the first; times ``0x0001020304050607`` (mod 2^64) that
    puts the byte ``j`` of the constant, which is ``j``, in the top byte (numpy's ``argmax`` or
    ``packbits`` over the short axis is several times slower)."""
    words = np.ascontiguousarray(flags).view(_LITTLE_U64)[:, 0]
    lowest = words & (~words + _ONE)
    columns = ((lowest * _BYTE_INDICES) >> _TOP_BYTE).astype(np.int64)
    columns[words == 0] = -1
    return columns


def _touched_zeros(shape, dtype) -> np.ndarray:
    """Zeros written now: ``np.zeros`` leaves a large array's pages unmapped until first written,
    and a routing step that writes them would pay a page fault per 4 KiB (~2 ms at 131k slots)."""
    array = np.empty(shape, dtype=dtype)
    array.fill(0)
    return array


def _power_of_two(n: int) -> int:
    return 1 << max(4, (max(1, n) - 1).bit_length())
