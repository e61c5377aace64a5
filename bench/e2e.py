"""End to end: the cluster over gRPC against the same engine in this process, in one run.

Phases (``--phases``), for each pool layout (``--pools PREFILL:DECODE``) or, with ``--address``,
for that running cluster as it is:

- ``sweep``: at each ``--concurrency`` N, a closed loop of N clients through gRPC and, the peer,
  through an in-process ``EngineLoop`` (its own thread, as in a worker), alternating ``--rounds``
  times (this machine's speed drifts between minutes), each run with new prompts (no prefix
  cache hits). Per run: output tokens/s, TTFT and inter-token latency percentiles, and the TTFT
  split into ``STAGES``.
- ``interference``: ``--decode-streams`` answers alone, then while one client sends
  ``--prefill-prompt-len``-token prompts back to back: their inter-token latency either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from bench.report import BenchError, arg_parser, check_ranges, emit_report, machine, percentile, plot, positive, progress, run, series
from bench.workload import NUM_SPECIAL_TOKENS, BenchRequest, greedy, local_cluster, random_workload, variant
from decode_worker.config import WorkerConfig
from engine.bundled import served_model_name
from engine.config import EngineConfig, WorkerProcessConfig
from engine.engine_loop import EngineLoop
from engine.errors import UnknownModelError
from engine.llm_engine import LLMEngine
from engine.request import EngineRequest
from prefill_worker.config import PrefillWorkerConfig
from proto import splitserve_pb2 as pb
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.launch import ClusterConfig

STAGES = ("hops", "request_plane", "pickup", "kv_handoff", "wait", "prefill", "handback")
"""Where a request's TTFT goes, in order; they add up to it:

- ``hops``: client to worker and the first token back, outside the worker (gRPC, router, request-plane TCP);
- ``request_plane``: the worker's event loop, from reading the Submit frame to starting the request;
- ``pickup``: the engine thread finishing its step before taking the request in;
- ``wait``: steps that ran without it; or, prefilled by a prefill worker, ``kv_handoff`` instead:
  parked while the prefill worker computes the prompt and writes its KV, to joining the batch;
- ``prefill``: the steps computing its prompt, to its first token;
- ``handback``: from that step's end to the token reaching the request's coroutine.

A request lacking a stage (in-process: ``hops``, ``request_plane``) reports it absent."""
SERVING_PATH = ("hops", "request_plane")
"""The stages between the client and the engine: what serving over gRPC adds to a first token."""
PLOTTED = (("output", "tokens/s", "output_tok_per_s"), ("TTFT p90", "ms", "ttft_ms_p90"))


@dataclass(frozen=True)
class Sample:
    """One request: its TTFT, the gap per token between token-bearing responses, and its stages."""

    ttft_s: float
    itl_s: tuple[float, ...]
    num_tokens: int
    stages: dict[str, float]


@dataclass(frozen=True)
class Run:
    """One system's run of one workload (``system`` is ``grpc`` or ``engine``)."""

    system: str
    pools: str
    concurrency: int
    wall_s: float
    samples: list[Sample]


def record(t0: float, events: list[tuple[float, int]], stages: dict[str, float]) -> Sample:
    """A Sample from when the request was handed over and (time, tokens) per token-bearing response."""
    itl = tuple(gap for (a, _), (b, n) in zip(events, events[1:]) for gap in [(b - a) / n] * n)
    return Sample(events[0][0] - t0, itl, sum(n for _, n in events), stages)


def timings_stages(t: pb.Timings, ttft_s: float) -> dict[str, float]:
    """A gRPC request's stages from the worker's Timings and the client's TTFT."""
    return {
        "hops": ttft_s - t.worker_first_token_s - t.request_plane_s,
        "request_plane": t.request_plane_s,
        "pickup": t.admitted_s,
        "kv_handoff" if t.kv_handoff_s else "wait": t.queue_s - t.admitted_s,
        "prefill": t.first_step_end_s - t.queue_s,
        "handback": t.worker_first_token_s - t.first_step_end_s,
    }


def grpc_request(client: SplitServeClient, req: BenchRequest) -> Sample:
    events, last = [], None
    t0 = time.monotonic()
    for response in client.generate(list(req.prompt_token_ids), max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True):
        if response.token_ids:
            events.append((time.monotonic(), len(response.token_ids)))
        last = response
    return record(t0, events, timings_stages(last.timings, events[0][0] - t0))


