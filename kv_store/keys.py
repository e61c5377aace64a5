"""Block keys: 64-bit hashes chained over a prompt's full blocks.

::

    root      = H(namespace fields, tenant salt)          # key_{-1}
    key_0     = H(root,      tokens[0:B])
    key_1     = H(key_0,     tokens[B:2B])
    key_i     = H(key_{i-1}, tokens[i*B:(i+1)*B])        # partial tail blocks get no key

H is XXH3-64 over little-endian bytes: the parent key as u64, then each token id as u32. The
result depends only on those bytes, never on PYTHONHASHSEED or the process. Everything that
changes what a block's bytes mean (model weights, KV dtype, block size) is folded into the root,
so two workers agree on a key only when they agree on the bytes of every KV head. The
tensor-parallel shard is not: a key names a block's tokens, and which of its heads a shard holds
is the business of the values (the Redis tier stores one value per KV head) and of the KV
hand-off's head mapping, so replicas of any TP size share keys (and Redis values).

This module must not import torch: the router imports it.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

KEY_SPEC_VERSION = 2
"""Bumped whenever the byte encoding below changes; part of every namespace. 2: the TP shard
(``tp_size``, ``tp_rank``) left the root."""

KV_DTYPES = ("fp32", "bf16", "fp8_e4m3")

_SHARD_FIELDS = ("tp_size", "tp_rank")
"""KeyNamespace fields that name a shard and stay out of the root."""
_MAX_TOKEN_ID = 2**32 - 1
_U64_MAX = 2**64 - 1
_xxh3 = xxhash.xxh3_64_intdigest

try:
    import kv_store._chain as _chain
except ImportError:  # not built (no compiler or no xxhash.h at install): the Python loop, same keys
    _chain = None

NATIVE_CHAIN = _chain is not None
"""Whether keys come from the C extension (setup.py builds it; tests require it where
``SPLITSERVE_REQUIRE_NATIVE=1``)."""


class NamespaceMismatchError(ValueError):
    """Two parties hash blocks in different namespaces; the message lists every field that differs."""

    def __init__(self, differing: dict[str, tuple[object, object]], ours: str, theirs: str) -> None:
        parts = ", ".join(f"{name}: {ours}={a!r} vs {theirs}={b!r}" for name, (a, b) in differing.items())
        super().__init__(f"KV key namespaces differ ({parts})")
        self.differing = differing


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that must match for two blocks with the same tokens to hold the same bytes, and
    the shard (``tp_size``, ``tp_rank``) of the party that holds them, which keys leave out."""

    model_name: str
    """Model identity as served (the bundled name or the checkpoint's name)."""
    weights_fingerprint: str
    """Hex digest of the weights (see engine.loader); different weights never share blocks."""
    kv_dtype: str
    """Storage dtype of the block: one of KV_DTYPES."""
    block_size: int
    """Tokens per block."""
    tp_size: int = 1
    """Tensor-parallel degree of the party's shard; names a shard (KV hand-off), not part of keys."""
    tp_rank: int = 0
    """Which shard (range of KV heads) of that degree the party holds; not part of keys."""
    key_spec_version: int = KEY_SPEC_VERSION
    """Version of this module's encoding."""

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name: must not be empty")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: {self.kv_dtype!r} is not one of {KV_DTYPES}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: {self.tp_rank} is not a rank of tp_size {self.tp_size}")

    def _canonical_bytes(self) -> bytes:
        fields = (getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _SHARD_FIELDS)
        return b"splitserve-kv\x00" + "\x1f".join(str(f) for f in fields).encode()

    def root_key(self, tenant_salt: str | bytes | None = None) -> int:
        """key_{-1} for this namespace (the TP shard aside); a tenant salt gives each tenant its own key space."""
        salt = tenant_salt.encode() if isinstance(tenant_salt, str) else (tenant_salt or b"")
        return xxhash.xxh3_64_intdigest(self._canonical_bytes() + b"\x00salt\x00" + salt)

    @property
    def fingerprint(self) -> int:
        """64-bit identity of the namespace (its root key without a tenant salt)."""
        return self.root_key(None)

    def differences(self, other: KeyNamespace) -> dict[str, tuple[object, object]]:
        """Fields whose values differ, as ``{name: (ours, theirs)}``."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        }

    def require_same(self, other: KeyNamespace, ours: str = "local", theirs: str = "peer") -> None:
        """Raise NamespaceMismatchError naming each differing field, unless the namespaces match."""
        differing = self.differences(other)
        if differing:
            raise NamespaceMismatchError(differing, ours, theirs)


def hash_block(parent_key: int, token_ids: Sequence[int]) -> int:
    """H(parent, tokens): the key of one block given the key of the block before it."""
    return xxhash.xxh3_64_intdigest(parent_key.to_bytes(8, "little") + _pack(token_ids))


def block_keys(
    token_ids: Sequence[int], block_size: int, parent_key: int, start_block: int = 0
) -> list[int]:
    """Keys of the full blocks of ``token_ids`` from block ``start_block`` on.

    ``parent_key`` is the key of block ``start_block - 1`` (the namespace root when 0), so a
    caller that already holds the keys of a prefix extends the chain without rehashing it.
    """
    num_full_blocks = len(token_ids) // block_size
    return packed_block_keys(_pack(token_ids[start_block * block_size : num_full_blocks * block_size]), block_size, parent_key)


def packed_block_keys(data: bytes | np.ndarray, block_size: int, parent_key: int) -> list[int]:
    """``block_keys`` of token ids already packed as little-endian u32s, block after block
    (any contiguous buffer, ``len`` a multiple of ``block_size * 4`` bytes)."""
    return packed_block_key_array(data, block_size, parent_key).tolist()


def packed_block_key_array(data: bytes | np.ndarray, block_size: int, parent_key: int) -> np.ndarray:
    """``packed_block_keys`` as a uint64 array: the one loop every key of ours comes from.

    Each step is sequential by design (a block's key needs its parent's), so in Python it is one
    step per block (2,048 at 32k tokens on 16-token blocks, ~250 us); the C extension
    ``kv_store._chain`` runs the same loop in ~20 us. Without it (not built), the Python loop
    gives the same keys."""
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    if not 0 <= parent_key <= _U64_MAX:
        raise ValueError(f"parent_key: {parent_key!r} is not a u64 key")
    if _chain is not None:
        return np.frombuffer(_chain.chain_keys(data, block_size, parent_key), dtype=np.uint64)
    return np.array(python_packed_block_keys(data, block_size, parent_key), dtype=np.uint64)


def python_packed_block_keys(data: bytes | np.ndarray, block_size: int, parent_key: int) -> list[int]:
    """``packed_block_keys`` in Python, the spec written out: the fallback when the C extension
    is not built, and what the tests hold it to. The step is kept to one call of the hash:
    numpy cuts the buffer into one bytes object per block in C, and the comprehension carries
    the parent key."""
    blocks = np.frombuffer(data, dtype=np.dtype((np.void, block_size * 4))).tolist()
    key = parent_key
    return [key := _xxh3(key.to_bytes(8, "little") + block) for block in blocks]


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32s; ValueError naming the first that is not one."""
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as e:
        bad = next((t for t in token_ids if not 0 <= t <= _MAX_TOKEN_ID), None)
        raise ValueError(f"token_ids: {bad!r} is not a u32 token id") from e
