"""The engine's kernels against their torch peers, in one run: the C kernels on CPU, the Triton kernel on CUDA.

    python -m bench.kernels [--device cpu|cuda] [--json PATH]

**CPU** (the default without a GPU; needs the extensions setup.py builds):
- ``matmul``: µs per quantized matmul (``engine/quant/_qmatmul.c``) on SmolLM2's shapes at
  1-16 rows, against torch's int4 kernel as the engine ran it before (bf16 casts; Q8_0 as two
  int4 planes) and the dense bf16 matmul (the copy run past the kernel's row limit).
- ``decode_steps``: ms per whole-engine decode step, three engines on the same requests, steps
  alternating: ``native``, every C kernel (quantized matmuls, paged attention and FP8 writes,
  RMSNorm) with small steps' layers in one C call (``engine/kernels/cpu_decoder.py``);
  ``kernels_only``, the same kernels called layer by layer from Python; ``torch``, every torch
  path. Alternating makes it a paired comparison, robust on a shared box.

**CUDA**: decode attention reads every context token's K and V once and does little
arithmetic with them, so its ceiling is memory bandwidth: ``bytes of KV read / time`` is
compared with the GPU's HBM peak (spec sheet) and with a device-to-device copy measured in the
same run. The peer is the same attention in torch as the engine's fallback does it: gather the
blocks, dequantize, SDPA. 2:4 rows time one bf16 linear dense and as
``to_sparse_semi_structured``. ``--device cuda`` without a GPU exits 2 saying so.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from bench.report import BenchError, arg_parser, emit_report, machine, positive, progress, run
from bench.workload import start_decoding
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


MATMUL_SHAPES = (("q4", 1536, 576), ("q4", 576, 1536), ("q4", 960, 576), ("q8", 49152, 576))
"""(format, out, in): SmolLM2's gate/up, down, QKV and its tied Q8_0 LM head."""


def timed_us(fn, number: int, repeats: int) -> float:
    """Median over ``repeats`` loops of ``number`` calls of ``fn``, µs per call, after one untimed call."""
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(runs)


def _torch_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    scales_and_zeros = torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()
    return lambda x16: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, packed, 32, scales_and_zeros)