async def engine_request(loop: EngineLoop, request_id: str, req: BenchRequest) -> Sample:
    t0 = time.monotonic()
    events = []
    async for out in loop.generate(EngineRequest(request_id, list(req.prompt_token_ids), None, greedy(req.num_output_tokens), None, arrival_s=t0)):
        if out.new_token_ids:
            events.append((time.monotonic(), len(out.new_token_ids)))
    t = out.trace
    stages = {"pickup": t.admitted_s - t0, "wait": t.first_scheduled_s - t.admitted_s, "prefill": t.first_token_s - t.first_scheduled_s}
    return record(t0, events, stages | {"handback": events[0][0] - t.first_token_s})


def run_grpc(client: SplitServeClient, workload: list[BenchRequest], concurrency: int, pools: str) -> Run:
    """N client threads, each sending its next request when its last one ends."""
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as clients:
        samples = list(clients.map(lambda req: grpc_request(client, req), workload))
    return Run("grpc", pools, concurrency, time.monotonic() - start, samples)


def run_engine(loop: EngineLoop, workload: list[BenchRequest], concurrency: int, pools: str) -> Run:
    """N asyncio clients in this process (one event loop, as in a worker), the engine on the loop's thread."""

    async def clients() -> list[Sample]:
        slots = asyncio.Semaphore(concurrency)

        async def one(index: int, req: BenchRequest) -> Sample:
            async with slots:
                return await engine_request(loop, f"e2e-{time.monotonic_ns()}-{index}", req)

        return await asyncio.gather(*(one(i, req) for i, req in enumerate(workload)))

    start = time.monotonic()
    samples = asyncio.run(clients())
    return Run("engine", pools, concurrency, time.monotonic() - start, samples)


def _ms(value_s: float) -> float:
    return round(1000 * value_s, 2)


def latency(values_s: list[float], name: str) -> dict[str, float]:
    return {f"{name}_ms_p{q}": _ms(percentile(values_s, q)) for q in (50, 90, 99)}


def summarize(runs: list[Run]) -> dict:
    """Per (pools, system, concurrency), pooled over rounds; and gRPC against the engine."""
    groups: dict[tuple[str, str, int], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.pools, r.system, r.concurrency), []).append(r)
    rows = []
    for (pools, system, c), group in groups.items():
        samples = [s for r in group for s in r.samples]
        present = [st for st in STAGES if any(st in s.stages for s in samples)]
        rows.append({
            "pools": pools,
            "system": system,
            "concurrency": c,
            "rounds": len(group),
            "num_requests": len(samples),
            "num_output_tokens": sum(s.num_tokens for s in samples),
            "output_tok_per_s": round(sum(s.num_tokens for s in samples) / sum(r.wall_s for r in group), 2),
            "output_tok_per_s_by_round": [round(sum(s.num_tokens for s in r.samples) / r.wall_s, 2) for r in group],
            "ttft_ms_mean": _ms(statistics.fmean(s.ttft_s for s in samples)),
            **latency([s.ttft_s for s in samples], "ttft"),
            **latency([v for s in samples for v in s.itl_s], "itl"),
            "stage_ms_mean": {st: _ms(statistics.fmean(s.stages.get(st, 0.0) for s in samples)) for st in present},
        })
    by = {(r["pools"], r["system"], r["concurrency"]): r for r in rows}
    versus = []
    for (pools, system, c), row in by.items():
        peer = by.get((pools, "engine", c))
        if system == "grpc" and peer is not None:
            versus.append({
                "pools": pools,
                "concurrency": c,
                "throughput_ratio": round(row["output_tok_per_s"] / peer["output_tok_per_s"], 3),
                "ttft_ms_p50_added": round(row["ttft_ms_p50"] - peer["ttft_ms_p50"], 2),
                "ttft_ms_p90_added": round(row["ttft_ms_p90"] - peer["ttft_ms_p90"], 2),
                "serving_path_ms_mean": round(sum(row["stage_ms_mean"].get(st, 0.0) for st in SERVING_PATH), 2),
            })
    return {"runs": rows, "grpc_vs_engine": versus}


