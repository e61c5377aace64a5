"""The serving path's share of a first token, without the engine's noise, beside a bare gRPC call.

    python -m bench.path --json OUT

bench.e2e measures the path under load, where every number moves with the engine's steps. This
one asks the narrow question on a quiet cluster (Ray on loopback, controller, one decode worker,
one router): of a request's time to first token, how much is outside the worker? Each request
is a 4-token prompt with ``max_tokens`` 1, sent ``--requests`` times one after another, waiting
``--gap-s`` between two (each gap separately: a core that has idled for a while wakes up
slower, and on a lightly loaded server every hop starts from idle). Per request:

- ``path``: the client's time to first token minus the worker's own (``Timings.worker_first_token_s``),
  i.e. client → router → request plane → worker and back, with the router's work and the
  worker's event loop before and after the engine;
- ``floor`` (the peer): the same client's time to the first message of a ``Generate`` call on a
  bare ``grpc.aio`` server (one response per call, no work) in a process on the same CPUs as
  the router. What is above it is the router, the request plane and the worker's event loop.

Both are measured with ``SplitServeClient`` (``client``) and with a plain channel without its
single-threaded stream option (``threaded_channel``), which is what the client used to be.
With ``--engine-cpus LIST`` the engine runs alone on those CPUs and everything else, the bare
server included, on the rest (bench.e2e's layout).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc

from bench.e2e import _cluster
from bench.workload import emit_report, percentile
from engine.config import EngineConfig
from engine.cpus import move_serving_threads, parse_cpu_list
from proto import splitserve_pb2 as pb
from proto import splitserve_pb2_grpc as pb_grpc
from router.client import SplitServeClient, build_generate_request

WARMUP = 10
ONE_TOKEN = dict(max_tokens=1, temperature=0, ignore_eos=True)


def _prompt(i: int) -> list[int]:
    """Four tokens, a new first one per request (too short to fill a cache block anyway)."""
    return [1000 + i % 8000, 17, 29, 31]


class _BareGeneration(pb_grpc.GenerationServicer):
    """Answers every Generate with one response at once: a gRPC call and nothing else."""

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        yield pb.GenerateResponse(request_id=request.request_id, token_ids=request.prompt_token_ids[:1], finish_reason=pb.FINISH_REASON_LENGTH)


def _serve_bare(port: multiprocessing.Value, ready: multiprocessing.Event, cpus: frozenset[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)

    async def main() -> None:
        server = grpc.aio.server()
        pb_grpc.add_GenerationServicer_to_server(_BareGeneration(), server)
        port.value = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def _time_first(calls: Callable[[int], Iterator[pb.GenerateResponse]], requests: int, gap_s: float, worker_side: bool) -> list[float]:
    """Per request after the warm-up, ms to the first response (minus the worker's own time when
    ``worker_side``). Each stream is read to its end before the gap starts."""
    out = []
    for i in range(WARMUP + requests):
        time.sleep(gap_s)
        start = time.perf_counter()
        stream = calls(i)
        first = next(stream)
        ms = (time.perf_counter() - start) * 1000
        last = first
        for last in stream:
            pass
        if worker_side:
            if not last.HasField("timings"):
                raise RuntimeError("the last response carries no timings: is this a splitserve router?")
            ms -= last.timings.worker_first_token_s * 1000
        if i >= WARMUP:
            out.append(ms)
    return out


def _summary(ms: list[float]) -> dict:
    return {
        "p50": round(statistics.median(ms), 3),
        "p90": round(percentile(ms, 90), 3),
        "mean": round(statistics.fmean(ms), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--requests", type=int, default=100, help="per gap, client and system, after 10 warm-up requests (default: 100)")
    parser.add_argument("--gap-s", type=float, nargs="+", default=[0.002, 0.05], help="idle time between two requests (default: 0.002 0.05)")
    parser.add_argument("--engine-cpus", default=None, metavar="LIST", help="CPUs for the engine alone; everything else gets the others")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests: must be at least 1")
    if any(g < 0 for g in args.gap_s):
        parser.error("--gap-s: must not be negative")

    engine_cpus = serving = None
    if args.engine_cpus is not None:
        try:
            engine_cpus = parse_cpu_list(args.engine_cpus)
            serving = move_serving_threads(engine_cpus)  # before Ray starts: its processes inherit it
        except ValueError as e:
            parser.error(f"--engine-cpus: {e}")

    spawn = multiprocessing.get_context("spawn")  # no forked copy of this process's threads
    bare_port, ready = spawn.Value("i", 0), spawn.Event()
    bare = spawn.Process(target=_serve_bare, args=(bare_port, ready, serving), daemon=True)
    bare.start()
    threads = len(engine_cpus) if engine_cpus else os.cpu_count() or 1
    cluster = _cluster(EngineConfig(model=args.model, kv_cache_bytes=1 << 30), threads, disaggregated=False, engine_cpus=args.engine_cpus)
    status = cluster.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the bare gRPC server did not start within 60 s")
        addresses = {"splitserve": status.grpc_address, "bare_grpc": f"127.0.0.1:{bare_port.value}"}
        clients: dict[str, dict[str, Callable[[int], Iterator[pb.GenerateResponse]]]] = {}
        for system, address in addresses.items():
            client = SplitServeClient(address)
            plain = pb_grpc.GenerationStub(grpc.insecure_channel(address))
            clients[system] = {
                "client": lambda i, c=client: c.generate(_prompt(i), **ONE_TOKEN),
                "threaded_channel": lambda i, p=plain: p.Generate(build_generate_request(_prompt(i), **ONE_TOKEN)),
            }
        results = []
        for gap_s in args.gap_s:
            for variant in ("client", "threaded_channel"):
                path = _time_first(clients["splitserve"][variant], args.requests, gap_s, worker_side=True)
                floor = _time_first(clients["bare_grpc"][variant], args.requests, gap_s, worker_side=False)
                row = {"gap_s": gap_s, "client": variant, "path_ms": _summary(path), "floor_ms": _summary(floor)}
                row["path_over_floor_ms_p50"] = round(row["path_ms"]["p50"] - row["floor_ms"]["p50"], 3)
                print(row, file=sys.stderr, flush=True)
                results.append(row)
    finally:
        cluster.stop()
        bare.terminate()
        bare.join(10)
    emit_report(
        {
            "model": args.model,
            "requests": args.requests,
            "engine_cpus": sorted(engine_cpus) if engine_cpus else None,
            "serving_cpus": sorted(serving) if serving else None,
            "results": results,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
