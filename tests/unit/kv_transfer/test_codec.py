"""The block codec: round-trip error, byte identity with the engine's pool, head slices, out=."""

from dataclasses import replace

import pytest
import torch

from engine.kv_cache import PagedKVCache
from kv_store.layout import KVBlockLayout
from kv_transfer.codec import dequantize_blocks, quantize_blocks
from kv_transfer.segments import head_slice_ranges

# head_dim 6, block_size 5: fp8 payload 540 bytes, so 4 padding bytes before the scales.
ODD = dict(num_layers=3, num_kv_heads=3, head_dim=6, block_size=5)
DTYPES = ("fp8_e4m3", "bf16", "fp32")


def _random_kv(layout: KVBlockLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """Values over six orders of magnitude, one magnitude per (block, head), plus an all-zero head."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, *layout.payload_shape, generator=g)
    magnitudes = torch.logspace(-3, 3, num_blocks * layout.num_kv_heads).view(num_blocks, layout.num_kv_heads)
    kv *= magnitudes[:, :, None, None, None, None]
    kv[0, -1] = 0.0
    return kv


def _padding_bytes(blocks: torch.Tensor, layout: KVBlockLayout) -> torch.Tensor:
    end_of_scales = layout.scales_offset + layout.scale_bytes
    return torch.cat([blocks[:, layout.payload_bytes : layout.scales_offset], blocks[:, end_of_scales:]], dim=1)


def test_fp8_round_trip_within_half_an_e4m3_step():
    layout = KVBlockLayout(**ODD, kv_dtype="fp8_e4m3")
    kv = _random_kv(layout, 4)
    blocks = quantize_blocks(kv, layout)
    assert blocks.dtype == torch.uint8 and blocks.shape == (4, layout.block_bytes)
    back = dequantize_blocks(blocks, layout)
    scales = kv.flatten(4).abs().amax(-1) / 448
    # normals: half an ulp is 2^-4 of the value; subnormals: half their spacing, 2^-10 of the scale
    bound = torch.maximum(kv.abs() * 2.0**-4, scales[..., None, None] * 2.0**-10)
    assert ((back - kv).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(back[0, -1], torch.zeros_like(back[0, -1]))
    # the group's largest value survives exactly: scale = amax / 448 maps it onto 448
    torch.testing.assert_close(back.flatten(4).abs().amax(-1), kv.flatten(4).abs().amax(-1), rtol=1e-6, atol=0)


def test_bf16_round_trip_within_half_a_bf16_step_and_fp32_is_exact():
    bf16 = KVBlockLayout(**ODD, kv_dtype="bf16")
    kv = _random_kv(bf16, 3)
    back = dequantize_blocks(quantize_blocks(kv, bf16), bf16)
    assert ((back - kv).abs() <= kv.abs() * 2.0**-8).all()
    fp32 = KVBlockLayout(**ODD, kv_dtype="fp32")
    assert torch.equal(dequantize_blocks(quantize_blocks(kv, fp32), fp32), kv)


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_blocks_are_byte_identical_to_the_engine_pool(kv_dtype, compute_dtype):
    layout = KVBlockLayout(**ODD, kv_dtype=kv_dtype)
    cache = PagedKVCache(layout, num_blocks=8, compute_dtype=torch.float32)
    kv = _random_kv(layout, 3, seed=1).to(compute_dtype)
    block_ids = torch.tensor([6, 2, 3])
    # PagedKVCache.write takes tokens [num_tokens, layers, kv_heads, head_dim]: fill the three blocks at once
    tokens = kv.permute(0, 4, 2, 3, 1, 5)  # [blocks, block_size, layers, 2, kv_heads, head_dim]
    tokens = tokens.reshape(3 * layout.block_size, layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
    cache.write(
        tokens[:, :, 0],
        tokens[:, :, 1],
        block_ids.repeat_interleave(layout.block_size),
        torch.arange(layout.block_size).repeat(3),
    )
    blocks = quantize_blocks(kv, layout)
    assert torch.equal(blocks, cache.buffer[block_ids])
    assert not _padding_bytes(blocks, layout).any()
    # and the engine's attention reads back what dequantize_blocks decodes
    decoded = dequantize_blocks(cache.buffer[block_ids], layout)
    for layer in range(layout.num_layers):
        k, v = cache.gather(layer, block_ids[None, :])
        want = decoded[:, :, layer].permute(1, 2, 0, 3, 4).reshape(layout.num_kv_heads, 2, -1, layout.head_dim)
        assert torch.equal(k[0], want[:, 0]) and torch.equal(v[0], want[:, 1])


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("heads", [(0, 1), (1, 3), (2, 3)])
def test_a_head_slice_encodes_to_the_same_bytes_as_that_slice_of_the_whole_block(kv_dtype, heads):
    head_start, head_end = heads
    layout = KVBlockLayout(**ODD, kv_dtype=kv_dtype)
    kv = _random_kv(layout, 2, seed=2)
    whole = quantize_blocks(kv, layout)
    shard_layout = replace(layout, num_kv_heads=head_end - head_start)
    shard = quantize_blocks(kv[:, head_start:head_end], shard_layout)
    shard_ranges, whole_ranges = head_slice_ranges(layout, head_start, head_end)
    assert len(shard_ranges) == (2 if layout.has_scales else 1)
    for s, w in zip(shard_ranges, whole_ranges):
        assert torch.equal(shard[:, s.start : s.stop], whole[:, w.start : w.stop])
    payload, _ = layout.head_ranges(head_start, head_end)
    assert whole_ranges[0] == payload


def test_quantize_into_a_slice_of_a_pool_overwrites_padding_and_leaves_other_blocks():
    layout = KVBlockLayout(**ODD, kv_dtype="fp8_e4m3")
    pool = torch.full((6, layout.block_bytes), 0xAB, dtype=torch.uint8)
    kv = _random_kv(layout, 2, seed=3)
    out = quantize_blocks(kv, layout, out=pool[2:4])
    assert out.data_ptr() == pool[2].data_ptr()
    assert torch.equal(pool[2:4], quantize_blocks(kv, layout))
    assert (pool[:2] == 0xAB).all() and (pool[4:] == 0xAB).all()


def test_many_blocks_encode_as_each_block_alone():
    layout = KVBlockLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, kv_dtype="fp8_e4m3")
    kv = _random_kv(layout, 40, seed=4)  # more blocks than one encoding chunk
    blocks = quantize_blocks(kv, layout)
    assert all(torch.equal(blocks[i : i + 1], quantize_blocks(kv[i : i + 1], layout)) for i in (0, 17, 39))


def test_dequantize_to_bfloat16():
    layout = KVBlockLayout(**ODD, kv_dtype="fp8_e4m3")
    blocks = quantize_blocks(_random_kv(layout, 2), layout)
    as_bf16 = dequantize_blocks(blocks, layout, torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, dequantize_blocks(blocks, layout).bfloat16())


def test_bad_arguments_name_the_problem():
    layout = KVBlockLayout(**ODD, kv_dtype="fp8_e4m3")
    kv = _random_kv(layout, 2)
    with pytest.raises(ValueError, match=r"kv: expected shape \[n, 3, 3, 2, 5, 6\]"):
        quantize_blocks(kv[:, :2], layout)
    with pytest.raises(ValueError, match="kv: must be float32, bfloat16 or float16, got torch.int32"):
        quantize_blocks(kv.to(torch.int32), layout)
    with pytest.raises(ValueError, match="kv: must be float32, bfloat16 or float16, got torch.float64"):
        quantize_blocks(kv.double(), layout)
    with pytest.raises(ValueError, match="out: expected uint8"):
        quantize_blocks(kv, layout, out=torch.empty(2, layout.block_bytes, dtype=torch.int8))
    with pytest.raises(ValueError, match="out: must hold kv's 2 blocks"):
        quantize_blocks(kv, layout, out=torch.empty(3, layout.block_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out: must be contiguous"):
        quantize_blocks(kv, layout, out=torch.empty(4, layout.block_bytes, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match=rf"buf: expected uint8 \[n, {layout.block_bytes}\]"):
        dequantize_blocks(torch.empty(2, layout.block_bytes - 8, dtype=torch.uint8), layout)
    with pytest.raises(ValueError, match="dtype: must be a floating dtype"):
        dequantize_blocks(quantize_blocks(kv, layout), layout, torch.int32)
