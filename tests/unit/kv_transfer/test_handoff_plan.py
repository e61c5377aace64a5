"""Who writes which KV heads between tensor-parallel replicas, and the bytes each write covers."""

import pytest

from kv_store.layout import KVBlockLayout
from kv_transfer.errors import HandOffError
from kv_transfer.handoff import HeadWrite, head_byte_ranges, plan_head_writes
from kv_transfer.segments import plan_segments


def _split(num_heads: int, size: int) -> list[range]:
    """Each rank's KV heads, as engine/parallel/sharding.py splits them (replicated when fewer heads than ranks)."""
    if size > num_heads:
        per_head = size // num_heads
        return [range(r // per_head, r // per_head + 1) for r in range(size)]
    per_rank = num_heads // size
    return [range(r * per_rank, (r + 1) * per_rank) for r in range(size)]


@pytest.mark.parametrize("kv_heads, p, d", [(3, 1, 1), (3, 3, 1), (3, 1, 3), (3, 3, 3), (2, 2, 4), (2, 4, 2), (6, 2, 3), (2, 4, 4)])
def test_every_decode_head_is_written_exactly_once(kv_heads, p, d):
    prefill, decode = _split(kv_heads, p), _split(kv_heads, d)
    writes = plan_head_writes(prefill, decode)
    for rank, wanted in enumerate(decode):
        into = [w for w in writes if w.decode_rank == rank]
        written = sorted(h for w in into for h in w.heads)
        assert written == list(wanted)
        assert all(w.num_writers == len(into) for w in into)
        assert all(set(w.heads) <= set(prefill[w.prefill_rank]) for w in into)


def test_replicated_heads_are_shipped_by_the_first_rank_holding_them():
    writes = plan_head_writes(_split(2, 4), _split(2, 2))  # P4 holds 0,0,1,1
    assert writes == [HeadWrite(0, 0, range(0, 1), 1), HeadWrite(2, 1, range(1, 2), 1)]


def test_heads_across_rank_boundaries_get_one_write_per_pair():
    writes = plan_head_writes(_split(6, 2), _split(6, 3))  # [0,3) [3,6) into [0,2) [2,4) [4,6)
    assert [(w.prefill_rank, w.decode_rank, w.heads, w.num_writers) for w in writes] == [
        (0, 0, range(0, 2), 1),
        (0, 1, range(2, 3), 2),
        (1, 1, range(3, 4), 2),
        (1, 2, range(4, 6), 1),
    ]


def test_a_head_no_prefill_rank_holds_is_refused():
    with pytest.raises(HandOffError, match="decode rank 1 needs KV head 3, which no prefill rank holds"):
        plan_head_writes([range(0, 3)], [range(0, 2), range(2, 4)])


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3"])
def test_byte_ranges_move_one_head_between_shards_of_different_widths(kv_dtype):
    """Rank heads [1, 3) of a P→D write of head 2 into a decode rank holding [2, 4): the copy of
    the ranges reproduces exactly that head's payload and scales."""
    def layout(num_heads):
        return KVBlockLayout(num_layers=2, num_kv_heads=num_heads, head_dim=4, block_size=2, kv_dtype=kv_dtype)

    local, remote = layout(2), layout(2)
    ours, theirs = head_byte_ranges(local, range(1, 3), remote, range(2, 4), range(2, 3))
    local_pool = bytearray(range(256)) * (local.block_bytes // 256 + 1)
    local_pool = local_pool[: local.block_bytes]
    remote_pool = bytearray(remote.block_bytes)
    for row in plan_segments([0], [0], local_num_blocks=1, local_block_bytes=local.block_bytes,
                             remote_num_blocks=1, remote_block_bytes=remote.block_bytes, byte_ranges=ours, remote_byte_ranges=theirs):
        src, dst, n = (int(x) for x in row)
        remote_pool[dst : dst + n] = local_pool[src : src + n]
    src_payload, src_scales = local.head_ranges(1, 2)  # model head 2 is local head 1
    dst_payload, dst_scales = remote.head_ranges(0, 1)  # and remote head 0
    assert remote_pool[dst_payload.start : dst_payload.stop] == local_pool[src_payload.start : src_payload.stop]
    assert remote_pool[dst_scales.start : dst_scales.stop] == local_pool[src_scales.start : src_scales.stop]
    untouched = set(range(remote.block_bytes)) - set(dst_payload) - set(dst_scales)
    assert all(remote_pool[i] == 0 for i in untouched)


def test_whole_blocks_when_both_sides_hold_exactly_the_heads():
    layout = KVBlockLayout(num_layers=2, num_kv_heads=3, head_dim=4, block_size=2, kv_dtype="fp8_e4m3")
    assert head_byte_ranges(layout, range(0, 3), layout, range(0, 3), range(0, 3)) == (None, None)
