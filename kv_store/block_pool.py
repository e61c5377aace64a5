"""Block ids, reference counts and the prefix cache of one KV pool.

The pool knows nothing about tensors: block ``i`` is row ``i`` of whatever buffer the caller
owns. Free blocks wait in an LRU queue; a free block keeps its key (and stays findable by
``match_prefix``) until ``allocate`` hands it out again, which is when its key is evicted::

    free queue (LRU first)  ->  [ 7 | 3(key a) | 9(key b) | 0 | ... ]  <- release() appends here
                                  ^ allocate() pops here, evicting keys as it goes

A block with ref_count > 0 is never in the free queue.

A ``listener`` hears every change to the set of cached keys, synchronously: ``on_store(key,
block_id)`` after a key is cached, ``on_evict(key, block_id)`` when a cached block is about to be
handed out again (its bytes are still intact: the time to copy them to a lower tier), and
``on_clear()`` when every key is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol


class PoolListener(Protocol):
    def on_store(self, key: int, block_id: int) -> None: ...
    def on_evict(self, key: int, block_id: int) -> None: ...
    def on_clear(self) -> None: ...


class BlockPool:
    """A fixed set of ``num_blocks`` block ids with ref counts and a key -> block prefix cache."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._block_keys: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.listener: PoolListener | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds, cached or not: what ``allocate`` can hand out."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_key(self, block_id: int) -> int | None:
        return self._block_keys[block_id]

    def match_prefix(self, keys: Sequence[int]) -> list[int]:
        """Block ids of the longest prefix of ``keys`` that is cached; changes no ref count."""
        hits: list[int] = []
        if not self.enable_caching:
            return hits
        for key in keys:
            block_id = self._cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a cache hit being shared)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` fresh blocks with ref_count 1, or None (nothing taken) if too few are free."""
        if num_blocks > len(self._free):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in this order.

        Pass a sequence's blocks tail first, so that its shared prefix is evicted last.
        """
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            assert count > 0, f"block {block_id} released more often than taken"
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def cache(self, block_id: int, key: int) -> None:
        """Make a full, written block findable under ``key``; a key already cached keeps its block."""
        if not self.enable_caching or key in self._cached or self._block_keys[block_id] is not None:
            return
        self._cached[key] = block_id
        self._block_keys[block_id] = key
        if self.listener is not None:
            self.listener.on_store(key, block_id)

    def cached_keys(self) -> list[int]:
        return list(self._cached)

    def evict_cached(self) -> int:
        """Evict every cached block no sequence holds (to the lower tiers, through the listener);
        returns how many. The blocks stay free."""
        evicted = 0
        for block_id in list(self._free):
            if self._block_keys[block_id] is not None:
                self._evict(block_id)
                evicted += 1
        return evicted

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (blocks in use keep their contents, only lookups stop)."""
        self._cached.clear()
        self._block_keys = [None] * self.num_blocks
        if self.listener is not None:
            self.listener.on_clear()

    def _evict(self, block_id: int) -> None:
        key = self._block_keys[block_id]
        if key is not None:
            if self.listener is not None:
                self.listener.on_evict(key, block_id)
            self._block_keys[block_id] = None
            del self._cached[key]
