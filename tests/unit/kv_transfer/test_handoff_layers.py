"""Hand-offs between replicas split in pipeline stages as well as TP ranks: every (layer, KV head)
a decode rank holds is written exactly once, from the first prefill rank holding it, and the
byte ranges of each write move exactly those layers' payload and FP8 scales.

The check moves real bytes: a model-wide block of random bytes is cut into each prefill rank's
block (its layers x its heads, in the head-major layout of kv_store/layout.py), the plan's writes
copy ranges rank to rank as NIXL would (kv_transfer/segments.py), and each decode rank's block
must equal the model-wide block cut to its layers and heads.
"""

from __future__ import annotations

import numpy as np
import pytest

from kv_store.layout import KVBlockLayout
from kv_transfer.errors import HandOffError
from kv_transfer.handoff import head_byte_ranges, plan_writes
from kv_transfer.segments import plan_segments

NUM_LAYERS, HEAD_DIM, BLOCK_SIZE = 6, 4, 2


def _shards(num_heads: int, pp: int, tp: int, cuts: tuple[int, ...] | None = None) -> list[tuple[range, range]]:
    """Each rank's (layers, heads), rank = stage * tp + tp rank, heads replicated when fewer than ranks."""
    cuts = cuts or tuple(NUM_LAYERS * s // pp for s in range(1, pp))
    bounds = [0, *cuts, NUM_LAYERS]
    out = []
    for s in range(pp):
        for r in range(tp):
            if tp > num_heads:
                per = tp // num_heads
                heads = range(r // per, r // per + 1)
            else:
                heads = range(r * num_heads // tp, (r + 1) * num_heads // tp)
            out.append((range(bounds[s], bounds[s + 1]), heads))
    return out


def _layout(layers: range, heads: range, kv_dtype: str) -> KVBlockLayout:
    return KVBlockLayout(len(layers), len(heads), HEAD_DIM, BLOCK_SIZE, kv_dtype)


def _cut(whole: np.ndarray, full: KVBlockLayout, layers: range, heads: range, kv_dtype: str) -> np.ndarray:
    """The block a rank holding ``layers`` x ``heads`` has, cut from the model-wide block."""
    part = _layout(layers, heads, kv_dtype)
    out = np.zeros(part.block_bytes, dtype=np.uint8)
    payload = whole[: full.payload_bytes].reshape(full.payload_shape[0], full.num_layers, -1)
    out[: part.payload_bytes] = payload[heads.start : heads.stop, layers.start : layers.stop].reshape(-1)
    if full.has_scales:
        scales = whole[full.scales_offset : full.scales_offset + full.scale_bytes].reshape(full.num_kv_heads, full.num_layers, -1)
        out[part.scales_offset : part.scales_offset + part.scale_bytes] = scales[heads.start : heads.stop, layers.start : layers.stop].reshape(-1)
    return out


def _whole_or_none(shards: list[tuple[range, range]]) -> tuple:
    return tuple((None if layers == range(NUM_LAYERS) else layers, heads) for layers, heads in shards)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3"])
@pytest.mark.parametrize(
    "prefill, decode",
    [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 3), (2, 1)), ((2, 1), (1, 3)), ((2, 3), (3, 1)), ((3, 2), (2, 3)), ((2, 4), (1, 2)), ((1, 1), (6, 1))],
    ids=lambda shape: f"pp{shape[0]}xtp{shape[1]}",
)
def test_every_layer_and_head_lands_once_from_its_first_holder(kv_dtype, prefill, decode):
    num_heads = 3 if 3 in (prefill[1], decode[1]) else 2
    p_shards, d_shards = _shards(num_heads, *prefill), _shards(num_heads, *decode)
    full = KVBlockLayout(NUM_LAYERS, num_heads, HEAD_DIM, BLOCK_SIZE, kv_dtype)
    whole = np.random.default_rng(7).integers(0, 256, full.block_bytes, dtype=np.uint8)
    p_blocks = [_cut(whole, full, layers, heads, kv_dtype) for layers, heads in p_shards]
    d_blocks = [np.zeros(_layout(layers, heads, kv_dtype).block_bytes, dtype=np.uint8) for layers, heads in d_shards]
    writes = plan_writes(_whole_or_none(p_shards), _whole_or_none(d_shards), NUM_LAYERS)
    written: dict[int, list[tuple[int, int]]] = {}
    for w in writes:
        p_layers, p_heads = p_shards[w.prefill_rank]
        d_layers, d_heads = d_shards[w.decode_rank]
        layers = w.layers if w.layers is not None else range(NUM_LAYERS)
        assert set(layers) <= set(p_layers) and set(w.heads) <= set(p_heads)
        # the first holder: no lower prefill rank holds any of these (layer, head)
        assert not any(set(layers) & set(pl) and set(w.heads) & set(ph) for pl, ph in p_shards[: w.prefill_rank])
        written.setdefault(w.decode_rank, []).extend((l, h) for l in layers for h in w.heads)
        local, remote = _layout(p_layers, p_heads, kv_dtype), _layout(d_layers, d_heads, kv_dtype)
        ours, theirs = head_byte_ranges(local, p_heads, remote, d_heads, w.heads, w.layers, p_layers, d_layers)
        for row in plan_segments([0], [0], local_num_blocks=1, local_block_bytes=local.block_bytes, remote_num_blocks=1,
                                 remote_block_bytes=remote.block_bytes, byte_ranges=ours, remote_byte_ranges=theirs):
            src, dst, n = (int(x) for x in row)
            d_blocks[w.decode_rank][dst : dst + n] = p_blocks[w.prefill_rank][src : src + n]
    for d, (layers, heads) in enumerate(d_shards):
        assert sorted(written[d]) == sorted((l, h) for l in layers for h in heads)  # each once
        into = [w for w in writes if w.decode_rank == d]
        assert sorted(w.writer_id for w in into) == list(range(len(into))) or all(w.writer is None for w in into)
        assert all(w.num_writers == len(into) for w in into)
        assert np.array_equal(d_blocks[d], _cut(whole, full, layers, heads, kv_dtype))


def test_one_stage_each_side_keeps_whole_block_writes_and_prefill_ranks_as_writers():
    writes = plan_writes(((None, range(0, 2)),), ((None, range(0, 1)), (None, range(1, 2))))
    assert [(w.prefill_rank, w.decode_rank, w.layers, w.writer_id) for w in writes] == [(0, 0, None, 0), (0, 1, None, 0)]


def test_a_layer_no_prefill_rank_holds_is_refused_naming_it():
    with pytest.raises(HandOffError, match="decode rank 0 needs layer 5's KV head 0, which no prefill rank holds"):
        plan_writes(((range(0, 3), range(0, 1)), (range(3, 5), range(0, 1))), ((None, range(0, 1)),), NUM_LAYERS)
