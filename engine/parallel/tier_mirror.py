"""KV tiers on every rank of a tensor-parallel replica: the leader decides, each rank moves its slice.

The leader's ``TieredKVStore`` (kv_store/tiered.py) keeps the one CPU-tier bookkeeping and the
one view of Redis; its ``FollowerMirror`` records each block move and sends them, in order, to
the other ranks through the plan channel, ahead of the step that needs them. Each follower's
``FollowerTiers`` makes the same moves on its own slice: its KV pool, its CPU tier (the same
slots, holding its heads), its Redis values (one per KV head it holds)::

    leader (rank 0)                               follower (rank r)
    ───────────────                               ─────────────────
    evict: save(block 7 → slot 3)  ─┐
    spill_slot(key k, slot 3)       │ TierMoves ► save own slice of block 7 into own slot 3 ...
    step plan                     ──┘ ─────────► run the step
    load: load(slot 3 → block 9)   ── TierMoves(agree) ► load own slice; report how many loads
          agree_min(n) ◄────────────────────────────────── it completed (a Redis value may be gone)

Nothing is gathered on the leader: a follower's bytes never leave its process but to its own
CPU tier and Redis.

A data-parallel (expert-parallel) replica's ranks each hold whole blocks of their own requests:
the leader keeps one store per rank (kv_store/data_parallel.py), and rank r's store's mirror
addresses its moves to rank r alone (``TierMoves.rank``). The other followers receive them too
(the plan channel is a broadcast), make none, and report no loads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.parallel.group import TPGroup
from kv_store.block_copier import block_copier
from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_store.redis_tier import RedisTier, RedisTierConfig

_NO_LOADS = 2**62
"""What a rank reports to ``agree_min`` for a batch of moves without loads (never the minimum)."""


@dataclass(frozen=True)
class TierMoves:
    """Block moves for every follower, in the order the leader made them; ``agree``: each
    follower then reports (``TPGroup.agree_min``) how many of the loads among them it completed."""

    moves: tuple[tuple, ...]
    """("save", block_id, slot) | ("load", slot, block_id) | ("spill_block", key, block_id) |
    ("spill_slot", key, slot) | ("load_redis", key, block_id)."""
    agree: bool
    rank: int | None = None
    """The one follower that makes the moves (a data-parallel rank's own blocks); None: every
    follower, each on its slice (tensor-parallel)."""


class FollowerMirror:
    """The leader's ``RankMirror`` (kv_store.tiered): records moves and sends them to the followers
    (to ``rank`` alone, when given: the store of data-parallel rank ``rank``'s pool)."""

    def __init__(self, group: TPGroup, rank: int | None = None) -> None:
        if rank is not None and not 0 < rank < group.size:
            raise ValueError(f"rank: a mirror addresses a follower, rank in [1, {group.size}), got {rank}")
        self.group = group
        self.rank = rank
        self._moves: list[tuple] = []

    def save(self, block_id: int, slot: int) -> None:
        self._moves.append(("save", block_id, slot))

    def load(self, slot: int, block_id: int) -> None:
        self._moves.append(("load", slot, block_id))

    def spill_block(self, key: int, block_id: int) -> None:
        self._moves.append(("spill_block", key, block_id))

    def spill_slot(self, key: int, slot: int) -> None:
        self._moves.append(("spill_slot", key, slot))

    def load_redis(self, key: int, block_id: int) -> None:
        self._moves.append(("load_redis", key, block_id))

    def agree(self, num_loaded: int) -> int:
        self._send(agree=True)
        return self.group.agree_min(num_loaded)

    def flush(self, wait: bool) -> None:
        if self._moves or wait:
            self._send(agree=wait)
            if wait:
                self.group.agree_min(_NO_LOADS)

    def _send(self, agree: bool) -> None:
        moves, self._moves = tuple(self._moves), []
        self.group.send_plan(TierMoves(moves, agree, self.rank))


class FollowerTiers:
    """A follower rank's own CPU tier and Redis values, moved as its leader says (``apply``)."""

    def __init__(self, config: EngineConfig, group: TPGroup, pool: torch.Tensor, layout: KVBlockLayout, namespace: KeyNamespace, kv_heads: range, num_model_kv_heads: int) -> None:
        """``pool``: this rank's KV pool bytes, ``uint8 [num_blocks, block_bytes]``; ``kv_heads``:
        the model's KV heads this rank holds."""
        self.group = group
        self.cpu = None
        if config.cpu_kv_cache_bytes:  # the leader's CPU tier has as many slots: the shards' blocks are the same size
            num_slots = config.cpu_kv_cache_bytes // layout.block_bytes
            self.cpu = torch.empty((num_slots, layout.block_bytes), dtype=torch.uint8, pin_memory=pool.is_cuda)
        self.copier = block_copier(pool, self.cpu)
        self.redis = None
        if config.redis_url is not None:
            redis_config = RedisTierConfig(config.redis_url, config.redis_ttl_s, tls_ca_file=config.redis_tls_ca_file)
            self.redis = RedisTier(redis_config, namespace, layout, head_start=kv_heads.start, num_model_kv_heads=num_model_kv_heads)
        self.num_moves = 0

    def apply(self, message: object) -> None:
        """Make the leader's ``TierMoves`` on this rank's slice; report the loads completed when asked."""
        if not isinstance(message, TierMoves):
            raise ValueError(f"a follower's tiers got {type(message).__name__} from its leader")
        num_loads = num_loaded = 0
        moves = message.moves if message.rank in (None, self.group.rank) else ()
        i = 0
        while i < len(moves):
            kind = moves[i][0]
            if kind == "load_redis":  # a run of Redis loads: one pipelined read
                end = i
                while end < len(moves) and moves[end][0] == "load_redis":
                    end += 1
                run = moves[i:end]
                blocks = self.redis.get_prefix([key for _, key, _ in run]) if self.redis is not None else []
                for (_, _, block_id), data in zip(run, blocks):
                    self.copier.load_bytes(data, block_id)
                num_loaded += len(blocks) if num_loaded == num_loads else 0  # loads count while none before them failed
                num_loads += len(run)
                i = end
                continue
            if kind == "save":
                _, block_id, slot = moves[i]
                self.copier.wait_slot(slot)
                self.copier.save(block_id, slot)
            elif kind == "load":
                _, slot, block_id = moves[i]
                self.copier.load(slot, block_id)
                num_loaded += num_loaded == num_loads
                num_loads += 1
            elif kind == "spill_block":
                _, key, block_id = moves[i]
                self._spill(key, self.copier.block_bytes(block_id))
            elif kind == "spill_slot":
                _, key, slot = moves[i]
                self.copier.wait_slot(slot)
                self._spill(key, self.cpu[slot].numpy().tobytes())
            else:
                raise ValueError(f"unknown tier move {kind!r}")
            i += 1
        self.copier.fence()
        self.num_moves += len(moves)
        if message.agree:
            self.group.agree_min(num_loaded if num_loads else _NO_LOADS)

    def _spill(self, key: int, data: bytes) -> None:
        if self.redis is not None:
            self.redis.put_async(key, data)

    def close(self) -> None:
        self.copier.synchronize()
        if self.redis is not None:
            self.redis.close()
