import torch

from kv_store.fp8 import FP8_DTYPE, FP8_E4M3_MAX, dequantize_fp8, fp8_scales, quantize_fp8
from kv_store.layout import KVBlockLayout

E4M3_REL_ERR = 2.0**-4  # 3 mantissa bits: half an ulp is 2^-4 of the value


def test_round_trip_within_e4m3_relative_error():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 2, 16, 64) * torch.logspace(-3, 3, 3)[:, None, None, None, None]
    scales = fp8_scales(x, num_group_dims=3)
    assert scales.shape == (3, 5, 2)
    y = dequantize_fp8(quantize_fp8(x, scales), scales)
    normal = x.abs() > scales[..., None, None] * 2.0**-6  # outside e4m3's subnormal range
    rel = ((y - x).abs() / x.abs())[normal]
    assert rel.max() <= E4M3_REL_ERR + 1e-6
    torch.testing.assert_close(y.abs().amax(dim=(-1, -2)), x.abs().amax(dim=(-1, -2)), rtol=1e-6, atol=0)


def test_saturates_instead_of_overflowing():
    x = torch.tensor([[1.0, -1000.0, 1000.0, float("inf"), -float("inf")]])
    q = quantize_fp8(x, torch.ones(1))
    assert q.dtype == FP8_DTYPE
    assert q.float().tolist() == [[1.0, -FP8_E4M3_MAX, FP8_E4M3_MAX, FP8_E4M3_MAX, -FP8_E4M3_MAX]]


def test_zero_group_gets_unit_scale():
    x = torch.zeros(2, 4)
    scales = fp8_scales(x, 1)
    assert scales.tolist() == [1.0, 1.0]
    assert torch.equal(dequantize_fp8(quantize_fp8(x, scales), scales), x)


def test_layout_bytes_and_head_slices():
    layout = KVBlockLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, kv_dtype="fp8_e4m3")
    assert layout.payload_bytes == 3 * 30 * 2 * 16 * 64
    assert layout.scale_bytes == 3 * 30 * 2 * 4
    assert layout.block_bytes == layout.payload_bytes + layout.scale_bytes
    payload, scales = layout.head_ranges(1, 3)
    assert (payload.start, payload.stop) == (layout.head_bytes, 3 * layout.head_bytes)
    assert (scales.start, scales.stop) == (layout.payload_bytes + 240, layout.payload_bytes + 720)
    bf16 = KVBlockLayout(30, 3, 64, 16, "bf16")
    assert bf16.block_bytes == 3 * 30 * 2 * 16 * 64 * 2 and bf16.scale_bytes == 0
    # fp8 is half of bf16 on the wire, trailer included
    assert layout.block_bytes / bf16.block_bytes < 0.51


def test_bit_moving_conversion_equals_torch_cast_for_every_code():
    from kv_store.fp8 import fp8_to_float

    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)
    finite = ~torch.isnan(codes.float())
    assert torch.equal(fp8_to_float(codes)[finite], codes.float()[finite])
    assert torch.equal(fp8_to_float(codes, torch.bfloat16)[finite], codes.float()[finite].bfloat16())


def test_dequantize_with_huge_scales_does_not_overflow():
    x = torch.tensor([[1.0e6, -3.0e5, 0.5]])
    scales = fp8_scales(x, 1)
    assert scales.item() > 2**8
    y = dequantize_fp8(quantize_fp8(x, scales), scales)
    assert torch.isfinite(y).all()
    assert torch.allclose(y[0, :2], x[0, :2], rtol=2**-4)
