"""GPU micro-bench: the Triton paged-attention decode kernel against HBM bandwidth, and 2:4 sparse linears.

    python -m bench.kernels [--json PATH]

Decode attention reads every context token's K and V once and does little arithmetic with
them, so its ceiling is memory bandwidth: ``bytes of KV read / time`` is compared with the
GPU's HBM peak (spec sheet) and with a device-to-device copy measured in the same run (what
the memory system delivers in practice). The peer is the same attention in torch as the
engine does it on CPU: gather the blocks, dequantize, SDPA. 2:4 rows time one bf16 linear
dense and as ``to_sparse_semi_structured``. Needs CUDA; elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from kv_store.layout import KVBlockLayout

HBM_PEAK_BYTES_PER_S = [  # (words in torch's device name, spec HBM bytes/s); the first match wins
    (("H200",), 4.8e12), (("H100", "PCIe"), 2.0e12), (("H100", "NVL"), 3.9e12), (("H100",), 3.35e12),
    (("A100", "40GB"), 1.555e12), (("A100",), 2.04e12), (("L40S",), 0.864e12),
]
CASES = [  # (kv_dtype, batch, context tokens); Llama-3-8B-like heads: 8 KV heads, 32 query heads, head_dim 128
    ("fp8_e4m3", 1, 8192), ("fp8_e4m3", 32, 2048), ("fp8_e4m3", 128, 1024),
    ("bf16", 1, 8192), ("bf16", 32, 2048), ("bf16", 128, 1024),
]
KV_HEADS, GROUP, HEAD_DIM, BLOCK_SIZE, LAYERS = 8, 4, 128, 16, 4


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
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[layout.kv_dtype]
        pool[:, : layout.payload_bytes] = values.to(dtype).view(torch.uint8)
    return pool


def torch_paged_decode(q, pool, layout: KVBlockLayout, layer: int, tables, lens) -> torch.Tensor:
    """The peer: gather every table's blocks, dequantize, one masked SDPA (as the engine does on CPU)."""
    batch, width = tables.shape
    payload_dtype = {"fp8_e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}[layout.kv_dtype]
    payload = pool[:, : layout.payload_bytes].view(payload_dtype).view(pool.shape[0], *layout.payload_shape)
    picked = payload[:, :, layer][tables].to(q.dtype)  # [batch, width, kv_heads, 2, block_size, head_dim]
    if layout.has_scales:
        scales = pool[:, layout.scales_offset : layout.scales_offset + layout.scale_bytes].view(torch.float32)
        picked = picked * scales.view(pool.shape[0], *layout.scale_shape)[:, :, layer][tables][..., None, None].to(q.dtype)
    kv = picked.permute(0, 2, 3, 1, 4, 5).reshape(batch, layout.num_kv_heads, 2, width * layout.block_size, layout.head_dim)
    mask = (torch.arange(width * layout.block_size, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
    grouped = q.view(batch, layout.num_kv_heads, -1, layout.head_dim)
    return F.scaled_dot_product_attention(grouped, kv[:, :, 0], kv[:, :, 1], attn_mask=mask).view(q.shape)


def attention_case(kv_dtype: str, batch: int, context: int, peak: float | None, copy_bw: float) -> dict:
    """Time the kernel and the torch peer on one decode batch; bandwidth counts the KV bytes read."""
    from engine.kernels.paged_attention import paged_decode_attention

    layout = KVBlockLayout(LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, kv_dtype)
    width = -(-context // BLOCK_SIZE)
    pool = random_pool(layout, batch * width)
    tables = torch.randperm(batch * width, device="cuda").view(batch, width).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    kv_bytes = batch * context * KV_HEADS * 2 * HEAD_DIM * layout.element_bytes
    kv_bytes += batch * width * KV_HEADS * 2 * 4 if layout.has_scales else 0
    kernel_s = time_cuda_s(lambda: paged_decode_attention(q, pool, layout, 1, tables, lens))
    torch_s = time_cuda_s(lambda: torch_paged_decode(q, pool, layout, 1, tables.long(), lens))
    row = {
        "kv_dtype": kv_dtype, "batch": batch, "context": context, "kv_bytes": kv_bytes,
        "kernel_us": round(kernel_s * 1e6, 1), "torch_us": round(torch_s * 1e6, 1),
        "kernel_gb_per_s": round(kv_bytes / kernel_s / 1e9, 1), "torch_gb_per_s": round(kv_bytes / torch_s / 1e9, 1),
        "speedup_vs_torch": round(torch_s / kernel_s, 2), "fraction_of_copy": round(kv_bytes / kernel_s / copy_bw, 3),
    }
    if peak:
        row["fraction_of_hbm_peak"] = round(kv_bytes / kernel_s / peak, 3)
    return row


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="also write the report to this path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU and this machine has none; nothing was measured.", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    peak = peak_hbm_bytes_per_s(name)
    copy_bw = copy_bytes_per_s()
    report = {"device": name, "hbm_peak_gb_per_s": peak and peak / 1e9, "copy_gb_per_s": round(copy_bw / 1e9, 1), "attention": [], "sparse_2_4": []}
    for case in CASES:
        print(f"attention {case}", file=sys.stderr)
        report["attention"].append(attention_case(*case, peak, copy_bw))
    for shape in [(4096, 4096, 1), (4096, 4096, 64), (4096, 4096, 2048), (14336, 4096, 2048)]:
        print(f"2:4 linear {shape}", file=sys.stderr)
        report["sparse_2_4"].append(sparse_linear_case(*shape))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