def matmul_peers(kind: str, out_features: int, in_features: int) -> dict:
    """``{name: fn(x)}``: the C kernel, torch's int4 kernel and dense bf16 on one random weight."""
    from engine.quant import native

    g = torch.Generator().manual_seed(0)
    scales = torch.rand(out_features, in_features // 32, generator=g) * 0.01
    dense = torch.randn(out_features, in_features, generator=g).bfloat16()
    if kind == "q4":
        codes = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
        packed = native.pack_q4(codes, scales, -8 * scales).numpy()
        plane = _torch_int4(codes, scales, torch.zeros_like(scales))
        return {
            "native": lambda x: native.q4_matmul(x, packed, out_features),
            "torch_int4": lambda x: plane(x.to(torch.bfloat16)).float(),
            "dense_bf16": lambda x: F.linear(x.to(torch.bfloat16), dense).float(),
        }
    codes = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    packed = native.pack_q8(codes, scales).numpy()
    unsigned = codes.to(torch.int32) + 128
    high = _torch_int4(unsigned >> 4, 16 * scales, torch.zeros_like(scales))
    low = _torch_int4(unsigned & 15, scales, 8 * scales)
    return {
        "native": lambda x: native.q8_matmul(x, packed, out_features),
        "torch_int4": lambda x: high(x.to(torch.bfloat16)).float() + low(x.to(torch.bfloat16)).float(),
        "dense_bf16": lambda x: F.linear(x.to(torch.bfloat16), dense).float(),
    }


def matmul_rows(threads: list[int], rows: list[int], repeats: int) -> list[dict]:
    out = []
    for kind, out_features, in_features in MATMUL_SHAPES:
        progress("kernels", f"matmul {out_features}x{in_features} {kind}")
        peers = matmul_peers(kind, out_features, in_features)
        number = 20 if out_features > 10000 else 200
        for num_threads in threads:
            torch.set_num_threads(num_threads)
            for m in rows:
                x = torch.randn(m, in_features)
                row = {"shape": f"{out_features}x{in_features}", "format": kind, "rows": m, "threads": num_threads}
                row.update({f"{name}_us": round(timed_us(lambda: fn(x), number, repeats), 1) for name, fn in peers.items()})
                out.append(row)
    return out


class _Kernels:
    """Switches the engine's C code per mode (``MODES``): the weights' layout is fixed when an
    engine is built, the fused layers, attention and RMSNorm read their flags at each call."""

    MODES = ("torch", "kernels_only", "native")

    def __init__(self) -> None:
        from engine.kernels import cpu_attention, cpu_decoder
        from engine.layers import norm
        from engine.quant import native

        self.flags = ((native, "NATIVE_QMATMUL"), (cpu_attention, "NATIVE_ATTENTION"), (norm, "NATIVE_NORM"), (cpu_decoder, "NATIVE_DECODER"))
        self.built = {name: getattr(module, name) for module, name in self.flags}

    def set(self, mode: str) -> None:
        for module, name in self.flags:
            on = mode == "native" or (mode == "kernels_only" and name != "NATIVE_DECODER")
            setattr(module, name, on and self.built[name])


def decode_step_rows(model: str, kv_dtype: str, concurrency: list[int], prompt_len: int, tokens: int) -> list[dict]:
    """Per concurrency: ms per decode step in each of ``_Kernels.MODES``, steps alternating."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    kernels = _Kernels()
    engines = {}
    try:
        for mode in kernels.MODES:
            kernels.set(mode)
            engines[mode] = LLMEngine(EngineConfig(model=model, weights="native", kv_dtype=kv_dtype))
        rows = []
        for n in concurrency:
            progress("kernels", f"decode steps at concurrency {n}")
            vocab = engines["native"].model_config.vocab_size
            for mode, engine in engines.items():
                kernels.set(mode)
                start_decoding(engine, [[(1000 + i * 7919 + j * 31) % vocab for j in range(prompt_len)] for i in range(n)], tokens)
            step_s = {mode: [] for mode in engines}
            while engines["native"].has_unfinished_requests():
                for mode, engine in engines.items():
                    kernels.set(mode)
                    start = time.perf_counter()
                    engine.step()
                    step_s[mode].append(time.perf_counter() - start)
            row = {"concurrency": n, "prompt_len": prompt_len, "steps": len(step_s["native"])}
            row.update({f"{mode}_ms_per_step": round(statistics.median(s) * 1e3, 2) for mode, s in step_s.items()})
            rows.append(row)
        return rows
    finally:
        kernels.set("native")


def cpu_report(args) -> dict:
    from engine.quant import native

    missing = [name for name, built in _Kernels().built.items() if not built]
    if missing:
        raise BenchError(f"the C kernels are not built or cannot run on this CPU ({', '.join(missing)} false): "
                         "`pip install -e .` builds them with gcc; the quantized matmul needs AVX2 or AVX-512 VNNI")
    report = {"device": "cpu", "machine": machine(), "isa": native._qmatmul.isa(), "model": args.model, "kv_dtype": args.kv_dtype}
    report["matmul"] = matmul_rows(args.threads, args.rows, args.repeats)
    torch.set_num_threads(max(args.threads))
    report["decode_steps"] = decode_step_rows(args.model, args.kv_dtype, args.concurrency, args.prompt_len, args.tokens)
    return report


def cuda_report() -> dict:
    if not torch.cuda.is_available():
        raise BenchError("--device cuda needs a CUDA GPU and this machine has none; nothing was measured")
    name = torch.cuda.get_device_name()
    peak = peak_hbm_bytes_per_s(name)
    copy_bw = copy_bytes_per_s()
    report = {"device": name, "hbm_peak_gb_per_s": peak and peak / 1e9, "copy_gb_per_s": round(copy_bw / 1e9, 1), "attention": [], "sparse_2_4": []}
    for case in CASES:
        progress("kernels", f"attention {case}")
        report["attention"].append(attention_case(*case, peak, copy_bw))
    for shape in [(4096, 4096, 1), (4096, 4096, 64), (4096, 4096, 2048), (14336, 4096, 2048)]:
        progress("kernels", f"2:4 linear {shape}")
        report["sparse_2_4"].append(sparse_linear_case(*shape))
    return report


def main(argv: list[str] | None = None) -> int:
    from kv_store.keys import KV_DTYPES

    parser = arg_parser(__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda where there is a GPU, else cpu")
    parser.add_argument("--threads", type=positive, nargs="+", default=[1, 2], help="CPU matmul threads (default: 1 2)")
    parser.add_argument("--rows", type=positive, nargs="+", default=[1, 4, 8, 16], help="CPU matmul rows (default: 1 4 8 16)")
    parser.add_argument("--repeats", type=positive, default=5, help="timed loops per matmul (default: 5)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp8_e4m3", help="decode steps' KV pool (default: fp8_e4m3)")
    parser.add_argument("--concurrency", type=positive, nargs="+", default=[1, 8], help="decode steps' sequences (default: 1 8)")
    parser.add_argument("--prompt-len", type=positive, default=32, help="decode steps' prompt tokens (default: 32)")
    parser.add_argument("--tokens", type=positive, default=128, help="decode steps per run (default: 128)")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    emit_report(cpu_report(args) if device == "cpu" else cuda_report(), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(run("kernels", main))
