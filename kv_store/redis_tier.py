"""The Redis tier: KV blocks shared by the whole cluster, one Redis string per block.

A value is a fixed header followed by the block's bytes, written with one ``SET ... EX`` (so a
reader sees all of it or nothing) and read back only if every header field matches what the
reader expects; anything else is a miss, counted, never used::

    offset  size  field
    0       4     magic b"SSKV"
    4       2     value format version (VALUE_VERSION)
    6       2     key-spec version (kv_store.keys.KEY_SPEC_VERSION)
    8       8     namespace fingerprint (KeyNamespace.fingerprint)
    16      8     block key
    24      1     KV dtype (index into KV_DTYPES)
    25      1     reserved (0)
    26      2     KV heads      28  2  layers      30  2  block size      32  2  head dim
    34      2     reserved (0)
    36      4     payload bytes
    40      8     XXH3-64 of the payload
    48      ...   payload (KVBlockLayout.block_bytes)

The Redis key is ``{prefix}{namespace fingerprint:016x}:{block key:016x}``. No pickle anywhere.
Every call is bounded by a socket timeout; after a connection error or a timeout the tier is
skipped (calls return at once, counted) for a backoff that doubles up to ``max_backoff_s``, then
probed again: a Redis that is down or slow costs requests a recompute, never an error.

Writes are asynchronous: ``put_async`` queues a block for a writer thread that sends queued
blocks in pipelined batches. Reads are synchronous, one pipelined round trip per lookup.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import redis
import xxhash

from kv_store.keys import KEY_SPEC_VERSION, KV_DTYPES, KeyNamespace
from kv_store.layout import KVBlockLayout

logger = logging.getLogger(__name__)

MAGIC = b"SSKV"
VALUE_VERSION = 1
_HEADER = struct.Struct("<4sHHQQBBHHHHHIQ")
HEADER_BYTES = _HEADER.size
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)


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

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url: {self.url!r} is not a redis://, rediss:// or unix:// URL")
        if self.ttl_s < 1:
            raise ValueError(f"ttl_s: must be >= 1, got {self.ttl_s}")
        if not self.socket_timeout_s > 0 or not 0 < self.min_backoff_s <= self.max_backoff_s:
            raise ValueError("socket_timeout_s: must be > 0; min_backoff_s: must be > 0 and <= max_backoff_s")
        if self.max_queued_puts < 1 or self.put_batch < 1:
            raise ValueError("max_queued_puts and put_batch: must be >= 1")


@dataclass
class RedisTierStats:
    """Counters of one worker's Redis tier."""

    num_hits: int = 0
    """Blocks found and valid."""
    num_misses: int = 0
    """Lookups that ended at a block Redis did not have."""
    num_rejected: int = 0
    """Values found but refused (corrupt, truncated, another namespace or shape): misses too."""
    num_bytes_read: int = 0
    num_bytes_written: int = 0
    num_puts: int = 0
    """Blocks written."""
    num_dropped_puts: int = 0
    """Blocks not written: the write queue was full, or Redis was down."""
    num_errors: int = 0
    """Calls that failed (connection error, timeout) and started or extended a backoff."""
    num_skipped: int = 0
    """Calls not made because the tier was backing off."""


class ValueRejected(ValueError):
    """A Redis value that must not be used as a block; the message says why."""


def encode_value(key: int, block: bytes | memoryview, namespace: KeyNamespace, layout: KVBlockLayout) -> bytes:
    """Header + block bytes, ready for one SET."""
    payload = memoryview(block).cast("B")
    if payload.nbytes != layout.block_bytes:
        raise ValueError(f"block: {payload.nbytes} bytes, the layout's blocks have {layout.block_bytes}")
    header = _HEADER.pack(
        MAGIC, VALUE_VERSION, KEY_SPEC_VERSION, namespace.fingerprint, key,
        KV_DTYPES.index(layout.kv_dtype), 0,
        layout.num_kv_heads, layout.num_layers, layout.block_size, layout.head_dim, 0,
        payload.nbytes, xxhash.xxh3_64_intdigest(payload),
    )
    return b"".join((header, payload))


