"""Which bytes of two block pools a block write copies, as few contiguous segments as possible.

A write maps local block ``local_block_ids[i]`` to remote block ``remote_block_ids[i]``, whole or
restricted to byte ranges within each block (a tensor-parallel rank's heads). Segment offsets are
relative to each pool's start; a segment that continues the previous one on both sides merges::

    local  ids 4 5 6 9      blocks 4,5,6 -> 10,11,12 are one run of 3 * block_bytes;
    remote ids 10 11 12 2   block 9 -> 2 is a segment of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from kv_store.layout import KVBlockLayout
from kv_transfer.errors import KVTransferError


def plan_segments(
    local_block_ids: Sequence[int],
    remote_block_ids: Sequence[int],
    *,
    local_num_blocks: int,
    local_block_bytes: int,
    remote_num_blocks: int,
    remote_block_bytes: int,
    byte_ranges: Sequence[range] | None = None,
    remote_byte_ranges: Sequence[range] | None = None,
) -> np.ndarray:
    """``int64 [k, 3]`` rows ``(local_offset, remote_offset, num_bytes)``, coalesced, in local order.

    ``byte_ranges`` (ranges within a local block) defaults to the whole block; ``remote_byte_ranges``
    (within a remote block, pairwise the same lengths) defaults to ``byte_ranges``. Raises
    KVTransferError naming the problem for ids out of range, a remote block written twice, or
    ranges that fall outside a block, overlap or differ in length.
    """
    local_ids = _block_ids(local_block_ids, local_num_blocks, "local_block_ids")
    remote_ids = _block_ids(remote_block_ids, remote_num_blocks, "remote_block_ids")
    if len(local_ids) != len(remote_ids):
        raise KVTransferError(f"local_block_ids ({len(local_ids)}) and remote_block_ids ({len(remote_ids)}) differ in length")
    if len(np.unique(remote_ids)) != len(remote_ids):
        raise KVTransferError(f"remote_block_ids: a block appears twice in {remote_ids.tolist()}")
    if byte_ranges is None and remote_byte_ranges is None:
        if local_block_bytes != remote_block_bytes:
            raise KVTransferError(
                f"block_bytes differ (local {local_block_bytes}, remote {remote_block_bytes}): pass byte_ranges"
            )
        byte_ranges = [range(local_block_bytes)]
    elif byte_ranges is None:
        raise KVTransferError("remote_byte_ranges given without byte_ranges")
    local_starts, lengths = _ranges(byte_ranges, local_block_bytes, "byte_ranges")
    remote_starts, remote_lengths = _ranges(
        byte_ranges if remote_byte_ranges is None else remote_byte_ranges, remote_block_bytes, "remote_byte_ranges"
    )
    if not np.array_equal(lengths, remote_lengths):
        raise KVTransferError(
            f"byte_ranges and remote_byte_ranges differ in lengths: {lengths.tolist()} vs {remote_lengths.tolist()}"
        )
    order = np.argsort(local_ids, kind="stable")
    local = (local_ids[order, None] * local_block_bytes + local_starts).ravel()
    remote = (remote_ids[order, None] * remote_block_bytes + remote_starts).ravel()
    sizes = np.tile(lengths, len(order))
    if len(sizes) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    continues = (local[1:] == local[:-1] + sizes[:-1]) & (remote[1:] == remote[:-1] + sizes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return np.stack([local[starts], remote[starts], np.add.reduceat(sizes, starts)], axis=1)


def head_slice_ranges(layout: KVBlockLayout, head_start: int, head_end: int) -> tuple[list[range], list[range]]:
    """Byte ranges (in the shard's own block, in a whole block) of heads [head_start, head_end).

    The shard's block is laid out by ``layout`` with ``head_end - head_start`` heads: what a
    tensor-parallel rank holds. Pass the pair as ``(byte_ranges, remote_byte_ranges)`` to write
    a rank's blocks into the matching heads of a decode worker's whole blocks.
    """
    whole_payload, whole_scales = layout.head_ranges(head_start, head_end)
    shard = replace(layout, num_kv_heads=head_end - head_start)
    shard_payload, shard_scales = shard.head_ranges(0, shard.num_kv_heads)
    pairs = [(shard_payload, whole_payload), (shard_scales, whole_scales)]
    return [s for s, _ in pairs if len(s)], [w for s, w in pairs if len(s)]


def _block_ids(block_ids: Sequence[int], num_blocks: int, name: str) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if len(bad):
        raise KVTransferError(f"{name}: {bad.tolist()} outside the pool's blocks [0, {num_blocks})")
    return ids


def _ranges(byte_ranges: Sequence[range], block_bytes: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of sorted, disjoint, non-empty ranges within a block."""
    if not byte_ranges:
        raise KVTransferError(f"{name}: empty; pass None for whole blocks")
    end = 0
    for r in byte_ranges:
        if not isinstance(r, range) or r.step != 1 or len(r) == 0:
            raise KVTransferError(f"{name}: {r!r} is not a non-empty range with step 1")
        if r.start < 0 or r.stop > block_bytes:
            raise KVTransferError(f"{name}: {r!r} leaves the block [0, {block_bytes})")
        if r.start < end:
            raise KVTransferError(f"{name}: {r!r} overlaps or precedes the range before it; sort them")
        end = r.stop
    return (np.array([r.start for r in byte_ranges], dtype=np.int64), np.array([len(r) for r in byte_ranges], dtype=np.int64))
