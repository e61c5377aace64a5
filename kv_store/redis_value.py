"""The bytes of one Redis KV value: one KV head of one block behind a header a reader checks.

A value is a fixed header followed by one head's bytes, written with one ``SET ... EX`` (so a
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
    26      2     KV heads (1)  28  2  layers      30  2  block size      32  2  head dim
    34      2     KV head: the head's index among all the model's KV heads
    36      4     payload bytes (head_value_bytes: the head's payload, then its scales)
    40      8     XXH3-64 of the payload
    48      ...   payload: [layers, 2, block_size, head_dim] elements, then f32 [layers, 2]
                  scales (fp8 only)
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from kv_store.keys import KEY_SPEC_VERSION, KV_DTYPES, KeyNamespace
from kv_store.layout import KVBlockLayout

MAGIC = b"SSKV"
VALUE_VERSION = 2
_HEADER = struct.Struct("<4sHHQQBBHHHHHIQ")
HEADER_BYTES = _HEADER.size


class ValueRejected(ValueError):
    """A Redis value that must not be used as a block; the message says why."""


def head_value_bytes(layout: KVBlockLayout) -> int:
    """Payload bytes of one head's value: the head's payload, then its scales (fp8)."""
    return layout.head_bytes + layout.scale_bytes // layout.num_kv_heads


def encode_value(key: int, head: int, data: bytes | memoryview, namespace: KeyNamespace, layout: KVBlockLayout) -> bytes:
    """Header + one head's bytes (``head_value_bytes(layout)``), ready for one SET; ``head`` is
    the head's index among the model's KV heads."""
    return encode_parts(key, head, (memoryview(data).cast("B"),), namespace, layout)


def decode_value(value: bytes, key: int, head: int, namespace: KeyNamespace, layout: KVBlockLayout) -> memoryview:
    """The head's bytes (payload, then scales) of ``value`` if it is exactly head ``head`` of
    block ``key`` of this namespace, with ``layout``'s dtype and per-head shape, intact;
    ValueRejected naming the first mismatch otherwise."""
    if len(value) < HEADER_BYTES:
        raise ValueRejected(f"truncated: {len(value)} bytes, shorter than the {HEADER_BYTES}-byte header")
    (magic, version, spec, ns, stored_key, dtype, _, heads, layers, block_size, head_dim, stored_head, length, checksum) = _HEADER.unpack_from(value)
    expected = {
        "magic": (magic, MAGIC),
        "value version": (version, VALUE_VERSION),
        "key-spec version": (spec, KEY_SPEC_VERSION),
        "namespace": (ns, namespace.fingerprint),
        "block key": (stored_key, key),
        "kv head": (stored_head, head),
        "kv dtype": (dtype, KV_DTYPES.index(layout.kv_dtype)),
        "shape": ((heads, layers, block_size, head_dim), (1, layout.num_layers, layout.block_size, layout.head_dim)),
        "payload length": (length, head_value_bytes(layout)),
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


def encode_parts(key: int, head: int, parts: Sequence[memoryview], namespace: KeyNamespace, layout: KVBlockLayout) -> bytes:
    """The value of ``head`` of block ``key`` from the pieces of its bytes (its payload, then its
    scales), checksummed without joining them first; ``layout`` is a one-head layout."""
    length = sum(p.nbytes for p in parts)
    if length != head_value_bytes(layout):
        raise ValueError(f"head {head}: {length} bytes, the layout's heads have {head_value_bytes(layout)}")
    checksum = xxhash.xxh3_64()
    for part in parts:
        checksum.update(part)
    header = _HEADER.pack(
        MAGIC, VALUE_VERSION, KEY_SPEC_VERSION, namespace.fingerprint, key,
        KV_DTYPES.index(layout.kv_dtype), 0,
        1, layout.num_layers, layout.block_size, layout.head_dim, head,
        length, checksum.intdigest(),
    )
    return b"".join((header, *parts))
