"""The Redis tier: KV blocks shared by the whole cluster, one Redis string per (block, KV head).

A tensor-parallel shard holds a contiguous range of the model's KV heads, so a block is stored
head by head: any shard reads exactly its heads, whichever shards (of whatever TP size) wrote
them, and a shard's block is its heads' values laid side by side (KVBlockLayout.head_ranges)::

    this shard's block (layout: heads [head_start, head_start + n) of num_model_kv_heads)
    +---------+---------+-----+----------------------------------+
    | head h0 | head h1 | ... | scales h0 | scales h1 | ... (fp8)|
    +---------+---------+-----+----------------------------------+
         |         |               |           |
         v         v               v           v
    {prefix}{ns:016x}:{key:016x}:{h0} = header | payload h0 | scales h0
    {prefix}{ns:016x}:{key:016x}:{h1} = header | payload h1 | scales h1

A value is one head's bytes behind a checked header (``kv_store/redis_value.py``). The Redis key is ``{prefix}{namespace fingerprint:016x}:{block key:016x}:{head}``. No pickle
anywhere. Heads that several ranks hold (fewer KV heads than ranks) are written by each: the
same bytes under the same key. Every call is bounded by a socket timeout; after a connection
error or a timeout the tier is skipped (calls return at once, counted) for a backoff that
doubles up to ``max_backoff_s``, then probed again: a Redis that is down or slow costs requests
a recompute, never an error.

Writes are asynchronous: ``put_async`` queues a block for a writer thread that sends queued
blocks in pipelined batches. A block is reported to ``on_stored`` once every head of the model
is in Redis: at once when this shard holds them all; otherwise when the other shards' values
show up (the write asks with EXISTS, then the writer re-checks pending keys at most every
``_CONFIRM_POLL_S`` until ``confirm_timeout_s`` and gives up on them, counted; a shard without
an ``on_stored`` asks nothing). Blocks another process writes whole (a rank of a data-parallel
replica) are watched the same way (``expect``). Reads are synchronous, one round trip per lookup.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_store.redis_value import ValueRejected, decode_value, encode_parts

logger = logging.getLogger(__name__)

_CONFIRM_POLL_S = 0.05
"""Shortest pause between two checks of the keys waiting for other shards' heads."""
_WAKE = object()
"""Queued to make the writer look at new pending keys (put_many from another thread)."""


@dataclass(frozen=True)
class RedisTierConfig:
    """Where the Redis tier lives and how it behaves."""

    url: str
    """``redis://[:password@]host:port/db`` or ``rediss://`` for TLS."""
    ttl_s: int = 3600
    """Seconds a block lives in Redis after it is written."""
    key_prefix: str = "splitserve:kv:"
    """Prefix of every key this tier writes."""
    socket_timeout_s: float = 0.5
    """Bound on every Redis call; a slower Redis counts as down."""
    min_backoff_s: float = 0.25
    """First pause after a failure; each failure after it doubles the pause, up to ``max_backoff_s``."""
    max_backoff_s: float = 30.0
    """Longest pause between two attempts while Redis is down."""
    tls_ca_file: Path | None = None
    """CA certificate that signed the server's certificate (``rediss://``)."""
    max_queued_puts: int = 4096
    """Blocks waiting for the writer thread beyond which new ones are dropped (counted)."""
    put_batch: int = 64
    """Blocks per pipelined write."""
    confirm_timeout_s: float = 10.0
    """How long a written block waits for the other shards' heads before it is given up (never
    reported to ``on_stored``); only a shard that holds some of the model's heads and has an
    ``on_stored`` waits."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url: {self.url!r} is not a redis://, rediss:// or unix:// URL")
        if self.ttl_s < 1:
            raise ValueError(f"ttl_s: must be >= 1, got {self.ttl_s}")
        if not self.socket_timeout_s > 0 or not 0 < self.min_backoff_s <= self.max_backoff_s:
            raise ValueError("socket_timeout_s: must be > 0; min_backoff_s: must be > 0 and <= max_backoff_s")
        if self.max_queued_puts < 1 or self.put_batch < 1:
            raise ValueError("max_queued_puts and put_batch: must be >= 1")
        if not self.confirm_timeout_s > 0:
            raise ValueError(f"confirm_timeout_s: must be > 0, got {self.confirm_timeout_s}")


@dataclass
class RedisTierStats:
    """Counters of one worker's Redis tier."""

    num_hits: int = 0
    """Blocks found and valid."""
    num_misses: int = 0
    """Lookups that ended at a block Redis did not have (all of this shard's heads)."""
    num_rejected: int = 0
    """Values found but refused (corrupt, truncated, another namespace, head or shape): misses too."""
    num_bytes_read: int = 0
    num_bytes_written: int = 0
    num_puts: int = 0
    """Blocks written (this shard's heads of each)."""
    num_dropped_puts: int = 0
    """Blocks not written: the write queue was full, or Redis was down."""
    num_unconfirmed: int = 0
    """Blocks written but never reported stored: the other shards' heads did not arrive within
    ``confirm_timeout_s`` (or the tier closed first)."""
    num_errors: int = 0
    """Calls that failed (connection error, timeout) and started or extended a backoff."""
    num_skipped: int = 0
    """Calls not made because the tier was backing off."""


