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

- ``device_path``: what one decode layer launches on the device path (``engine/device_path.py``:
  torch kernels plus Triton launches, the matmuls apart), counted in Triton's interpreter in a
  subprocess (``TRITON_INTERPRET=1`` must be set before Triton is imported).

**CUDA** (``bench/kernels_gpu.py``): the Triton paged decode kernel's KV bytes per second
against the HBM peak, a measured device copy and torch gather + SDPA; the paged prefill kernel
against SDPA over gathered blocks; dense against 2:4 bf16 linears. ``--device cuda`` without a
GPU exits 2 saying so.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from bench.kernels_gpu import copy_bytes_per_s, cuda_report, peak_hbm_bytes_per_s  # noqa: F401  (bench.engine imports the first two from here)
from bench.report import BenchError, arg_parser, emit_report, machine, positive, progress, run
from bench.workload import start_decoding

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


def count_device_path(model: str, kv_dtype: str) -> dict:
    """One decode layer's launches on the device path, unsplit and split (run where Triton interprets)."""
    from engine.config import EngineConfig
    from engine.device_path import count_decode_layer_launches
    from engine.graphs import DecodeGraphs
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model, weights="fp32", kv_dtype=kv_dtype, num_kv_blocks=16))
    engine.kv_cache.triton_decode = True
    graphs = DecodeGraphs(engine.runner.model, engine.kv_cache, 1, 4)
    whole, split = (count_decode_layer_launches(graphs, 1, num_splits=n) for n in (1, 2))
    return {
        "launches_per_decode_layer": whole.num_launches,
        "launches_per_decode_layer_split_k": split.num_launches,
        "triton": whole.triton,
        "torch_ops": whole.torch_ops,
        "gemms": sum(whole.gemms.values()),
    }


def device_path_report(model: str, kv_dtype: str) -> dict:
    progress("kernels", "device path: one decode layer's launches, in Triton's interpreter")
    code = "import json, sys; from bench.kernels import count_device_path; print(json.dumps(count_device_path(sys.argv[1], sys.argv[2])))"
    done = subprocess.run([sys.executable, "-c", code, model, kv_dtype], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"counting the device path's launches failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    report["device_path"] = device_path_report(args.model, args.kv_dtype)
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
