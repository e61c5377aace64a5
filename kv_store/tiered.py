"""One worker's KV tiers: the pool, the CPU tier below it, the cluster's Redis tier below that.

::

    pool (BlockPool + the engine's buffer)
      │ a cached block is evicted (reused for something else): copy it down first
      ▼
    CPU tier (CPUTier, LRU) ── its own LRU victim ──> Redis tier (async writer thread)

    lookup, for the blocks of a prompt the pool lacks: CPU tier, then Redis, the longest run of
    consecutive keys; hits are copied into fresh pool blocks and cached there.

Without a CPU tier, pool evictions go straight to Redis. Every change of a tier's key set is a
KV event in ``events``; a snapshot pairs the three key sets with the last event batch. The
engine thread calls everything here except the Redis writer's callback (events are thread-safe).

The bytes move through a ``BlockCopier`` chosen by the pool's device (``kv_store/block_copier.py``):
memcpys on this thread for a CPU pool, copies on a side stream for a GPU pool. The bookkeeping is
the same for both: a slot is waited for before it is read or reused (``CPUTier.before_reuse``),
the step's stream is fenced after every copy into or out of a pool block (evictions and loads
both happen while a step is scheduled, so the step that uses the block comes after the fence),
and ``synchronize`` waits for them all before a writer that is not the step's stream (NIXL).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kv_store.block_copier import BlockCopier, block_copier
from kv_store.block_pool import BlockPool
from kv_store.cpu_tier import CPUTier
from kv_store.events import EventKind, KVEventLog, KVSnapshot, Tier
from kv_store.redis_tier import RedisTier


@dataclass
class TierStats:
    """Counters of one tier as seen by lookups and spills."""

    num_hits: int = 0
    """Blocks served from this tier."""
    num_misses: int = 0
    """Lookups that asked this tier and stopped at a block it did not have."""
    num_bytes: int = 0
    """Bytes served from this tier."""
    num_evictions: int = 0
    """Blocks this tier dropped or passed down for space."""


@dataclass
class TieredStats:
    tiers: dict[Tier, TierStats] = field(default_factory=lambda: {t: TierStats() for t in Tier})


class TieredKVStore:
    """Spills pool evictions down the tiers, loads prefix hits back up, and records KV events."""

    def __init__(
        self,
        pool: BlockPool,
        buffer: torch.Tensor,
        events: KVEventLog,
        cpu: CPUTier | None = None,
        redis: RedisTier | None = None,
        copier: BlockCopier | None = None,
    ) -> None:
        """``buffer``: the pool's bytes, ``uint8 [num_blocks, block_bytes]`` on any device;
        ``copier``: moves blocks between it and ``cpu``'s buffer (by default the one for
        ``buffer``'s device, ``block_copier``)."""
        if buffer.dim() != 2 or buffer.shape[0] != pool.num_blocks or buffer.dtype != torch.uint8:
            raise ValueError(f"buffer: expected uint8 [{pool.num_blocks}, block_bytes], got {buffer.dtype} {list(buffer.shape)}")
        self.pool = pool
        self.buffer = buffer
        self.copier = copier if copier is not None else block_copier(buffer, cpu.buffer if cpu is not None else None)
        self.events = events
        self.cpu = cpu
        self.redis = redis
        self.stats = TieredStats()
        self._redis_keys: set[int] = set()
        self._redis_lock = threading.Lock()
        if cpu is not None:
            cpu.on_evict = self._spill_from_cpu
            cpu.before_reuse = self.copier.wait_slot
        if redis is not None:
            redis.on_stored = self._stored_in_redis
        pool.listener = self

    # -- BlockPool listener ------------------------------------------------------------------

    def on_store(self, key: int, block_id: int) -> None:
        self.events.record(EventKind.STORED, Tier.POOL, (key,))

    def on_evict(self, key: int, block_id: int) -> None:
        self.events.record(EventKind.REMOVED, Tier.POOL, (key,))
        self.stats.tiers[Tier.POOL].num_evictions += 1
        if self.cpu is not None:
            if key not in self.cpu:
                slot = self.cpu.claim(key)  # may spill the CPU tier's LRU block to Redis first
                self.copier.save(block_id, slot)
                self.copier.fence()  # the block is handed out next: the step that writes it waits for the copy
                self.events.record(EventKind.STORED, Tier.CPU, (key,))
            else:
                self.cpu.slot_of(key)  # refresh
        elif self.redis is not None:
            self._spill_to_redis(key, lambda: self.copier.block_bytes(block_id))

    def on_clear(self) -> None:
        self.events.record(EventKind.CLEARED, Tier.POOL)

    # -- lookups -------------------------------------------------------------------------------

    def count_pool_lookup(self, num_hits: int, num_wanted: int) -> None:
        stats = self.stats.tiers[Tier.POOL]
        stats.num_hits += num_hits
        stats.num_bytes += num_hits * self.buffer.shape[1]
        stats.num_misses += num_hits < num_wanted

    def load(self, keys: Sequence[int]) -> list[int]:
        """Bring the longest run of ``keys`` found in the CPU tier, then Redis, into fresh pool
        blocks; returns their ids (ref count 1, cached under their keys), possibly []."""
        if self.cpu is None and self.redis is None:
            return []
        cpu_keys: list[int] = []
        if self.cpu is not None:
            for key in keys:
                if self.cpu.get(key) is None:  # a hit becomes most recently used: spills take others
                    self.stats.tiers[Tier.CPU].num_misses += 1
                    break
                cpu_keys.append(key)
        redis_blocks = []
        rest = keys[len(cpu_keys) :]
        if self.redis is not None and rest:
            redis_blocks = self.redis.get_prefix(rest)
            if len(redis_blocks) < len(rest):
                self.stats.tiers[Tier.REDIS].num_misses += 1
                self._forget_redis(rest[len(redis_blocks)])
        wanted = len(cpu_keys) + len(redis_blocks)
        if wanted == 0:
            return []
        wanted = min(wanted, self.pool.num_free_blocks)
        block_ids = self.pool.allocate(wanted) if wanted else None
        if not block_ids:
            return []
        loaded: list[int] = []
        for i, block_id in enumerate(block_ids):
            if i < len(cpu_keys):
                key, tier = cpu_keys[i], Tier.CPU
                slot = self.cpu.slot_of(key)
                if slot is None:  # spilled while allocating (a CPU tier smaller than the run)
                    break
                self.copier.load(slot, block_id)
            else:
                key, tier = keys[i], Tier.REDIS
                self.copier.load_bytes(redis_blocks[i - len(cpu_keys)], block_id)
            self.pool.cache(block_id, key)
            stats = self.stats.tiers[tier]
            stats.num_hits += 1
            stats.num_bytes += self.buffer.shape[1]
            loaded.append(block_id)
        if loaded:
            self.copier.fence()  # the step that reads them waits for the copies
        unused = block_ids[len(loaded) :]
        if unused:
            self.pool.release(reversed(unused))
        return loaded

    # -- spills --------------------------------------------------------------------------------

    def _spill_from_cpu(self, key: int, block: torch.Tensor) -> None:
        self.events.record(EventKind.REMOVED, Tier.CPU, (key,))
        self.stats.tiers[Tier.CPU].num_evictions += 1
        if self.redis is not None:  # the slot's copy has landed (CPUTier.before_reuse)
            self._spill_to_redis(key, lambda: block.numpy().tobytes())  # a copy: the slot is reused next

    def _spill_to_redis(self, key: int, read: Callable[[], bytes]) -> None:
        """Queue the block's bytes, ``read()``, for Redis unless this worker has stored ``key`` there."""
        with self._redis_lock:
            if key in self._redis_keys:
                return
        self.redis.put_async(key, read())

    def _stored_in_redis(self, keys: list[int]) -> None:
        with self._redis_lock:
            fresh = [k for k in keys if k not in self._redis_keys]
            self._redis_keys.update(fresh)
            # recorded under the lock so that a snapshot never sees the key without its event
            self.events.record(EventKind.STORED, Tier.REDIS, fresh)

    def _forget_redis(self, key: int) -> None:
        """Redis no longer has ``key`` (TTL, eviction, corruption): it leaves this worker's view."""
        with self._redis_lock:
            if key in self._redis_keys:
                self._redis_keys.discard(key)
                self.events.record(EventKind.REMOVED, Tier.REDIS, (key,))

    # -- state ---------------------------------------------------------------------------------

    def snapshot(self) -> KVSnapshot:
        """The three key sets with the number of the last event batch they include (engine thread)."""
        with self._redis_lock:
            return self.events.snapshot({
                Tier.POOL: self.pool.cached_keys(),
                Tier.CPU: self.cpu.keys() if self.cpu is not None else (),
                Tier.REDIS: set(self._redis_keys),
            })

    def key_sets(self) -> dict[Tier, set[int]]:
        with self._redis_lock:
            return {
                Tier.POOL: set(self.pool.cached_keys()),
                Tier.CPU: set(self.cpu.keys()) if self.cpu is not None else set(),
                Tier.REDIS: set(self._redis_keys),
            }

    def evict_pool(self) -> int:
        """Push every cached, unused pool block down to the lower tiers; returns how many."""
        return self.pool.evict_cached()

    def synchronize(self) -> None:
        """Wait until every copy into or out of the pool has landed: call it before a writer that
        is not the engine's stream (a NIXL peer) may write blocks allocated since the last call."""
        self.copier.synchronize()

    def close(self) -> None:
        self.copier.synchronize()
        if self.redis is not None:
            self.redis.close()