def interference(client: SplitServeClient, streams: list[BenchRequest], prompt: BenchRequest, tags: Iterator[int], pools: str) -> dict:
    """The decode streams' inter-token latency alone, then beside back-to-back long prompts
    (each new: ``tags`` gives its first token, so no prompt finds another's KV cached)."""
    out = {"pools": pools, "decode_streams": len(streams), "prefill_prompt_len": len(prompt.prompt_token_ids)}
    for phase in ("quiet", "with_prefill"):
        stop, num_prompts = threading.Event(), 0

        def prefill() -> None:
            nonlocal num_prompts
            while num_prompts == 0 or not stop.is_set():
                grpc_request(client, variant([prompt], next(tags))[0])
                num_prompts += 1

        prefiller = threading.Thread(target=prefill, daemon=True)  # a failed stream must not leave it running
        start = time.monotonic()
        with ThreadPoolExecutor(len(streams)) as decoders:
            running = [decoders.submit(grpc_request, client, r) for r in variant(streams, next(tags))]
            if phase == "with_prefill":
                prefiller.start()
            itl = [v for future in running for v in future.result().itl_s]
        decode_s = time.monotonic() - start
        stop.set()
        if phase == "with_prefill":
            prefiller.join()  # its last prompt may end after the streams: counted, not timed
        out[phase] = {**latency(itl, "itl"), "itl_ms_mean": _ms(statistics.fmean(itl)), "decode_s": round(decode_s, 2), "prompts_prefilled": num_prompts}
        progress("e2e", f"interference {pools} {phase}: itl p90 {out[phase]['itl_ms_p90']} ms")
    out["itl_p90_ratio"] = round(out["with_prefill"]["itl_ms_p90"] / out["quiet"]["itl_ms_p90"], 3)
    return out


