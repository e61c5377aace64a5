"""The router's block keys of a prompt, hashed once: turns of a session reuse their prefix's keys.

The keys are kv_store.keys' chained XXH3 (the workers' keys): ``key_i = H(key_{i-1}, block_i)``.
Chaining makes hashing sequential, one Python step per block (2,048 at 32k tokens on 16-token
blocks), so the router remembers the keys of recent prompts and, for a new prompt, hashes only
the blocks past the longest prefix it has seen. Finding that prefix must not itself cost a step
per block, so every ``_STRIDE``-th block (a checkpoint) gets a *fingerprint* of the prefix up to
it, chained over checkpoints' worth of tokens (1 KiB at 16-token blocks), 16x fewer steps::

    fp_c = XXH3_64(tokens of blocks [c*S, (c+1)*S), seed=fp_{c-1})      fp_{-1} = the root key

A seen prompt remembers ``fp_c -> its record`` at every checkpoint (128 dict entries for 2,048
blocks), so a binary search over a new prompt's checkpoints finds a seen prompt that shares a
prefix with it; one numpy compare of the two prompts' tokens then gives the exact shared length,
so a fingerprint collision costs a rehash, never a wrong key (which is why a fingerprint may be
a seeded hash, where the block keys may not). Records live in two generations of ``max_blocks``
blocks' worth of checkpoints each (the default: 2M tokens of 16-token blocks): when the young one
fills, the old one is dropped. Keys come back as a uint64 array, the form the prefix index looks
up.

All of this is for the Python chain. Where kv_store's C extension is built, hashing every block
of a 32k-token prompt takes ~20 us, less than the checkpoints alone, so the hasher hashes each
prompt whole and remembers nothing (``reuse``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np
import xxhash

from kv_store.keys import NATIVE_CHAIN, packed_block_key_array

_STRIDE = 16
"""Blocks between two checkpoints: block ``i`` is one when ``(i + 1) % _STRIDE == 0``."""
_seeded_xxh3 = xxhash.xxh3_64_intdigest


@dataclass(frozen=True)
class _Record:
    root_key: int
    token_ids: np.ndarray
    """The prompt's full blocks' tokens, uint32."""
    keys: np.ndarray
    """Their block keys, uint64."""
    checkpoints: list[int]
    """Their prefix fingerprints, one per checkpoint."""


@dataclass(frozen=True)
class _Seen:
    record: _Record
    num_tokens: int
    """Tokens the record's prompt shares with this one from the start."""


