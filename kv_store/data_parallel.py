"""The KV tiers of a data-parallel replica: one store per rank, one set of events for the replica.

An expert-parallel decode replica runs attention data-parallel: each rank holds whole blocks (every
KV head) of its own requests, in a pool of its own, and so has a CPU tier of its own. Its leader
schedules every rank, so it keeps every rank's bookkeeping, one ``TieredKVStore`` per rank; rank
r > 0's store holds no bytes (a ``meta`` buffer) and sends its moves to rank r alone, which makes
them on its own pool, CPU tier and Redis connection (engine/parallel/tier_mirror.py)::

    leader                                        rank r
    ──────                                        ──────
    stores[0]: pool 0, CPU tier 0, bytes here
    stores[r]: pool r's and CPU tier r's keys ──► TierMoves(rank=r) ► save / load / spill its blocks
               Redis: count_prefix, expect   ◄── Redis (one for the cluster) ◄── put its blocks

Redis is one key space for the whole cluster and a block's values do not depend on which rank
wrote them, so a rank loads what any rank (or replica) spilled; ``RedisKeys`` is the replica's
one view of it. The router scores a replica by the union of its ranks' key sets: a key is STORED
in a tier when the first rank holds it there and REMOVED when the last one drops it
(``EventUnion``), so the events still replay to the key sets the snapshot gives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kv_store.events import EventKind, KVEventLog, KVSnapshot, Tier
from kv_store.redis_tier import RedisTier
from kv_store.tiered import RedisKeys, TieredKVStore, TieredStats


class EventUnion:
    """The event log of a replica whose ranks hold keys each (``rank(r).record``); the log sees
    the union: STORED on a key's first holder, REMOVED when its last holder drops it."""

    def __init__(self, log: KVEventLog, num_ranks: int) -> None:
        self.log = log
        self._held: list[dict[Tier, set[int]]] = [{tier: set() for tier in Tier} for _ in range(num_ranks)]
        self._lock = threading.Lock()

    def rank(self, rank: int) -> RankEvents:
        """What rank ``rank``'s store records its events into."""
        if not 0 <= rank < len(self._held):
            raise ValueError(f"rank: must be in [0, {len(self._held)}), got {rank}")
        return RankEvents(self, rank)

    def record(self, rank: int, kind: EventKind, tier: Tier, keys: Iterable[int]) -> None:
        with self._lock:
            mine = self._held[rank][tier]
            if kind is EventKind.STORED:
                fresh = [k for k in keys if k not in mine]
                mine.update(fresh)
                changed = [k for k in fresh if not self._held_elsewhere(rank, tier, k)]
            elif kind is EventKind.REMOVED:
                gone = [k for k in keys if k in mine]
                mine.difference_update(gone)
                changed = [k for k in gone if not self._held_elsewhere(rank, tier, k)]
            elif kind is EventKind.CLEARED:
                gone = list(mine)
                mine.clear()
                changed = [k for k in gone if not self._held_elsewhere(rank, tier, k)]
                if not any(self._held[r][tier] for r in range(len(self._held))):
                    self.log.record(EventKind.CLEARED, tier)
                    return
                kind = EventKind.REMOVED
            else:
                raise ValueError(f"unknown event kind {kind!r}")
            if changed:
                self.log.record(kind, tier, changed)

    def _held_elsewhere(self, rank: int, tier: Tier, key: int) -> bool:
        return any(key in held[tier] for r, held in enumerate(self._held) if r != rank)


class RankEvents:
    """One rank's side of an ``EventUnion``: what a ``TieredKVStore`` records its events into."""

    def __init__(self, union: EventUnion, rank: int) -> None:
        self.union = union
        self.rank = rank

    def record(self, kind: EventKind, tier: Tier, keys: Iterable[int] = ()) -> None:
        self.union.record(self.rank, kind, tier, keys)


class DataParallelKVStore:
    """The stores of a data-parallel replica's ranks, as the engine sees one store: the scheduler
    asks ``for_rank(r)``; snapshots, key sets and stats are the replica's."""

    def __init__(self, stores: Sequence[TieredKVStore], events: KVEventLog, redis_keys: RedisKeys, redis: RedisTier | None) -> None:
        if not stores or stores[0].mirror is not None or not stores[0].local:
            raise ValueError("stores: the leader's own pool's store comes first, with its bytes here and no mirror")
        if any(store.redis_keys is not redis_keys or store.redis is not redis for store in stores):
            raise ValueError("stores: every rank's store shares the replica's Redis tier and view of it")
        self.ranks = list(stores)
        self.events = events
        self.redis_keys = redis_keys
        self.redis = redis

    def for_rank(self, rank: int) -> TieredKVStore:
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank: must be in [0, {len(self.ranks)}), got {rank}")
        return self.ranks[rank]

    @property
    def stats(self) -> TieredStats:
        """Every rank's counters summed, per tier."""
        total = TieredStats()
        for store in self.ranks:
            for tier, stats in store.stats.tiers.items():
                into = total.tiers[tier]
                into.num_hits += stats.num_hits
                into.num_misses += stats.num_misses
                into.num_bytes += stats.num_bytes
                into.num_evictions += stats.num_evictions
        return total

    def snapshot(self) -> KVSnapshot:
        with self.redis_keys.lock:
            return self.events.snapshot(self._key_sets())

    def key_sets(self) -> dict[Tier, set[int]]:
        with self.redis_keys.lock:
            return self._key_sets()

    def _key_sets(self) -> dict[Tier, set[int]]:
        pool, cpu = set(), set()
        for store in self.ranks:
            pool.update(store.pool.cached_keys())
            cpu.update(store.cpu.keys() if store.cpu is not None else ())
        return {Tier.POOL: pool, Tier.CPU: cpu, Tier.REDIS: self.redis_keys.keys()}

    def flush_moves(self) -> None:
        for store in self.ranks:
            store.flush_moves()

    def evict_pool(self) -> int:
        return sum(store.evict_pool() for store in self.ranks)

    def synchronize(self) -> None:
        for store in self.ranks:
            store.synchronize()

    def close(self) -> None:
        for store in self.ranks:
            store.close(close_redis=False)
        if self.redis is not None:
            self.redis.close()