def parse_pools(text: str) -> tuple[int, int]:
    try:
        num_prefill, num_decode = (int(n) for n in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not PREFILL:DECODE (e.g. 1:1)") from None
    if num_prefill < 0 or num_decode < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: needs >= 0 prefill and >= 1 decode replicas")
    return num_prefill, num_decode


def connect(address: str, model: str) -> tuple[SplitServeClient, str]:
    """A client of the router at ``address`` and its pool layout; BenchError if none answers
    or it serves another model than the in-process peer would load."""
    client = SplitServeClient(address)
    try:
        models = [m.id for m in client.list_models()]
        replicas = client.cluster_status().replicas
    except grpc.RpcError as e:
        client.close()
        raise BenchError(f"no splitserve router answers at {address} ({e.code().name}: {e.details()}); start one with `make up`") from None
    if served_model_name(model) not in models:
        client.close()
        raise BenchError(f"the router at {address} serves {', '.join(models) or 'no model'}, not --model {model}")
    return client, f"{sum(r.pool == 'prefill' for r in replicas)}:{sum(r.pool == 'decode' for r in replicas)}"


@contextlib.contextmanager
def local_client(engine: EngineConfig, num_prefill: int, num_decode: int) -> Iterator[SplitServeClient]:
    """A client of a local cluster whose engines share this machine's cores evenly; stopped after."""
    progress("e2e", f"starting a cluster: {num_prefill} prefill, {num_decode} decode")
    threads = max(1, (os.cpu_count() or 1) // (num_prefill + num_decode))
    config = ClusterConfig(
        engine=engine, worker=WorkerConfig(num_threads=threads), prefill=PrefillWorkerConfig(num_threads=threads),
        router=RouterConfig(port=0), num_prefill=num_prefill, num_decode=num_decode,
    )
    with local_cluster(config) as (_, client):
        yield client


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__, plot="throughput and TTFT p90 against concurrency")
    parser.add_argument("--phases", nargs="+", default=["sweep", "interference"], choices=["sweep", "interference"])
    parser.add_argument("--pools", type=parse_pools, nargs="+", default=[(0, 1), (1, 1)], metavar="PREFILL:DECODE")
    parser.add_argument("--address", help="measure the router at HOST:PORT (its pools as they are) instead of local clusters")
    parser.add_argument("--concurrency", type=positive, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=positive, default=2)
    parser.add_argument("--num-requests", type=positive, help="per run (default: 4 x N, at least 16, at most 64)")
    parser.add_argument("--prompt-len", type=positive, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=positive, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--decode-streams", type=positive, default=4)
    parser.add_argument("--decode-output-len", type=positive, default=128)
    parser.add_argument("--prefill-prompt-len", type=positive, default=1024)
    parser.add_argument("--kv-dtype", default=EngineConfig.kv_dtype, choices=["fp32", "bf16", "fp8_e4m3"])
    parser.add_argument("--kv-cache-mib", type=positive, default=2048, help="KV pool of each engine")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    check_ranges(parser, args, "prompt_len", "output_len")
    remote = connect(args.address, args.model) if args.address else None  # before loading: fails in a second
    progress("e2e", f"loading {args.model} in-process")
    engine_config = EngineConfig(model=args.model, kv_dtype=args.kv_dtype, kv_cache_bytes=args.kv_cache_mib << 20)
    sys.setswitchinterval(WorkerProcessConfig().gil_switch_interval_s)  # as a worker process runs
    loop = EngineLoop(lambda: LLMEngine(engine_config), max_waiting_requests=1 << 20, num_threads=os.cpu_count() or 1)
    try:
        loop.start()
    except UnknownModelError as e:
        raise BenchError(f"--model: {e}") from None
    vocab_size = loop.engine.model_config.vocab_size
    tags = itertools.cycle(range(NUM_SPECIAL_TOKENS, vocab_size))
    workload = lambda n, prompt, output, seed: random_workload(n, prompt, output, vocab_size, args.seed + seed)  # noqa: E731
    workloads = {c: workload(args.num_requests or min(64, max(16, 4 * c)), tuple(args.prompt_len), tuple(args.output_len), c) for c in args.concurrency}
    streams = workload(args.decode_streams, (32, 32), (args.decode_output_len,) * 2, -1)
    [long_prompt] = workload(1, (args.prefill_prompt_len,) * 2, (1, 1), -2)
    warmup = [BenchRequest(long_prompt.prompt_token_ids[:n], 4) for n in (*args.prompt_len, args.prefill_prompt_len)]
    runs, interfered = [], []
    try:
        longest = max(args.prompt_len[1] + args.output_len[1], args.prefill_prompt_len + warmup[-1].num_output_tokens, 32 + args.decode_output_len)
        if longest > loop.engine.max_model_len:
            raise BenchError(f"--prompt-len, --output-len, --prefill-prompt-len, --decode-output-len: a request of {longest} tokens exceeds {args.model}'s context of {loop.engine.max_model_len}")
        run_engine(loop, warmup, 2, "warmup")
        for pools in [remote[1]] if remote else [f"{p}:{d}" for p, d in args.pools]:
            with contextlib.nullcontext(remote[0]) if remote else local_client(engine_config, *parse_pools(pools)) as client:
                run_grpc(client, warmup, 2, pools)
                for c in args.concurrency if "sweep" in args.phases else ():
                    for r, system in itertools.product(range(args.rounds), ("engine", "grpc")):
                        wl = variant(workloads[c], next(tags))
                        runs.append(run_engine(loop, wl, c, pools) if system == "engine" else run_grpc(client, wl, c, pools))
                        tok_s = sum(s.num_tokens for s in runs[-1].samples) / runs[-1].wall_s
                        progress("e2e", f"sweep {pools} N={c} round {r + 1}/{args.rounds} {system}: {tok_s:.1f} tok/s")
                if "interference" in args.phases:
                    interfered.append(interference(client, streams, long_prompt, tags, pools))
    finally:
        loop.stop()
        if remote:
            remote[0].close()
    report = {
        "bench": "e2e",
        "model": args.model,
        "kv_dtype": args.kv_dtype,
        "machine": machine(),
        "address": args.address,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        **(summarize(runs) if runs else {}),
        "interference": interfered,
    }
    emit_report(report, args.json)
    if args.plot and runs:
        line = lambda row: "in-process engine" if row["system"] == "engine" else f"gRPC, pools {row['pools']}"  # noqa: E731
        panels = [(f"{name} ({unit})", "concurrency", series(report["runs"], key, line)) for name, unit, key in PLOTTED]
        plot(args.plot, f"bench.e2e: {args.model}, {report['machine']['cpus']} CPUs", panels, logx=True)
    return 0


if __name__ == "__main__":
    sys.exit(run("e2e", main))
