"""The router's block keys of a prompt, hashed once: turns of a session reuse their prefix's keys.

The keys are kv_store.keys' chained XXH3 (the workers' keys): ``key_i = H(key_{i-1}, block_i)``.
Chaining makes hashing sequential, one Python step per block (2,048 at 32k tokens on 16-token
blocks), so the router remembers the keys of recent prompts and, for a new prompt, hashes only
the blocks past the longest prefix it has seen. Finding that prefix must not itself cost a step
per block, so every block also gets a *fingerprint* of its prefix computed with numpy at once::

    g_j  = mix(sum_t token_{j,t} * R_t, j)              per block, vectorized
    fp_i = root_mix + g_0 + g_1 + ... + g_i  (mod 2^64)  a cumulative sum, vectorized

A seen prompt puts ``fp_i -> its record`` for every block ``i`` in a ``KeyTable`` (one
vectorized insert), and a new prompt looks all its fingerprints up at once: the leading run of
known ones is the longest prefix seen. The record found is checked token for token (one
``numpy`` compare) before its keys are reused, so a fingerprint collision costs a rehash, never a
wrong key. Records live in two generations of ``max_blocks`` fingerprints each (the default: 2M
tokens of 16-token blocks): when the young one fills, the old one's records and fingerprints
are dropped. Keys come back as a uint64 array, the form the prefix index looks up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kv_store.keys import packed_block_keys
from router.key_table import KeyTable

_MULTIPLIERS = np.random.default_rng(0x5EED).integers(1, 2**63, size=4096, dtype=np.uint64) | np.uint64(1)
_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class _Record:
    root_key: int
    token_ids: np.ndarray
    """The prompt's full blocks' tokens, uint32."""
    keys: np.ndarray
    """Their block keys, uint64."""


class BlockHasher:
    """Block keys of prompts for one block size, reusing the keys of recent prompts' prefixes."""

    def __init__(self, block_size: int, max_blocks: int = 131_072) -> None:
        if not 1 <= block_size <= len(_MULTIPLIERS):
            raise ValueError(f"block_size: must be in [1, {len(_MULTIPLIERS)}], got {block_size}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks: must be >= 1, got {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._fingerprints = KeyTable(1, 131_072, keep=self._young)
        """Fingerprint -> record number (column 0), for both generations."""
        self._records: dict[int, _Record] = {}
        self._next_record = 0
        self._young_from = 0
        """Record numbers from this one on are the young generation's."""
        self._num_young_blocks = 0
        self._mixed_positions = np.zeros(0, dtype=np.uint64)
        self.num_hashed_blocks = 0
        """Blocks hashed from scratch so far (the rest were reused)."""

    def keys(self, token_ids: Sequence[int] | np.ndarray, root_key: int, num_tokens: int | None = None) -> np.ndarray:
        """Keys (uint64) of the full blocks of ``token_ids[:num_tokens]`` (what
        ``kv_store.keys.block_keys`` returns). A protobuf repeated field is read as a buffer,
        without a Python int per token."""
        try:
            tokens = np.ascontiguousarray(np.asarray(token_ids, dtype=np.uint32)[:num_tokens])
        except OverflowError as e:
            raise ValueError(f"token_ids: not all u32 token ids ({e})") from None
        num_blocks = len(tokens) // self.block_size
        if num_blocks == 0:
            return np.zeros(0, dtype=np.uint64)
        tokens = tokens[: num_blocks * self.block_size]
        fingerprints = self._fingerprint(tokens, root_key)
        known, number = self._longest_known(fingerprints, tokens, root_key)
        reused = self._records[number].keys[:known] if known else np.zeros(0, dtype=np.uint64)
        fresh = self._hash(tokens, known, int(reused[-1]) if known else root_key)
        keys = np.concatenate([reused, fresh])
        self._store(_Record(root_key, tokens, keys), fingerprints, known if known and number >= self._young_from else 0)
        return keys

    def _fingerprint(self, tokens: np.ndarray, root_key: int) -> np.ndarray:
        if self.block_size % 2 == 0:  # two tokens per u64: half the multiplies
            blocks = tokens.view(np.uint64).reshape(-1, self.block_size // 2)
        else:
            blocks = tokens.reshape(-1, self.block_size).astype(np.uint64)
        per_block = blocks @ _MULTIPLIERS[: blocks.shape[1]]
        per_block ^= self._positions(len(per_block))
        per_block *= _MIX
        per_block ^= per_block >> np.uint64(31)
        per_block[0] = (int(per_block[0]) + root_key) & 0xFFFF_FFFF_FFFF_FFFF
        return np.cumsum(per_block, dtype=np.uint64)

    def _positions(self, num_blocks: int) -> np.ndarray:
        """``(1..num_blocks) * _MIX``, kept between calls: it makes a block's fingerprint depend on its place."""
        if len(self._mixed_positions) < num_blocks:
            self._mixed_positions = np.arange(1, 2 * num_blocks + 1, dtype=np.uint64) * _MIX
        return self._mixed_positions[:num_blocks]

    def _longest_known(self, fingerprints: np.ndarray, tokens: np.ndarray, root_key: int) -> tuple[int, int]:
        """How many leading blocks a seen prompt shares with this one, and that prompt's record number."""
        slots = self._fingerprints.find(fingerprints)
        known = int(np.argmin(slots >= 0)) if (slots < 0).any() else len(slots)
        if known == 0:
            return 0, -1
        number = int(self._fingerprints.values[slots[known - 1], 0])
        record = self._records[number]
        end = known * self.block_size
        if record.root_key != root_key or len(record.token_ids) < end or not np.array_equal(record.token_ids[:end], tokens[:end]):
            return 0, -1  # a fingerprint collision: hash from scratch
        return known, number

    def _hash(self, tokens: np.ndarray, start_block: int, parent_key: int) -> np.ndarray:
        data = tokens[start_block * self.block_size :].astype("<u4", copy=False).tobytes()
        keys = packed_block_keys(data, self.block_size, parent_key)
        self.num_hashed_blocks += len(keys)
        return np.fromiter(keys, dtype=np.uint64, count=len(keys))

    def _store(self, record: _Record, fingerprints: np.ndarray, num_young: int) -> None:
        """Point every block's fingerprint at ``record``; the first ``num_young`` already point
        at a young record with the same prefix (so the young generation stays prefix-closed)."""
        if self._num_young_blocks + len(fingerprints) > self.max_blocks:
            self._records = {n: r for n, r in self._records.items() if n >= self._young_from}
            self._young_from = self._next_record
            self._num_young_blocks = 0
            self._fingerprints.compact()
            num_young = 0
        number = self._next_record
        self._next_record += 1
        self._records[number] = record
        slots = self._fingerprints.insert(fingerprints[num_young:])
        self._fingerprints.values[slots, 0] = number
        self._num_young_blocks += len(fingerprints) - num_young

    def _young(self, table: KeyTable) -> np.ndarray:
        """Rows a compaction keeps: fingerprints of records still kept (young, or old before a turnover)."""
        return table.values[:, 0] >= np.uint64(min(self._records, default=self._next_record))
