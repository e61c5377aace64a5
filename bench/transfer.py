"""KV transfer: FP8 wire bytes, NIXL write throughput and codec speed, each beside a peer, one run.

    python -m bench.transfer --json OUT

Shapes are the model's (SmolLM2-135M by default: 30 layers, 3 KV heads, head_dim 64) with
16-token blocks. A prompt of ``--num-tokens`` tokens is quantized into a prefill pool and written
with one NIXL WRITE (UCX on loopback) into a decode pool held by a second process; each write is
timed from the ``write_blocks`` call to its handle reporting DONE, and the bytes are checked on
the decode side afterwards. The decode process polls its transport every millisecond, as a
decode worker waiting for KV does. Peers measured in the same run: the same prompt in bf16 over
the same path, the same blocks memcpy'd into another pool of one process, and a torch copy of
the float K/V beside the codec. Codec GB/s counts float32 bytes: the K/V read by quantize, the
K/V written by dequantize.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.report import BenchError, emit_report, machine, positive, progress, run
from engine.bundled import resolve_model
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.model_config import ModelConfig
from kv_store.layout import KVBlockLayout
from kv_transfer.codec import dequantize_blocks, quantize_blocks
from kv_transfer.nixl_transport import NixlTransport

KV_DTYPES = ("fp8_e4m3", "bf16")


def _decode_side(conn, layouts: dict[str, KVBlockLayout], num_blocks: int) -> None:
    """The receiving process: one transport per KV dtype over a zeroed (touched) pool, polled every ms."""
    pools = {d: torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8) for d, layout in layouts.items()}
    transports = {d: NixlTransport(f"bench-decode-{d}", pool) for d, pool in pools.items()}
    conn.send({d: t.metadata() for d, t in transports.items()})
    while True:
        while not conn.poll(0.001):
            for transport in transports.values():
                transport.progress()
        command, args = conn.recv()
        if command == "blocks":
            kv_dtype, block_ids = args
            conn.send(pools[kv_dtype][block_ids].clone())
        elif command == "stop":
            counts = {d: sum(len(m) for m in t.pop_notifs().values()) for d, t in transports.items()}
            for t in transports.values():
                t.close()
            conn.send(counts)
            return


def _median_s(fn, repetitions: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gbps(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / seconds / 1e9, 3)


def bench_codec(layout: KVBlockLayout, kv: torch.Tensor, repetitions: int) -> dict:
    out = torch.empty(kv.shape[0], layout.block_bytes, dtype=torch.uint8)
    float_bytes = kv.numel() * kv.element_size()
    quantize_s = _median_s(lambda: quantize_blocks(kv, layout, out=out), repetitions)
    dequantize_s = _median_s(lambda: dequantize_blocks(out, layout), repetitions)
    copy = torch.empty_like(kv)
    copy_s = _median_s(lambda: copy.copy_(kv), repetitions)
    return {
        "codec_quantize_gbps": _gbps(float_bytes, quantize_s),
        "codec_dequantize_gbps": _gbps(float_bytes, dequantize_s),
        "codec_gbps_basis": "float32 K/V bytes: read by quantize_blocks, written by dequantize_blocks",
        "codec_float_bytes": float_bytes,
        "peer_float32_copy_gbps": _gbps(float_bytes, copy_s),
    }


def _bench_memcpy(pool: torch.Tensor, num_decode_blocks: int, block_ids: list[int], repetitions: int) -> dict:
    """The same blocks copied into another pool of the same process: one memcpy per block (numpy, one thread)."""
    source = pool.numpy()
    decode_pool = np.zeros((num_decode_blocks, pool.shape[1]), dtype=np.uint8)

    def copy_blocks() -> None:
        for local_id, remote_id in enumerate(block_ids):
            np.copyto(decode_pool[remote_id], source[local_id])

    seconds = _median_s(copy_blocks, repetitions)
    return {"write_s_p50": round(seconds, 6), "gbps": _gbps(pool.numel(), seconds)}


def bench_nixl(layouts: dict[str, KVBlockLayout], kv: torch.Tensor, num_decode_blocks: int, repetitions: int) -> dict:
    num_blocks = kv.shape[0]
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    decode = ctx.Process(target=_decode_side, args=(child, layouts, num_decode_blocks), daemon=True)
    decode.start()
    metadata = conn.recv()
    # Decode blocks as a free list hands them out after some churn: scattered, none adjacent.
    g = torch.Generator().manual_seed(0)
    scattered = (torch.randperm(num_decode_blocks // 2, generator=g)[:num_blocks] * 2).tolist()
    contiguous = local_ids = list(range(num_blocks))
    report: dict = {}
    for kv_dtype, layout in layouts.items():
        progress("transfer", f"nixl: {kv_dtype} WRITE of {num_blocks} blocks x {repetitions}, scattered and contiguous")
        pool = torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8)
        quantize_blocks(kv, layout, out=pool)
        num_bytes = pool.numel()
        with NixlTransport(f"bench-prefill-{kv_dtype}", pool) as prefill:
            peer = prefill.add_peer(metadata[kv_dtype])
            for name, remote_ids in (("scattered", scattered), ("contiguous", contiguous)):
                num_descriptors = []

                def write_once() -> None:
                    with prefill.write_blocks(peer, local_ids, remote_ids, b"bench") as handle:
                        handle.wait(30.0)
                        num_descriptors.append(handle.num_descriptors)

                seconds = _median_s(write_once, repetitions)
                conn.send(("blocks", (kv_dtype, remote_ids)))
                if not torch.equal(conn.recv(), pool):
                    raise RuntimeError(f"{kv_dtype} {name} write: the decode pool does not hold the written bytes")
                report[f"{kv_dtype}_{name}"] = {
                    "write_s_p50": round(seconds, 6),
                    "gbps": _gbps(num_bytes, seconds),
                    "num_bytes": num_bytes,
                    "num_descriptors": num_descriptors[-1],
                }
        if kv_dtype == "fp8_e4m3":
            report["peer_memcpy_scattered"] = _bench_memcpy(pool, num_decode_blocks, scattered, repetitions)
    conn.send(("stop", ()))
    report["num_notifs_received"] = conn.recv()
    decode.join(30)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path, help="write the results here as well as to stdout")
    parser.add_argument("--num-tokens", type=positive, default=2048)
    parser.add_argument("--block-size", type=positive, default=EngineConfig.block_size)
    parser.add_argument("--repetitions", type=positive, default=20)
    args = parser.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines go to stdout, into the JSON

    progress("transfer", f"reading the KV shapes of {args.model}")
    try:
        model = ModelConfig.from_dir(resolve_model(args.model))
    except EngineError as e:
        raise BenchError(str(e)) from None
    layouts = {d: KVBlockLayout(model.num_layers, model.num_kv_heads, model.head_dim, args.block_size, d) for d in KV_DTYPES}
    fp8, bf16 = layouts["fp8_e4m3"], layouts["bf16"]
    num_blocks = -(-args.num_tokens // args.block_size)
    kv = torch.randn(num_blocks, *fp8.payload_shape, generator=torch.Generator().manual_seed(0))

    progress("transfer", f"codec: quantize and dequantize {num_blocks} blocks x {args.repetitions}")
    codec = bench_codec(fp8, kv, args.repetitions)
    progress("transfer", "nixl: starting the decode process")
    nixl = bench_nixl(layouts, kv, num_decode_blocks=4 * num_blocks, repetitions=args.repetitions)
    fp8_write, bf16_write = nixl["fp8_e4m3_scattered"], nixl["bf16_scattered"]
    report = {
        "model": args.model,
        "layout": {k: getattr(fp8, k) for k in ("num_layers", "num_kv_heads", "head_dim", "block_size")},
        "num_tokens": args.num_tokens,
        "num_blocks": num_blocks,
        "fp8_block_bytes": fp8.block_bytes,
        "bf16_block_bytes": bf16.block_bytes,
        "fp8_over_bf16_wire_bytes": round(fp8.block_bytes / bf16.block_bytes, 4),
        "nixl_write_gbps": fp8_write["gbps"],
        "nixl_write_basis": "fp8 blocks into scattered decode blocks, one WRITE, median; GB = 1e9 bytes",
        "fp8_over_bf16_write_time": round(fp8_write["write_s_p50"] / bf16_write["write_s_p50"], 3),
        **codec,
        "nixl": nixl,
        "repetitions": args.repetitions,
        "machine": machine(),
    }
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(run("transfer", main))
