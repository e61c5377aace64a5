"""The Triton paged-attention decode kernel compiled on CUDA: equal to the torch reference, and its bandwidth.

Shapes are a real model's (8 KV heads, 32 query heads, head_dim 128) with contexts that end
mid-block; the bandwidth test prints KV bytes read per second against the HBM peak and a
measured device copy, and asserts nothing about speed.
"""

import pytest
import torch

from bench.kernels import attention_case, copy_bytes_per_s, peak_hbm_bytes_per_s, random_pool
from engine.kernels.paged_attention import paged_decode_attention, reference_paged_decode_attention
from kv_store.layout import KVBlockLayout

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bf16", "fp32"])
@pytest.mark.parametrize("num_splits", [1, None])
def test_kernel_equals_reference_on_cuda(kv_dtype, num_splits):
    layout = KVBlockLayout(num_layers=3, num_kv_heads=8, head_dim=128, block_size=16, kv_dtype=kv_dtype)
    lens = torch.tensor([1, 15, 16, 17, 300, 1029], dtype=torch.int32, device="cuda")
    width = -(-int(lens.max()) // layout.block_size)
    pool = random_pool(layout, num_blocks=len(lens) * width)
    tables = torch.randperm(len(lens) * width, device="cuda").view(len(lens), width).to(torch.int32)
    q = torch.randn(len(lens), 32, 128, device="cuda")
    got = paged_decode_attention(q, pool, layout, 2, tables, lens, num_splits=num_splits)
    expected = reference_paged_decode_attention(q.cpu(), pool.cpu(), layout, 2, tables.cpu(), lens.cpu())
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-3, atol=1e-3)


def test_fp8_without_hardware_conversion_matches_with_it():
    layout = KVBlockLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, kv_dtype="fp8_e4m3")
    pool = random_pool(layout, num_blocks=8)
    tables = torch.arange(8, device="cuda", dtype=torch.int32).view(2, 4)
    lens = torch.tensor([40, 64], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 6, 64, device="cuda")
    native = paged_decode_attention(q, pool, layout, 0, tables, lens, native_fp8=True)
    by_bits = paged_decode_attention(q, pool, layout, 0, tables, lens, native_fp8=False)
    torch.testing.assert_close(by_bits, native, rtol=1e-5, atol=1e-5)


def test_decode_attention_bandwidth_against_hbm_roofline():
    name = torch.cuda.get_device_name()
    peak = peak_hbm_bytes_per_s(name)
    copy_bw = copy_bytes_per_s(1 << 28)
    for case in [("fp8_e4m3", 32, 2048), ("bf16", 32, 2048)]:
        row = attention_case(*case, peak, copy_bw)
        print(f"{name}: {row}")
        assert row["kv_bytes"] > 0 and row["kernel_gb_per_s"] > 0
