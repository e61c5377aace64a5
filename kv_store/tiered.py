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

A replica of several ranks (tensor-parallel: each rank holds some KV heads of every block) has
one store, on its leader, that decides; each rank moves its own slice. The leader's ``mirror``
(``RankMirror``) records every move for the other ranks, which make the same moves on their own
slices, CPU tiers (the same slots) and Redis values (one per KV head, ``RedisTier``)::

    leader:   evict ── save(block, slot) ──► mirror ─ sent before the next step ─► rank r: the same
    leader:   load ─── load(slot, block) ──► mirror ─ sent now; every rank reports how many of the
                                                      loads it completed; the blocks past the
                                                      fewest are released, never used half-loaded

A block is in Redis (its STORED event) only once every KV head's value is (``RedisTier``).

A data-parallel replica (expert-parallel decode: each rank holds whole blocks of its own
requests, in a pool of its own) has one store per rank on its leader (kv_store/data_parallel.py).
Rank r's store keeps the bookkeeping of rank r's pool and CPU tier; its ``buffer`` is a ``meta``
tensor, since the bytes are rank r's, and every move goes through its mirror to rank r alone,
which writes its spills to Redis itself (the leader ``expect``s them there before they count).

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
from typing import Protocol

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


class RankMirror(Protocol):
    """The other ranks of a multi-rank replica, as the leader's store drives them: each call
    records a move each rank makes on its own slice, in the order made here."""

    def save(self, block_id: int, slot: int) -> None:
        """Copy the pool block into the CPU tier's slot."""

    def load(self, slot: int, block_id: int) -> None:
        """Copy the CPU tier's slot into the pool block."""

    def spill_block(self, key: int, block_id: int) -> None:
        """Write the pool block's slice to Redis under ``key``."""

    def spill_slot(self, key: int, slot: int) -> None:
        """Write the CPU tier slot's slice to Redis under ``key`` (before the slot is reused)."""

    def load_redis(self, key: int, block_id: int) -> None:
        """Read ``key``'s slice from Redis into the pool block."""

    def agree(self, num_loaded: int) -> int:
        """Send the moves recorded; every rank makes them and reports how many of the loads among
        them it completed, in order; returns the fewest (``num_loaded`` is the leader's)."""

    def flush(self, wait: bool) -> None:
        """Send the moves recorded; ``wait``: until every rank has made them."""


