"""The Triton paged-attention kernels compiled on CUDA: equal to the torch references, graph-capturable, and their bandwidth.

Shapes are a real model's (8 KV heads, 32 query heads, head_dim 128) with contexts that end
mid-block; the bandwidth test prints KV bytes read per second against the HBM peak and a
measured device copy, and asserts nothing about speed.
"""

import pytest
import torch

from bench.kernels_gpu import attention_case, copy_bytes_per_s, peak_hbm_bytes_per_s, prefill_case, random_pool
from engine.kernels.launches import LaunchCounter
from engine.kernels.paged_attention import paged_decode_attention, reference_paged_decode_attention
from engine.kernels.paged_prefill import paged_prefill_attention, reference_paged_prefill_attention
from kv_store.layout import KVBlockLayout

pytestmark = pytest.mark.gpu
LENS = [0, 1, 15, 16, 17, 300, 1029]  # a padding row, one token, around a block's end, many tiles with a tail


def decode_inputs(kv_dtype: str, lens=LENS, seed: int = 0):
    layout = KVBlockLayout(num_layers=3, num_kv_heads=8, head_dim=128, block_size=16, kv_dtype=kv_dtype)
    lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    width = -(-int(lens.max()) // layout.block_size)
    pool = random_pool(layout, num_blocks=len(lens) * width, seed=seed)
    tables = torch.randperm(len(lens) * width, device="cuda").view(len(lens), width).to(torch.int32)
    return layout, pool, tables, lens


@pytest.mark.parametrize(
    ("kv_dtype", "q_dtype", "num_splits", "tolerance"),
    [
        ("fp8_e4m3", torch.float32, 1, 1e-3),  # IEEE float32 dots
        ("fp8_e4m3", torch.bfloat16, None, 2e-2),  # the engine's case: bf16 dots, splits chosen for the GPU
        ("bf16", torch.bfloat16, None, 2e-2),
        ("fp32", torch.float32, 3, 1e-3),
    ],
)
def test_decode_equals_reference_on_cuda(kv_dtype, q_dtype, num_splits, tolerance):
    layout, pool, tables, lens = decode_inputs(kv_dtype)
    q = torch.randn(len(lens), 32, 128, device="cuda").to(q_dtype)
    got = paged_decode_attention(q, pool, layout, 2, tables, lens, num_splits=num_splits)
    expected = reference_paged_decode_attention(q.cpu(), pool.cpu(), layout, 2, tables.cpu(), lens.cpu())
    assert got.dtype == q_dtype and torch.equal(got[0].cpu(), torch.zeros_like(got[0].cpu()))
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_fp8_without_hardware_conversion_matches_with_it():
    layout = KVBlockLayout(num_layers=1, num_kv_heads=2, head_dim=64, block_size=16, kv_dtype="fp8_e4m3")
    pool = random_pool(layout, num_blocks=8)
    tables = torch.arange(8, device="cuda", dtype=torch.int32).view(2, 4)
    lens = torch.tensor([40, 64], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 6, 64, device="cuda")
    native = paged_decode_attention(q, pool, layout, 0, tables, lens, native_fp8=True)
    by_bits = paged_decode_attention(q, pool, layout, 0, tables, lens, native_fp8=False)
    torch.testing.assert_close(by_bits, native, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_replays_from_a_cuda_graph_with_new_inputs(num_splits):
    """Captured once over static buffers; new queries, tables and lengths (a padding row among them)
    copied in before each replay give what an eager call gives. Two launches at most per call."""
    layout, pool, tables, lens = decode_inputs("fp8_e4m3")
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    static = [t.clone() for t in (q, tables, lens)]
    with LaunchCounter() as launches:
        paged_decode_attention(*static[:1], pool, layout, 1, *static[1:], num_splits=num_splits)  # compiles outside the capture
    assert sum(launches.values()) == (1 if num_splits == 1 else 2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(static[0], pool, layout, 1, static[1], static[2], num_splits=num_splits)
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        new = (torch.randn(q.shape, device="cuda", generator=g).to(q.dtype), tables.flip(0), lens.roll(seed))
        for buffer, value in zip(static, new):
            buffer.copy_(value)
        graph.replay()
        expected = paged_decode_attention(new[0], pool, layout, 1, new[1], new[2], num_splits=num_splits)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize(("kv_dtype", "q_dtype", "tolerance"), [("fp8_e4m3", torch.bfloat16, 2e-2), ("bf16", torch.float32, 1e-3)])
def test_prefill_equals_reference_on_cuda(kv_dtype, q_dtype, tolerance):
    chunks = [(0, 70), (300, 129), (1000, 1)]  # (start, tokens): from 0; behind a prefix, mid-block; one token
    layout = KVBlockLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, kv_dtype=kv_dtype)
    width = -(-max(s + n for s, n in chunks) // layout.block_size)
    pool = random_pool(layout, num_blocks=len(chunks) * width)
    tables = torch.randperm(len(chunks) * width, device="cuda").view(len(chunks), width).to(torch.int32)
    starts = torch.tensor([s for s, _ in chunks], dtype=torch.int32, device="cuda")
    query_starts = torch.tensor([0, 70, 199, 200], dtype=torch.int32, device="cuda")
    q = torch.randn(200, 32, 128, device="cuda").to(q_dtype)
    got = paged_prefill_attention(q, pool, layout, 1, tables, starts, query_starts, max_query_len=129)
    expected = reference_paged_prefill_attention(q.cpu(), pool.cpu(), layout, 1, tables.cpu(), starts.cpu(), query_starts.cpu())
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_attention_bandwidth_against_hbm_roofline():
    name = torch.cuda.get_device_name()
    peak = peak_hbm_bytes_per_s(name)
    copy_bw = copy_bytes_per_s(1 << 28)
    for case in [("fp8_e4m3", 32, 2048), ("bf16", 32, 2048)]:
        row = attention_case(*case, peak, copy_bw)
        print(f"{name}: decode {row}")
        assert row["kv_bytes"] > 0 and row["kernel_gb_per_s"] > 0
    row = prefill_case("fp8_e4m3", 2048, 512)
    print(f"{name}: prefill {row}")
    assert row["faster"] in ("kernel", "sdpa_gathered")
