"""Descriptor planning: exact coalesced segments, head-slice ranges, and the inputs it refuses."""

import numpy as np
import pytest

from kv_store.layout import KVBlockLayout
from kv_transfer.errors import KVTransferError
from kv_transfer.segments import head_slice_ranges, plan_segments

POOLS = dict(local_num_blocks=16, local_block_bytes=100, remote_num_blocks=16, remote_block_bytes=100)


def _plan(local, remote, **kwargs):
    return plan_segments(local, remote, **{**POOLS, **kwargs}).tolist()


def test_runs_consecutive_on_both_sides_become_one_segment():
    assert _plan([4, 5, 6, 9], [10, 11, 12, 2]) == [[400, 1000, 300], [900, 200, 100]]


def test_a_run_on_one_side_only_stays_split():
    assert _plan([1, 2, 3], [5, 7, 8]) == [[100, 500, 100], [200, 700, 200]]


def test_blocks_are_ordered_by_local_id_before_coalescing():
    assert _plan([6, 4, 5], [12, 10, 11]) == [[400, 1000, 300]]


def test_byte_ranges_split_blocks_and_merge_across_a_block_boundary():
    ranges = [range(0, 10), range(90, 100)]
    # block 1's tail [190, 200) and block 2's head [200, 210) are contiguous on both sides
    assert _plan([1, 2], [3, 4], byte_ranges=ranges) == [[100, 300, 10], [190, 390, 20], [290, 490, 10]]


def test_remote_ranges_map_a_shard_block_into_a_wider_block():
    plan = plan_segments(
        [0, 1],
        [5, 6],
        local_num_blocks=2,
        local_block_bytes=40,
        remote_num_blocks=8,
        remote_block_bytes=100,
        byte_ranges=[range(0, 30), range(32, 36)],
        remote_byte_ranges=[range(30, 60), range(92, 96)],
    )
    assert plan.tolist() == [[0, 530, 30], [32, 592, 4], [40, 630, 30], [72, 692, 4]]


def test_no_blocks_is_no_segments():
    plan = plan_segments([], [], **POOLS)
    assert plan.shape == (0, 3) and plan.dtype == np.int64


def test_head_slice_ranges_of_an_fp8_block():
    layout = KVBlockLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, kv_dtype="fp8_e4m3")
    shard, whole = head_slice_ranges(layout, 1, 3)
    head, per_head_scales = layout.head_bytes, 30 * 2 * 4
    # the shard block: 2 heads of payload, then their scales at the shard's own scales offset
    assert shard == [range(0, 2 * head), range(2 * head, 2 * head + 2 * per_head_scales)]
    assert whole == [range(head, 3 * head), range(3 * head + per_head_scales, 3 * head + 3 * per_head_scales)]


def test_head_slice_ranges_without_scales():
    layout = KVBlockLayout(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, kv_dtype="bf16")
    head = layout.head_bytes
    assert head_slice_ranges(layout, 2, 3) == ([range(0, head)], [range(2 * head, 3 * head)])


@pytest.mark.parametrize(
    ("local", "remote", "kwargs", "message"),
    [
        ([0, 16], [1, 2], {}, r"local_block_ids: \[16\] outside the pool's blocks \[0, 16\)"),
        ([0, 1], [-1, 2], {}, r"remote_block_ids: \[-1\] outside"),
        ([0, 1], [2], {}, r"local_block_ids \(2\) and remote_block_ids \(1\) differ in length"),
        ([0, 1], [3, 3], {}, "remote_block_ids: a block appears twice"),
        ([0], [1], {"remote_block_bytes": 120}, r"block_bytes differ \(local 100, remote 120\): pass byte_ranges"),
        ([0], [1], {"byte_ranges": [range(90, 101)]}, r"byte_ranges: range\(90, 101\) leaves the block \[0, 100\)"),
        ([0], [1], {"byte_ranges": [range(0, 10), range(5, 20)]}, r"byte_ranges: range\(5, 20\) overlaps"),
        ([0], [1], {"byte_ranges": [range(0, 10, 2)]}, "not a non-empty range with step 1"),
        ([0], [1], {"byte_ranges": [range(3, 3)]}, "not a non-empty range with step 1"),
        ([0], [1], {"byte_ranges": []}, "byte_ranges: empty"),
        ([0], [1], {"remote_byte_ranges": [range(0, 10)]}, "remote_byte_ranges given without byte_ranges"),
        (
            [0],
            [1],
            {"byte_ranges": [range(0, 10)], "remote_byte_ranges": [range(0, 12)]},
            r"differ in lengths: \[10\] vs \[12\]",
        ),
    ],
)
def test_bad_plans_raise_naming_the_problem(local, remote, kwargs, message):
    with pytest.raises(KVTransferError, match=message):
        plan_segments(local, remote, **{**POOLS, **kwargs})
