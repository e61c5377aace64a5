"""KV transfer: FP8 wire bytes, NIXL write throughput and codec speed, each beside a peer, one run.

A ``--num-tokens`` prompt in the model's KV shapes is quantized into a prefill pool and written
with one NIXL WRITE (UCX on loopback) into scattered, then contiguous blocks of a decode pool in
a second process, which polls its transport every millisecond as a waiting decode worker does.
A write is timed from ``write_blocks`` to its handle reporting DONE; the landed bytes are checked.
Peers: the prompt in bf16, the fp8 blocks memcpy'd in one process, and a torch copy beside the
codec (GB/s of float32 K/V).
"""

from __future__ import annotations

import multiprocessing
import os
import sys

import numpy as np
import torch

from bench.report import arg_parser, emit_report, machine, median_s, positive, progress, run, user_error
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


def _gbps(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / seconds / 1e9, 3)


def bench_codec(layout: KVBlockLayout, kv: torch.Tensor, repetitions: int) -> dict:
    out = torch.empty(kv.shape[0], layout.block_bytes, dtype=torch.uint8)
    float_bytes = kv.numel() * kv.element_size()
    quantize_s = median_s(lambda: quantize_blocks(kv, layout, out=out), repetitions)
    dequantize_s = median_s(lambda: dequantize_blocks(out, layout), repetitions)
    copy = torch.empty_like(kv)
    copy_s = median_s(lambda: copy.copy_(kv), repetitions)
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

    seconds = median_s(copy_blocks, repetitions)
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

                seconds = median_s(write_once, repetitions)
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
    parser = arg_parser(__doc__)
    parser.add_argument("--num-tokens", type=positive, default=2048)
    parser.add_argument("--block-size", type=positive, default=EngineConfig.block_size)
    parser.add_argument("--repetitions", type=positive, default=20)
    args = parser.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines go to stdout, into the JSON

    progress("transfer", f"reading the KV shapes of {args.model}")
    with user_error(EngineError):
        model = ModelConfig.from_dir(resolve_model(args.model))
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