def decode_value(value: bytes, key: int, namespace: KeyNamespace, layout: KVBlockLayout) -> memoryview:
    """The block bytes of ``value`` if it is exactly the block ``key`` of this namespace and
    layout, intact; ValueRejected naming the first mismatch otherwise."""
    if len(value) < HEADER_BYTES:
        raise ValueRejected(f"truncated: {len(value)} bytes, shorter than the {HEADER_BYTES}-byte header")
    (magic, version, spec, ns, stored_key, dtype, _, heads, layers, block_size, head_dim, _, length, checksum) = _HEADER.unpack_from(value)
    expected = {
        "magic": (magic, MAGIC),
        "value version": (version, VALUE_VERSION),
        "key-spec version": (spec, KEY_SPEC_VERSION),
        "namespace": (ns, namespace.fingerprint),
        "block key": (stored_key, key),
        "kv dtype": (dtype, KV_DTYPES.index(layout.kv_dtype)),
        "shape": ((heads, layers, block_size, head_dim), (layout.num_kv_heads, layout.num_layers, layout.block_size, layout.head_dim)),
        "payload length": (length, layout.block_bytes),
    }
    for name, (got, want) in expected.items():
        if got != want:
            raise ValueRejected(f"{name}: value has {got!r}, expected {want!r}")
    payload = memoryview(value)[HEADER_BYTES:]
    if payload.nbytes != length:
        raise ValueRejected(f"truncated: {payload.nbytes} payload bytes, the header says {length}")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise ValueRejected("checksum: payload does not match")
    return payload


class RedisTier:
    """Blocks of one namespace and layout in Redis; safe to call from several threads."""

    def __init__(
        self,
        config: RedisTierConfig,
        namespace: KeyNamespace,
        layout: KVBlockLayout,
        on_stored: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.config = config
        self.namespace = namespace
        self.layout = layout
        self.on_stored = on_stored
        """Called (on the writer thread) with the keys of each batch that reached Redis."""
        self.stats = RedisTierStats()
        kwargs = dict(socket_timeout=config.socket_timeout_s, socket_connect_timeout=config.socket_timeout_s)
        if config.url.startswith("rediss://") and config.tls_ca_file is not None:
            kwargs["ssl_ca_certs"] = str(config.tls_ca_file)
        self._client = redis.Redis.from_url(config.url, **kwargs)
        self._prefix = f"{config.key_prefix}{namespace.fingerprint:016x}:"
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queued_puts)
        self._idle = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._writer = threading.Thread(target=self._write_forever, name="redis-tier-writer", daemon=True)
        self._writer.start()

    def redis_key(self, key: int) -> str:
        return f"{self._prefix}{key:016x}"

    @property
    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._down_until

    def get_prefix(self, keys: Sequence[int]) -> list[memoryview]:
        """Blocks of the longest run of ``keys`` from the first that Redis holds and that pass
        validation, fetched in one pipelined round trip; [] while the tier is backing off."""
        if not keys:
            return []
        if not self.available:
            self._count(num_skipped=1)
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self.redis_key(key))
            values = pipe.execute()
        except _REDIS_DOWN as e:
            self._failed("get", e)
            return []
        self._recovered()
        blocks: list[memoryview] = []
        for key, value in zip(keys, values):
            if value is None:
                self._count(num_misses=1)
                break
            try:
                blocks.append(decode_value(value, key, self.namespace, self.layout))
            except ValueRejected as e:
                logger.warning("redis tier: value of block %016x rejected: %s", key, e)
                self._count(num_rejected=1, num_misses=1)
                break
        self._count(num_hits=len(blocks), num_bytes_read=sum(b.nbytes for b in blocks))
        return blocks

    def put_async(self, key: int, block: bytes | memoryview) -> bool:
        """Queue a block for the writer thread; False (counted) if the queue is full, the tier is
        backing off or closed. ``block`` must not change afterwards (pass a copy)."""
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
        """Write blocks now, in one pipeline; returns the keys written ([] on failure or backoff)."""
        if not blocks:
            return []
        if not self.available:
            self._count(num_skipped=1, num_dropped_puts=len(blocks))
            return []
        values = [(key, encode_value(key, block, self.namespace, self.layout)) for key, block in blocks]
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in values:
                pipe.set(self.redis_key(key), value, ex=self.config.ttl_s)
            pipe.execute()
        except _REDIS_DOWN as e:
            self._failed("put", e)
            self._count(num_dropped_puts=len(blocks))
            return []
        self._recovered()
        self._count(num_puts=len(values), num_bytes_written=sum(len(v) for _, v in values))
        keys = [key for key, _ in values]
        if self.on_stored is not None:
            self.on_stored(keys)
        return keys

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

    def close(self) -> None:
        """Stop the writer (blocks still queued are dropped) and close the connections."""
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=5)
        self._client.close()

    def stats_snapshot(self) -> RedisTierStats:
        with self._lock:
            return RedisTierStats(**{f.name: getattr(self.stats, f.name) for f in fields(self.stats)})

    def _write_forever(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while item is not None and len(batch) < self.config.put_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                batch.append(item)
            stop = batch[-1] is None
            blocks = [b for b in batch if b is not None]
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