class BlockHasher:
    """Block keys of prompts for one block size, reusing the keys of recent prompts' prefixes."""

    def __init__(self, block_size: int, max_blocks: int = 131_072, reuse: bool | None = None) -> None:
        """``reuse``: remember recent prompts and hash only the blocks past a seen prefix. By
        default only where the keys come from Python: the C chain (``kv_store.keys.NATIVE_CHAIN``)
        hashes 2,048 blocks in ~20 us, less than fingerprinting and remembering a prompt costs."""
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks: must be >= 1, got {max_blocks}")
        self.block_size = block_size
        self.reuse = not NATIVE_CHAIN if reuse is None else reuse
        self.max_checkpoints = max(1, max_blocks // _STRIDE)
        self._young: dict[int, int] = {}
        """Checkpoint fingerprint -> record number: ints only, so the garbage collector never walks it."""
        self._old: dict[int, int] = {}
        self._young_records: dict[int, _Record] = {}
        self._old_records: dict[int, _Record] = {}
        self._next_record = 0
        self._checkpoint_dtype = np.dtype((np.void, 4 * block_size * _STRIDE))
        """One checkpoint's worth of little-endian u32 tokens as one numpy item (a bytes object)."""
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
        if not self.reuse:
            return self._hash(tokens, 0, root_key)
        checkpoints, seen = self._checkpoints(tokens, root_key)
        shared, record = self._longest_shared(checkpoints, tokens, root_key, seen)
        reused = record.keys[:shared] if shared else np.zeros(0, dtype=np.uint64)
        keys = np.concatenate([reused, self._hash(tokens, shared, int(reused[-1]) if shared else root_key)])
        self._store(_Record(root_key, tokens, keys, checkpoints))
        return keys

    def _checkpoints(self, tokens: np.ndarray, root_key: int) -> tuple[list[int], _Seen | None]:
        """The prefix fingerprint at each checkpoint block of ``tokens`` (uint32, full blocks),
        and the latest seen prompt through the first checkpoint (a session's previous turn, most
        often) with the tokens it shares: it lends the fingerprints of the checkpoints whose
        tokens it shares, so the chain only runs over the rest."""
        per_checkpoint = self.block_size * _STRIDE
        num_checkpoints = len(tokens) // per_checkpoint
        if num_checkpoints == 0:
            return [], None
        checkpoints = [_seeded_xxh3(tokens[:per_checkpoint].astype("<u4", copy=False), root_key)]
        record = self._lookup(checkpoints[0])
        seen = None
        if record is not None and record.root_key == root_key:
            seen = _Seen(record, shared_prefix_length(record.token_ids, tokens))
            checkpoints = record.checkpoints[: min(seen.num_tokens // per_checkpoint, num_checkpoints)] or checkpoints
        rest = tokens[len(checkpoints) * per_checkpoint : num_checkpoints * per_checkpoint].astype("<u4", copy=False)
        chunks = np.frombuffer(rest, dtype=self._checkpoint_dtype).tolist()
        fingerprint = checkpoints[-1]
        return checkpoints + [fingerprint := _seeded_xxh3(chunk, fingerprint) for chunk in chunks], seen

    def _lookup(self, fingerprint: int) -> _Record | None:
        number = self._young.get(fingerprint)
        if number is not None:
            return self._young_records[number]
        number = self._old.get(fingerprint)
        return self._old_records[number] if number is not None else None

    def _longest_shared(self, checkpoints: list[int], tokens: np.ndarray, root_key: int, seen: _Seen | None) -> tuple[int, _Record | None]:
        """Blocks this prompt shares from its start with a seen prompt, and that prompt's record.
        Checkpoints find the record; its tokens say how far it matches (``seen`` has counted
        that already when it is the same record)."""
        low, high = 0, len(checkpoints)  # checkpoints [0, low) known; [high, ...) not
        while low < high:
            middle = (low + high + 1) // 2
            if self._lookup(checkpoints[middle - 1]) is not None:
                low = middle
            else:
                high = middle - 1
        if low == 0:
            return 0, None
        record = self._lookup(checkpoints[low - 1])
        if record.root_key != root_key:
            return 0, None
        num_tokens = seen.num_tokens if seen is not None and seen.record is record else shared_prefix_length(record.token_ids, tokens)
        return num_tokens // self.block_size, record

    def _hash(self, tokens: np.ndarray, start_block: int, parent_key: int) -> np.ndarray:
        keys = packed_block_key_array(tokens[start_block * self.block_size :].astype("<u4", copy=False), self.block_size, parent_key)
        self.num_hashed_blocks += len(keys)
        return keys

    def _store(self, record: _Record) -> None:
        """Point every checkpoint of ``record`` at it: a checkpoint names the latest prompt
        through it, the one that goes on furthest (and the young generation stays prefix-closed)."""
        if len(self._young) + len(record.checkpoints) > self.max_checkpoints:
            self._old, self._young = self._young, {}
            self._old_records, self._young_records = self._young_records, {}
        number = self._next_record
        self._next_record += 1
        self._young_records[number] = record
        self._young.update(zip(record.checkpoints, repeat(number)))


def shared_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading items two arrays share (two prompts' tokens, or their block keys)."""
    end = min(len(a), len(b))
    differ = np.flatnonzero(a[:end] != b[:end])
    return int(differ[0]) if len(differ) else end