class RedisTier:
    """Blocks of one namespace and shard layout in Redis; safe to call from several threads."""

    def __init__(
        self,
        config: RedisTierConfig,
        namespace: KeyNamespace,
        layout: KVBlockLayout,
        on_stored: Callable[[list[int]], None] | None = None,
        *,
        head_start: int = 0,
        num_model_kv_heads: int | None = None,
    ) -> None:
        """``layout``: this shard's blocks, whose ``num_kv_heads`` heads are the model's heads
        ``[head_start, head_start + layout.num_kv_heads)`` of ``num_model_kv_heads`` (by default
        exactly those: a shard that holds every head)."""
        num_model_kv_heads = head_start + layout.num_kv_heads if num_model_kv_heads is None else num_model_kv_heads
        if head_start < 0 or head_start + layout.num_kv_heads > num_model_kv_heads:
            raise ValueError(
                f"head_start: heads [{head_start}, {head_start + layout.num_kv_heads}) are not heads of a model with {num_model_kv_heads}"
            )
        self.config = config
        self.namespace = namespace
        self.layout = layout
        self.heads = range(head_start, head_start + layout.num_kv_heads)
        """The model's KV heads this shard holds, in the order of its blocks."""
        self.num_model_kv_heads = num_model_kv_heads
        self.on_stored = on_stored
        """Called with the keys of blocks once every head of the model is in Redis (on the thread
        that wrote them, or on the writer thread once the other shards' heads arrived)."""
        self.stats = RedisTierStats()
        kwargs = dict(socket_timeout=config.socket_timeout_s, socket_connect_timeout=config.socket_timeout_s)
        if config.url.startswith("rediss://") and config.tls_ca_file is not None:
            kwargs["ssl_ca_certs"] = str(config.tls_ca_file)
        # Imported here, not at the top: every engine process imports this module, and most run
        # no Redis tier (redis-py's import is 0.15 CPU-s).
        import redis

        self._client = redis.Redis.from_url(config.url, **kwargs)
        self._redis_down = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._prefix = f"{config.key_prefix}{namespace.fingerprint:016x}:"
        self._other_heads = [h for h in range(num_model_kv_heads) if h not in self.heads]
        self._head_layout = KVBlockLayout(layout.num_layers, 1, layout.head_dim, layout.block_size, layout.kv_dtype)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queued_puts)
        self._idle = threading.Condition()
        self._pending: dict[int, float] = {}
        """Keys waiting for heads other processes write (``put_many``'s other shards, ``expect``) -> when
        to give up on them (guarded by _idle)."""
        self._next_confirm_at = 0.0
        self._closed = False
        self._writer = threading.Thread(target=self._write_forever, name="redis-tier-writer", daemon=True)
        self._writer.start()

    def redis_key(self, key: int, head: int) -> str:
        """Where head ``head`` (of the model's KV heads) of block ``key`` lives."""
        return f"{self._prefix}{key:016x}:{head}"

    @property
    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._down_until

    def get_prefix(self, keys: Sequence[int]) -> list[memoryview]:
        """This shard's blocks (``layout.block_bytes`` each) of the longest run of ``keys`` from
        the first for which Redis holds a valid value of every local head, fetched in one round
        trip; [] while the tier is backing off."""
        if not keys:
            return []
        if not self.available:
            self._count(num_skipped=1)
            return []
        try:
            values = self._client.mget([self.redis_key(key, head) for key in keys for head in self.heads])
        except self._redis_down as e:
            self._failed("get", e)
            return []
        self._recovered()
        blocks: list[memoryview] = []
        num_heads = len(self.heads)
        for i, key in enumerate(keys):
            block = self._assemble(key, values[i * num_heads : (i + 1) * num_heads])
            if block is None:
                break
            blocks.append(block)
        self._count(num_hits=len(blocks), num_bytes_read=sum(b.nbytes for b in blocks))
        return blocks

    def count_prefix(self, keys: Sequence[int], heads: range | None = None) -> int:
        """Length of the longest run of ``keys`` from the first whose values of every head in
        ``heads`` (default: all the model's heads) exist in Redis, by one pipelined round trip of
        EXISTS (the values are not read, so not validated); 0 while the tier is backing off."""
        heads = range(self.num_model_kv_heads) if heads is None else heads
        if not heads or heads.start < 0 or heads.stop > self.num_model_kv_heads:
            raise ValueError(f"heads: {heads} is not a non-empty range of the model's {self.num_model_kv_heads} KV heads")
        if not keys:
            return 0
        if not self.available:
            self._count(num_skipped=1)
            return 0
        try:
            counts = self._count_heads(keys, heads)
        except self._redis_down as e:
            self._failed("count", e)
            return 0
        self._recovered()
        return next((i for i, count in enumerate(counts) if count < len(heads)), len(keys))

    def put_async(self, key: int, block: bytes | memoryview) -> bool:
        """Queue this shard's block for the writer thread, which stores one value per local head;
        False (counted) if the queue is full, the tier is backing off or closed. ``block`` must
        not change afterwards (pass a copy)."""
        if self._closed or not self.available:
            self._count(num_dropped_puts=1)
            return False
        try:
            self._queue.put_nowait((key, block))
        except queue.Full:
            self._count(num_dropped_puts=1)
            return False
        return True

    def put_many(self, blocks: Sequence[tuple[int, bytes | memoryview]]) -> list[int]:
        """Write this shard's ``blocks`` now (one value per local head), in one pipeline that also
        asks whether the other shards' heads are there (when someone listens: ``on_stored``);
        returns the keys written ([] on failure or backoff). Keys whose every head is in Redis go
        to ``on_stored`` now, the others wait (see the module docstring)."""
        if not blocks:
            return []
        if not self.available:
            self._count(num_skipped=1, num_dropped_puts=len(blocks))
            return []
        values = [(key, self._encode_block(key, block)) for key, block in blocks]
        confirm = bool(self._other_heads) and self.on_stored is not None
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, head_values in values:
                for head, value in zip(self.heads, head_values):
                    pipe.set(self.redis_key(key, head), value, ex=self.config.ttl_s)
                if confirm:
                    pipe.exists(*(self.redis_key(key, head) for head in self._other_heads))
            replies = pipe.execute()
        except self._redis_down as e:
            self._failed("put", e)
            self._count(num_dropped_puts=len(blocks))
            return []
        self._recovered()
        self._count(num_puts=len(values), num_bytes_written=sum(len(v) for _, head_values in values for v in head_values))
        keys = [key for key, _ in values]
        if not self._other_heads:
            self._stored(keys)
        elif confirm:
            self._confirm_written(keys, replies[len(self.heads) :: len(self.heads) + 1])
        return keys

    def expect(self, keys: Sequence[int]) -> None:
        """Report ``keys`` to ``on_stored`` once every head of the model is in Redis, written by
        another process (a data-parallel replica's rank, which holds whole blocks of its own
        requests, writes its spills itself); given up after ``confirm_timeout_s``, counted, as a
        written block whose other heads never come. Nothing is asked without an ``on_stored``."""
        if not keys or self._closed or self.on_stored is None:
            return
        now = time.monotonic()
        with self._idle:
            if not self._pending:
                self._next_confirm_at = now + _CONFIRM_POLL_S  # the writer's spill is still in flight
            self._pending.update((key, now + self.config.confirm_timeout_s) for key in keys)
            self._idle.notify_all()
        try:
            self._queue.put_nowait(_WAKE)
        except queue.Full:
            pass  # the writer is busy and looks at pending keys after its batch

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued block was written or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def wait_confirmed(self, timeout_s: float = 10.0) -> bool:
        """Wait until no written block waits for other shards' heads (each was reported to
        ``on_stored`` or given up); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self) -> None:
        """Stop the writer (blocks still queued are dropped, pending ones given up) and close
        the connections."""
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=5)
        with self._idle:
            num_pending = len(self._pending)
            self._pending.clear()
            self._idle.notify_all()
        self._count(num_unconfirmed=num_pending)
        self._client.close()

    def stats_snapshot(self) -> RedisTierStats:
        with self._lock:
            return RedisTierStats(**{f.name: getattr(self.stats, f.name) for f in fields(self.stats)})

    def _encode_block(self, key: int, block: bytes | memoryview) -> list[bytes]:
        """One value per local head of this shard's ``block``."""
        data = memoryview(block).cast("B")
        if data.nbytes != self.layout.block_bytes:
            raise ValueError(f"block: {data.nbytes} bytes, the layout's blocks have {self.layout.block_bytes}")
        values = []
        for i, head in enumerate(self.heads):
            payload, scales = self.layout.head_ranges(i, i + 1)
            parts = [data[payload.start : payload.stop]] + ([data[scales.start : scales.stop]] if scales else [])
            values.append(encode_parts(key, head, parts, self.namespace, self._head_layout))
        return values

    def _assemble(self, key: int, values: Sequence[bytes | None]) -> memoryview | None:
        """This shard's block from its heads' values; None (counted) at a missing or refused one."""
        heads = []
        for head, value in zip(self.heads, values):
            if value is None:
                self._count(num_misses=1)
                return None
            try:
                heads.append(decode_value(value, key, head, self.namespace, self._head_layout))
            except ValueRejected as e:
                logger.warning("redis tier: value of head %d of block %016x rejected: %s", head, key, e)
                self._count(num_rejected=1, num_misses=1)
                return None
        if len(heads) == 1 and heads[0].nbytes == self.layout.block_bytes and self.layout.scales_offset == self.layout.head_bytes:
            return heads[0]  # one head, no padding: the value is the block
        block = bytearray(self.layout.block_bytes)
        head_bytes = self.layout.head_bytes
        for i, data in enumerate(heads):
            payload, scales = self.layout.head_ranges(i, i + 1)
            block[payload.start : payload.stop] = data[:head_bytes]
            if scales:
                block[scales.start : scales.stop] = data[head_bytes:]
        return memoryview(block)

    def _count_heads(self, keys: Sequence[int], heads: Sequence[int]) -> list[int]:
        """How many of ``heads`` of each key exist, one pipelined EXISTS per key."""
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(*(self.redis_key(key, head) for head in heads))
        return pipe.execute()

    def _confirm_written(self, keys: list[int], counts: list[int]) -> None:
        """Report the just written ``keys`` whose other heads all exist (``counts``); the others
        wait for the writer's re-checks."""
        confirmed = [key for key, count in zip(keys, counts) if count == len(self._other_heads)]
        waiting = [key for key, count in zip(keys, counts) if count != len(self._other_heads)]
        now = time.monotonic()
        with self._idle:
            for key in confirmed:
                self._pending.pop(key, None)
            if waiting and not self._pending:
                self._next_confirm_at = now + _CONFIRM_POLL_S  # just checked
            self._pending.update((key, now + self.config.confirm_timeout_s) for key in waiting)
            self._idle.notify_all()
        if waiting and threading.current_thread() is not self._writer:
            try:
                self._queue.put_nowait(_WAKE)
            except queue.Full:
                pass  # the writer is busy and looks at pending keys after its batch
        self._stored(confirmed)

    def _stored(self, keys: list[int]) -> None:
        if keys and self.on_stored is not None:
            self.on_stored(keys)

    def _write_forever(self) -> None:
        while True:
            batch = self._next_batch()
            stop = None in batch
            blocks = [item for item in batch if item is not None and item is not _WAKE]
            try:
                self.put_many(blocks)
            except Exception:  # never let the writer die: a bad block is dropped, the rest go on
                logger.exception("redis tier: write of %d blocks failed", len(blocks))
                self._count(num_dropped_puts=len(blocks))
            finally:
                with self._idle:
                    for _ in batch:
                        self._queue.task_done()
                    self._idle.notify_all()
            if stop:
                return
            try:
                self._confirm_pending()
            except Exception:  # an on_stored that raised: the writer goes on
                logger.exception("redis tier: reporting confirmed blocks failed")

    def _next_batch(self) -> list:
        """Up to ``put_batch`` queued items; [] when it is time to look at pending keys first."""
        with self._idle:
            timeout_s = max(0.0, self._next_confirm_at - time.monotonic()) if self._pending else None
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return []
        batch = [item]
        while item is not None and len(batch) < self.config.put_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            batch.append(item)
        return batch

    def _confirm_pending(self) -> None:
        """Report pending keys whose other heads arrived, give up on those past their time; at
        most once per ``_CONFIRM_POLL_S`` (writer thread)."""
        now = time.monotonic()
        with self._idle:
            if not self._pending or now < self._next_confirm_at:
                return
            pending = dict(self._pending)
            self._next_confirm_at = now + _CONFIRM_POLL_S
        confirmed: list[int] = []
        if self.available:
            try:  # every head: a key ``expect``ed was written by another process, this shard's heads too
                counts = self._count_heads(list(pending), range(self.num_model_kv_heads))
            except self._redis_down as e:
                self._failed("confirm", e)
            else:
                self._recovered()
                confirmed = [key for key, count in zip(pending, counts) if count == self.num_model_kv_heads]
        done = set(confirmed)
        expired = [key for key, give_up_at in pending.items() if key not in done and give_up_at <= now]
        with self._idle:
            for key in confirmed:
                self._pending.pop(key, None)
            for key in expired:
                if self._pending.get(key) == pending[key]:  # not written again meanwhile
                    del self._pending[key]
            self._idle.notify_all()
        if expired:
            self._count(num_unconfirmed=len(expired))
            logger.info("redis tier: %d blocks given up: other shards' heads missing after %.1f s", len(expired), self.config.confirm_timeout_s)
        self._stored(confirmed)

    def _failed(self, what: str, error: Exception) -> None:
        with self._lock:
            self._backoff_s = min(self.config.max_backoff_s, max(self.config.min_backoff_s, self._backoff_s * 2))
            self._down_until = time.monotonic() + self._backoff_s
            self.stats.num_errors += 1
        logger.warning("redis tier: %s failed (%s: %s); skipping the tier for %.2f s", what, type(error).__name__, error, self._backoff_s)

    def _recovered(self) -> None:
        if self._backoff_s:
            with self._lock:
                self._backoff_s = 0.0

    def _count(self, **increments: int) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)
