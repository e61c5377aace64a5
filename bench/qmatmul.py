"""Per-matmul µs of the native quantized kernel (engine/quant/_qmatmul.c) against its peers in
the same run: torch's int4 kernel (bf16 in and out, as the engine ran it before; Q8_0 as two int4
planes) and the dense bf16 matmul (the copy run past ``INT4_KERNEL_MAX_ROWS``).

    python -m bench.qmatmul [--threads 1 2] [--rows 1 4 8 16] [--json PATH]

Prints JSON rows ``{shape, format, rows, threads, native_us, torch_int4_us, dense_bf16_us}``,
the median of ``--repeats`` timed loops each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from engine.quant import native

SHAPES = (("q4", 1536, 576), ("q4", 576, 1536), ("q4", 960, 576), ("q8", 49152, 576))
"""(format, out, in): SmolLM2's gate/up, down, QKV and its tied Q8_0 LM head."""


def _timed_us(fn, number: int, repeats: int) -> float:
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
    sz = torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()
    return lambda x16: torch.ops.aten._weight_int4pack_mm_for_cpu(x16, packed, 32, sz)


def _peers(kind: str, out_features: int, in_features: int):
    g = torch.Generator().manual_seed(0)
    blocks = in_features // 32
    scales = torch.rand(out_features, blocks, generator=g) * 0.01
    dense = torch.randn(out_features, in_features, generator=g).bfloat16()
    if kind == "q4":
        codes = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
        packed = native.pack_q4(codes, scales, -8 * scales).numpy()
        ours = lambda x: native.q4_matmul(x, packed, out_features)  # noqa: E731
        plane = _torch_int4(codes, scales, torch.zeros_like(scales))
        theirs = lambda x: plane(x.to(torch.bfloat16)).float()  # noqa: E731
    else:
        codes = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int8)
        packed = native.pack_q8(codes, scales).numpy()
        ours = lambda x: native.q8_matmul(x, packed, out_features)  # noqa: E731
        unsigned = codes.to(torch.int32) + 128
        high = _torch_int4(unsigned >> 4, 16 * scales, torch.zeros_like(scales))
        low = _torch_int4(unsigned & 15, scales, 8 * scales)
        theirs = lambda x: (lambda x16: high(x16).float() + low(x16).float())(x.to(torch.bfloat16))  # noqa: E731
    return ours, theirs, lambda x: F.linear(x.to(torch.bfloat16), dense).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this path")
    args = parser.parse_args()
    rows_out = []
    with torch.inference_mode():
        for kind, out_features, in_features in SHAPES:
            ours, theirs, dense = _peers(kind, out_features, in_features)
            number = 20 if out_features > 10000 else 200
            for threads in args.threads:
                torch.set_num_threads(threads)
                for rows in args.rows:
                    x = torch.randn(rows, in_features)
                    row = {"shape": f"{out_features}x{in_features}", "format": kind, "rows": rows, "threads": threads}
                    for name, fn in (("native_us", ours), ("torch_int4_us", theirs), ("dense_bf16_us", dense)):
                        row[name] = round(_timed_us(lambda: fn(x), number, args.repeats), 1)
                    print(json.dumps(row), flush=True)
                    rows_out.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows_out, "isa": native._qmatmul.isa() if native._qmatmul else None}, f, indent=1)


if __name__ == "__main__":
    main()
