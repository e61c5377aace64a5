"""``bench.kernels --device cuda``: the Triton paged-attention kernels against torch on a GPU, and 2:4 linears.

**Decode** (``attention``): batch x context 1 x 8k, 32 x 2k and 128 x 1k on Llama-3-8B's heads (8
KV heads of 128, 32 query heads), FP8 and bf16 pools, bf16 queries. Decode attention reads every
context token's K and V once and does little arithmetic with them, so its ceiling is memory
bandwidth: ``KV bytes read / time`` is compared with the GPU's HBM peak (spec sheet) and with a
device-to-device copy measured in the same run (``fraction_of_copy``; a copy counts the bytes it
reads and writes). The kernel is timed as the engine runs it, replayed from a CUDA graph, and
each replay of the graph reads other blocks of a pool 4x the L2 cache, so no call finds its KV
in L2. ``kernel_eager_us`` is the same call from Python, launch overhead included. The peer is
the same attention in torch as an engine without the kernel would run it, eagerly: gather the
blocks, dequantize, SDPA.

**Prefill** (``prefill``): one chunk of 512 new tokens after 2,048 cached ones, read from the
pool by ``paged_prefill_attention`` against SDPA over the gathered, dequantized blocks, both
eager (prefill steps are); each row says which is faster.

**2:4** (``sparse_2_4``): one bf16 linear dense and as ``to_sparse_semi_structured``.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from bench.report import BenchError, progress
from kv_store.layout import KVBlockLayout

HBM_PEAK_BYTES_PER_S = [  # (words in torch's device name, spec HBM bytes/s); the first match wins
    (("H200",), 4.8e12), (("H100", "PCIe"), 2.0e12), (("H100", "NVL"), 3.9e12), (("H100",), 3.35e12),
    (("A100", "40GB"), 1.555e12), (("A100",), 2.04e12), (("L40S",), 0.864e12),
]
CASES = [  # (kv_dtype, batch, context tokens)
    ("fp8_e4m3", 1, 8192), ("fp8_e4m3", 32, 2048), ("fp8_e4m3", 128, 1024),
    ("bf16", 1, 8192), ("bf16", 32, 2048), ("bf16", 128, 1024),
]
PREFILL_CASES = [("fp8_e4m3", 2048, 512), ("bf16", 2048, 512)]  # (kv_dtype, cached tokens, new tokens)
KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, LAYERS = 8, 4, 128, 16, 4
_STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


def peak_hbm_bytes_per_s(name: str) -> float | None:
    """The spec-sheet HBM bandwidth of a GPU named ``name`` (torch's device name), if known."""
    for words, value in HBM_PEAK_BYTES_PER_S:
        if all(word in name for word in words):
            return value
    return None


def time_cuda_s(fn, repeats: int = 20) -> float:
    """Median seconds of ``fn()`` on the current stream, after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_graphed_s(calls: list, repeats: int = 10) -> float:
    """Median seconds per call of ``calls`` (each run once, in order) captured in one CUDA graph and replayed."""
    for call in calls:
        call()  # compiles, and the allocations happen before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return time_cuda_s(graph.replay, repeats) / len(calls)


def time_eager_s(calls: list, repeats: int = 10) -> float:
    """Median seconds per call of ``calls`` run back to back from Python (launch overhead included)."""
    return time_cuda_s(lambda: [call() for call in calls], repeats) / len(calls)


def copy_bytes_per_s(num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * num_bytes / time_cuda_s(lambda: dst.copy_(src))


def random_pool(layout: KVBlockLayout, num_blocks: int, seed: int = 0) -> torch.Tensor:
    """A CUDA pool of ``num_blocks`` blocks of random K/V (finite FP8 codes, positive scales)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pool = torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8, device="cuda")
    values = torch.randn(num_blocks, layout.payload_bytes // layout.element_bytes, device="cuda", generator=g)
    if layout.has_scales:
        pool[:, : layout.payload_bytes] = (values * 100).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        scales = pool[:, layout.scales_offset : layout.scales_offset + layout.scale_bytes].view(torch.float32)
        scales.copy_(torch.rand(scales.shape, device="cuda", generator=g) / 100 + 1e-3)
    else:
        pool[:, : layout.payload_bytes] = values.to(_STORAGE[layout.kv_dtype]).view(torch.uint8)
    return pool


def gathered_kv(pool, layout: KVBlockLayout, layer: int, tables, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``tables``' blocks, dequantized to ``dtype``: ``[batch, kv_heads, width * block_size, head_dim]`` each."""
    batch, width = tables.shape
    payload = pool[:, : layout.payload_bytes].view(_STORAGE[layout.kv_dtype]).view(pool.shape[0], *layout.payload_shape)
    picked = payload[:, :, layer][tables].to(dtype)  # [batch, width, kv_heads, 2, block_size, head_dim]
    if layout.has_scales:
        scales = pool[:, layout.scales_offset : layout.scales_offset + layout.scale_bytes].view(torch.float32)
        picked = picked * scales.view(pool.shape[0], *layout.scale_shape)[:, :, layer][tables][..., None, None].to(dtype)
    kv = picked.permute(0, 2, 3, 1, 4, 5).reshape(batch, layout.num_kv_heads, 2, width * layout.block_size, layout.head_dim)
    return kv[:, :, 0], kv[:, :, 1]


def torch_paged_decode(q, pool, layout: KVBlockLayout, layer: int, tables, lens) -> torch.Tensor:
    """The peer: gather every table's blocks, dequantize, one masked SDPA (as the engine does on CPU)."""
    keys, values = gathered_kv(pool, layout, layer, tables, q.dtype)
    mask = (torch.arange(keys.shape[2], device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    grouped = q.view(q.shape[0], layout.num_kv_heads, -1, layout.head_dim)
    return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask).view(q.shape)


def attention_case(kv_dtype: str, batch: int, context: int, peak: float | None, copy_bw: float) -> dict:
    """Time the decode kernel (graphed and eager) and the torch peer on one decode batch; bandwidth counts the KV bytes read."""
    from engine.kernels.paged_attention import paged_decode_attention

    layout = KVBlockLayout(LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, kv_dtype)
    width = -(-context // BLOCK_SIZE)
    kv_bytes = batch * context * KV_HEADS * 2 * HEAD_DIM * layout.element_bytes
    kv_bytes += batch * width * KV_HEADS * 2 * 4 if layout.has_scales else 0
    l2_bytes = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 64 << 20)
    copies = max(1, -(-4 * l2_bytes // kv_bytes))
    pool = random_pool(layout, copies * batch * width)
    tables = torch.randperm(copies * batch * width, device="cuda").view(copies, batch, width).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    calls = [lambda t=t: paged_decode_attention(q, pool, layout, 1, t, lens) for t in tables]
    kernel_s = time_graphed_s(calls)
    eager_s = time_eager_s(calls)
    torch_s = time_cuda_s(lambda: torch_paged_decode(q, pool, layout, 1, tables[0].long(), lens))
    diff = (paged_decode_attention(q, pool, layout, 1, tables[0], lens).float() - torch_paged_decode(q, pool, layout, 1, tables[0].long(), lens).float()).abs().max()
    row = {
        "kv_dtype": kv_dtype, "batch": batch, "context": context, "kv_bytes": kv_bytes, "pool_copies": copies,
        "kernel_us": round(kernel_s * 1e6, 1), "kernel_eager_us": round(eager_s * 1e6, 1), "torch_us": round(torch_s * 1e6, 1),
        "kernel_gb_per_s": round(kv_bytes / kernel_s / 1e9, 1), "torch_gb_per_s": round(kv_bytes / torch_s / 1e9, 1),
        "speedup_vs_torch": round(torch_s / kernel_s, 2), "fraction_of_copy": round(kv_bytes / kernel_s / copy_bw, 3),
        "max_abs_diff_vs_torch": round(float(diff), 4),
    }
    if peak:
        row["fraction_of_hbm_peak"] = round(kv_bytes / kernel_s / peak, 3)
    return row


def torch_paged_prefill(q, pool, layout: KVBlockLayout, layer: int, table, start: int) -> torch.Tensor:
    """The peer: one chunk's blocks gathered and dequantized, SDPA with the causal mask in absolute positions."""
    keys, values = gathered_kv(pool, layout, layer, table[None], q.dtype)
    mask = torch.arange(keys.shape[2], device=q.device)[None, :] <= torch.arange(start, start + q.shape[0], device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def prefill_case(kv_dtype: str, cached: int, new: int) -> dict:
    """Time the prefill kernel and SDPA over gathered blocks on one chunk of ``new`` tokens after ``cached``."""
    from engine.kernels.paged_prefill import paged_prefill_attention

    layout = KVBlockLayout(LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, kv_dtype)
    width = -(-(cached + new) // BLOCK_SIZE)
    pool = random_pool(layout, width)
    table = torch.randperm(width, device="cuda").to(torch.int32)
    q = torch.randn(new, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.tensor([cached], dtype=torch.int32, device="cuda")
    query_starts = torch.tensor([0, new], dtype=torch.int32, device="cuda")

    def kernel():
        return paged_prefill_attention(q, pool, layout, 1, table[None], starts, query_starts, new)

    def peer():
        return torch_paged_prefill(q, pool, layout, 1, table.long(), cached)

    kernel_s, torch_s = time_eager_s([kernel]), time_eager_s([peer])
    return {
        "kv_dtype": kv_dtype, "cached": cached, "new": new,
        "kernel_us": round(kernel_s * 1e6, 1), "sdpa_gathered_us": round(torch_s * 1e6, 1),
        "faster": "kernel" if kernel_s < torch_s else "sdpa_gathered", "speedup_vs_sdpa": round(torch_s / kernel_s, 2),
        "max_abs_diff_vs_sdpa": round(float((kernel().float() - peer().float()).abs().max()), 4),
    }


def sparse_linear_case(rows: int, cols: int, tokens: int) -> dict:
    """One bf16 linear, dense against 2:4 semi-structured, on the same pruned weight."""
    from torch.sparse import to_sparse_semi_structured

    from engine.sparsity import mask_2_4

    weight = torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda")
    weight = weight * mask_2_4(weight)
    sparse = to_sparse_semi_structured(weight)
    x = torch.randn(tokens, cols, dtype=torch.bfloat16, device="cuda")
    dense_s = time_cuda_s(lambda: F.linear(x, weight))
    sparse_s = time_cuda_s(lambda: F.linear(x, sparse))
    return {"rows": rows, "cols": cols, "tokens": tokens, "dense_us": round(dense_s * 1e6, 1), "sparse_us": round(sparse_s * 1e6, 1), "speedup": round(dense_s / sparse_s, 2)}


def cuda_report() -> dict:
    if not torch.cuda.is_available():
        raise BenchError("--device cuda needs a CUDA GPU and this machine has none; nothing was measured")
    name = torch.cuda.get_device_name()
    peak = peak_hbm_bytes_per_s(name)
    copy_bw = copy_bytes_per_s()
    report = {"device": name, "hbm_peak_gb_per_s": peak and peak / 1e9, "copy_gb_per_s": round(copy_bw / 1e9, 1),
              "attention": [], "prefill": [], "sparse_2_4": []}
    for case in CASES:
        progress("kernels", f"decode attention {case}")
        report["attention"].append(attention_case(*case, peak, copy_bw))
    for case in PREFILL_CASES:
        row = prefill_case(*case)
        progress("kernels", f"prefill attention {case}: {row['faster']} is faster ({row['kernel_us']} us kernel, {row['sdpa_gathered_us']} us SDPA)")
        report["prefill"].append(row)
    for shape in [(4096, 4096, 1), (4096, 4096, 64), (4096, 4096, 2048), (14336, 4096, 2048)]:
        progress("kernels", f"2:4 linear {shape}")
        report["sparse_2_4"].append(sparse_linear_case(*shape))
    return report