class RedisKeys:
    """The blocks a replica knows Redis holds (every KV head of them), with their events: one per
    replica, shared by its ranks' stores (Redis is one for all of them). Thread-safe: the Redis
    writer reports stored blocks from its thread."""

    def __init__(self, events: KVEventLog) -> None:
        self.events = events
        self.lock = threading.Lock()
        """Held while the key set changes with its event, and for a snapshot of it."""
        self._keys: set[int] = set()

    def __contains__(self, key: int) -> bool:
        with self.lock:
            return key in self._keys

    def keys(self) -> set[int]:
        """A copy of the key set (take ``lock`` to pair it with other state)."""
        return set(self._keys)

    def stored(self, keys: list[int]) -> None:
        """Every head of ``keys`` is in Redis (``RedisTier.on_stored``)."""
        with self.lock:
            fresh = [k for k in keys if k not in self._keys]
            self._keys.update(fresh)
            # recorded under the lock so that a snapshot never sees the key without its event
            self.events.record(EventKind.STORED, Tier.REDIS, fresh)

    def forget(self, key: int) -> None:
        """Redis no longer has ``key`` (TTL, eviction, corruption): it leaves the replica's view."""
        with self.lock:
            if key in self._keys:
                self._keys.discard(key)
                self.events.record(EventKind.REMOVED, Tier.REDIS, (key,))


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
        mirror: RankMirror | None = None,
        redis_keys: RedisKeys | None = None,
    ) -> None:
        """``buffer``: the pool's bytes, ``uint8 [num_blocks, block_bytes]`` on any device, or on
        ``meta`` when they are another rank's (then ``cpu`` keeps only bookkeeping and ``mirror``,
        rank r's alone, makes every move); ``copier``: moves blocks between it and ``cpu``'s
        buffer (by default the one for ``buffer``'s device, ``block_copier``); ``mirror``: the
        replica's other ranks, each holding its own slice of every block (None: one rank);
        ``redis_keys``: the replica's view of Redis, when several stores share it."""
        if buffer.dim() != 2 or buffer.shape[0] != pool.num_blocks or buffer.dtype != torch.uint8:
            raise ValueError(f"buffer: expected uint8 [{pool.num_blocks}, block_bytes], got {buffer.dtype} {list(buffer.shape)}")
        self.local = buffer.device.type != "meta"
        """Whether this process holds the pool's bytes (else only its bookkeeping, for another rank)."""
        if not self.local and mirror is None and (cpu is not None or redis is not None):
            raise ValueError("mirror: a store of another rank's pool (a meta buffer) moves its blocks through that rank's mirror")
        if cpu is not None and (cpu.buffer.device.type == "meta") == self.local:
            raise ValueError("cpu: a CPU tier holds its bytes exactly when the pool's are here (both on meta, or neither)")
        self.pool = pool
        self.buffer = buffer
        self.block_bytes = buffer.shape[1]
        self.copier = None
        if self.local:
            self.copier = copier if copier is not None else block_copier(buffer, cpu.buffer if cpu is not None else None)
        self.events = events
        self.cpu = cpu
        self.redis = redis
        self.mirror = mirror
        self.stats = TieredStats()
        self.redis_keys = redis_keys if redis_keys is not None else RedisKeys(events)
        if cpu is not None:
            cpu.on_evict_slot = self._spill_from_cpu
            cpu.before_reuse = self.copier.wait_slot if self.copier is not None else None
        if redis is not None:
            redis.on_stored = self.redis_keys.stored
        pool.listener = self

    def for_rank(self, rank: int) -> TieredKVStore:
        """The store of data-parallel rank ``rank``'s pool: this one, the only one."""
        if rank != 0:
            raise ValueError(f"rank: a replica of one KV pool has rank 0 only, got {rank}")
        return self

    # -- BlockPool listener ------------------------------------------------------------------

    def on_store(self, key: int, block_id: int) -> None:
        self.events.record(EventKind.STORED, Tier.POOL, (key,))

    def on_evict(self, key: int, block_id: int) -> None:
        self.events.record(EventKind.REMOVED, Tier.POOL, (key,))
        self.stats.tiers[Tier.POOL].num_evictions += 1
        if self.cpu is not None:
            if key not in self.cpu:
                slot = self.cpu.claim(key)  # may spill the CPU tier's LRU block to Redis first
                if self.copier is not None:
                    self.copier.save(block_id, slot)
                    self.copier.fence()  # the block is handed out next: the step that writes it waits for the copy
                if self.mirror is not None:
                    self.mirror.save(block_id, slot)
                self.events.record(EventKind.STORED, Tier.CPU, (key,))
            else:
                self.cpu.slot_of(key)  # refresh
        elif self.redis is not None:
            mirror = self.mirror
            self._spill_to_redis(key, lambda: self.copier.block_bytes(block_id), mirror and (lambda: mirror.spill_block(key, block_id)))

    def flush_moves(self) -> None:
        """Send the other ranks the moves recorded since the last step (before the next step
        overwrites the blocks they saved)."""
        if self.mirror is not None:
            self.mirror.flush(wait=False)

    def on_clear(self) -> None:
        self.events.record(EventKind.CLEARED, Tier.POOL)

    # -- lookups -------------------------------------------------------------------------------

    def count_pool_lookup(self, num_hits: int, num_wanted: int) -> None:
        stats = self.stats.tiers[Tier.POOL]
        stats.num_hits += num_hits
        stats.num_bytes += num_hits * self.block_bytes
        stats.num_misses += num_hits < num_wanted

    def load(self, keys: Sequence[int]) -> list[int]:
        """Bring the longest run of ``keys`` found in the CPU tier, then Redis, into fresh pool
        blocks; returns their ids (ref count 1, cached under their keys), possibly []. On a
        replica of several ranks, a block counts only when every rank loaded its slice."""
        if self.cpu is None and self.redis is None:
            return []
        cpu_keys: list[int] = []
        if self.cpu is not None:
            for key in keys:
                if self.cpu.slot_of(key) is None:  # a hit becomes most recently used: spills take others
                    self.stats.tiers[Tier.CPU].num_misses += 1
                    break
                cpu_keys.append(key)
        redis_blocks = []
        rest = keys[len(cpu_keys) :]
        if self.redis is not None and rest:
            if self.mirror is not None:  # only keys whose every KV head is there: another rank's slice may be gone
                rest = rest[: self.redis.count_prefix(rest)]
            if self.local:
                redis_blocks = self.redis.get_prefix(rest) if rest else []
            else:  # rank r reads them itself; what it cannot read is a miss (agree, below)
                redis_blocks = [None] * len(rest)
            if len(redis_blocks) < len(keys) - len(cpu_keys):
                self.stats.tiers[Tier.REDIS].num_misses += 1
                self.redis_keys.forget(keys[len(cpu_keys) + len(redis_blocks)])
        wanted = len(cpu_keys) + len(redis_blocks)
        if wanted == 0:
            return []
        wanted = min(wanted, self.pool.num_free_blocks)
        block_ids = self.pool.allocate(wanted) if wanted else None
        if not block_ids:
            return []
        loaded: list[tuple[int, int, Tier]] = []
        for i, block_id in enumerate(block_ids):
            if i < len(cpu_keys):
                key, tier = cpu_keys[i], Tier.CPU
                slot = self.cpu.slot_of(key)
                if slot is None:  # spilled while allocating (a CPU tier smaller than the run)
                    break
                if self.copier is not None:
                    self.copier.load(slot, block_id)
                if self.mirror is not None:
                    self.mirror.load(slot, block_id)
            else:
                key, tier = keys[i], Tier.REDIS
                if self.copier is not None:
                    self.copier.load_bytes(redis_blocks[i - len(cpu_keys)], block_id)
                if self.mirror is not None:
                    self.mirror.load_redis(key, block_id)
            loaded.append((block_id, key, tier))
        if self.mirror is not None:
            num_agreed = self.mirror.agree(len(loaded))
            if num_agreed < len(loaded):
                self.stats.tiers[loaded[num_agreed][2]].num_misses += 1
                if loaded[num_agreed][2] is Tier.REDIS:
                    self.redis_keys.forget(loaded[num_agreed][1])
                loaded = loaded[:num_agreed]
        for block_id, key, tier in loaded:
            self.pool.cache(block_id, key)
            stats = self.stats.tiers[tier]
            stats.num_hits += 1
            stats.num_bytes += self.block_bytes
        if loaded and self.copier is not None:
            self.copier.fence()  # the step that reads them waits for the copies
        unused = block_ids[len(loaded) :]
        if unused:
            self.pool.release(reversed(unused))
        return [block_id for block_id, _, _ in loaded]

    # -- spills --------------------------------------------------------------------------------

    def _spill_from_cpu(self, key: int, slot: int) -> None:
        self.events.record(EventKind.REMOVED, Tier.CPU, (key,))
        self.stats.tiers[Tier.CPU].num_evictions += 1
        if self.redis is not None:  # the slot's copy has landed (CPUTier.before_reuse)
            block = self.cpu.buffer[slot]
            mirror = self.mirror
            self._spill_to_redis(key, lambda: block.numpy().tobytes(), mirror and (lambda: mirror.spill_slot(key, slot)))  # a copy: the slot is reused next

    def _spill_to_redis(self, key: int, read: Callable[[], bytes], mirrored: Callable[[], None] | None = None) -> None:
        """Queue the block's bytes, ``read()``, for Redis unless this replica has stored ``key``
        there; ``mirrored()`` has the other ranks queue their slices too. For another rank's
        pool, that rank writes the block and this process waits for it in Redis."""
        if key in self.redis_keys:
            return
        if self.local:
            self.redis.put_async(key, read())
        if mirrored is not None:
            mirrored()
        if not self.local:
            self.redis.expect([key])

    # -- state ---------------------------------------------------------------------------------

    def snapshot(self) -> KVSnapshot:
        """The three key sets with the number of the last event batch they include (engine thread)."""
        with self.redis_keys.lock:
            return self.events.snapshot({
                Tier.POOL: self.pool.cached_keys(),
                Tier.CPU: self.cpu.keys() if self.cpu is not None else (),
                Tier.REDIS: self.redis_keys.keys(),
            })

    def key_sets(self) -> dict[Tier, set[int]]:
        with self.redis_keys.lock:
            return {
                Tier.POOL: set(self.pool.cached_keys()),
                Tier.CPU: set(self.cpu.keys()) if self.cpu is not None else set(),
                Tier.REDIS: self.redis_keys.keys(),
            }

    def evict_pool(self) -> int:
        """Push every cached, unused pool block down to the lower tiers; returns how many."""
        num_evicted = self.pool.evict_cached()
        if self.mirror is not None:
            self.mirror.flush(wait=True)
        return num_evicted

    def synchronize(self) -> None:
        """Wait until every copy into or out of the pool has landed, on every rank: call it
        before a writer that is not the engine's stream (a NIXL peer) may write blocks
        allocated since the last call."""
        if self.copier is not None:
            self.copier.synchronize()
        if self.mirror is not None:
            self.mirror.flush(wait=True)

    def close(self, close_redis: bool = True) -> None:
        """Let the copies land; ``close_redis``: stop the Redis tier too (False when the replica's
        other stores share it)."""
        if self.copier is not None:
            self.copier.synchronize()
        if self.redis is not None and close_redis:
            self.redis.close()
