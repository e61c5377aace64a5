"""The serving path's cost: the same workload through gRPC on a local cluster and on the engine in-process.

    python -m bench.e2e --json OUT

Both runs use one engine configuration and a closed loop of N concurrent requests (random
prompt tokens, exact output lengths, EOS ignored). The gRPC runs start a local Ray cluster
(controller, one decode replica, one router; plus one prefill replica in the disaggregated run,
the cores split between the two workers) and drive it with N client threads; the in-process run
steps an LLMEngine directly. TTFT runs from handing the request over to its first
token; inter-token latency is the gap between two token-bearing responses, per token.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

from bench.workload import BenchRequest, emit_report, percentile, random_workload
from decode_worker.config import WorkerConfig
from prefill_worker.config import PrefillWorkerConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from router.client import SplitServeClient
from router.config import RouterConfig
from router.launch import Cluster, ClusterConfig

NUM_SPECIAL_TOKENS = 32


class _Recorder:
    """Per-request timestamps of token-bearing outputs, from which all latencies derive."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft_s: list[float] = []
        self.itl_s: list[float] = []
        self.num_tokens = 0

    def request(self, start: float, events: list[tuple[float, int]]) -> None:
        with self.lock:
            self.ttft_s.append(events[0][0] - start)
            for (t0, _), (t1, n) in zip(events, events[1:]):
                self.itl_s += [(t1 - t0) / n] * n
            self.num_tokens += sum(n for _, n in events)

    def result(self, system: str, concurrency: int, wall_s: float) -> dict:
        ms = lambda v: round(v * 1000, 2)  # noqa: E731
        return {
            "system": system,
            "concurrency": concurrency,
            "output_tok_per_s": round(self.num_tokens / wall_s, 2),
            "ttft_ms_p50": ms(percentile(self.ttft_s, 50)),
            "ttft_ms_p99": ms(percentile(self.ttft_s, 99)),
            "itl_ms_p50": ms(percentile(self.itl_s, 50)),
            "itl_ms_p99": ms(percentile(self.itl_s, 99)),
            "num_output_tokens": self.num_tokens,
            "wall_s": round(wall_s, 2),
        }


def run_in_process(engine: LLMEngine, workload: list[BenchRequest], concurrency: int) -> dict:
    recorder = _Recorder()
    queue = list(enumerate(workload))
    started: dict[str, float] = {}
    events: dict[str, list[tuple[float, int]]] = {}
    start = time.perf_counter()
    while queue or started:
        while queue and len(started) < concurrency:
            index, req = queue.pop(0)
            rid = f"e2e-{concurrency}-{index}"
            engine.add_request(rid, list(req.prompt_token_ids), SamplingParams(max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True))
            started[rid], events[rid] = time.perf_counter(), []
        for out in engine.step():
            now = time.perf_counter()
            if out.new_token_ids:
                events[out.request_id].append((now, len(out.new_token_ids)))
            if out.finished:
                recorder.request(started.pop(out.request_id), events.pop(out.request_id))
    return recorder.result("in_process", concurrency, time.perf_counter() - start)


def run_grpc(client: SplitServeClient, workload: list[BenchRequest], concurrency: int, system: str = "grpc") -> dict:
    recorder = _Recorder()
    queue = list(workload)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                req = queue.pop(0)
            events = []
            t0 = time.perf_counter()
            for response in client.generate(list(req.prompt_token_ids), max_tokens=req.num_output_tokens, temperature=0, ignore_eos=True):
                if response.token_ids:
                    events.append((time.perf_counter(), len(response.token_ids)))
            recorder.request(t0, events)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return recorder.result(system, concurrency, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--kv-dtype", default=EngineConfig.kv_dtype)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=["aggregated", "disaggregated"], choices=["aggregated", "disaggregated"])
    args = parser.parse_args(argv)

    engine_config = EngineConfig(model=args.model, kv_dtype=args.kv_dtype, kv_cache_bytes=2 << 30)
    engine = LLMEngine(engine_config)
    # One workload per concurrency (seeded by it), shared by both systems: no run finds its
    # prompts cached by an earlier one, on the worker or in-process.
    workloads = {
        c: random_workload(
            args.num_requests, tuple(args.prompt_len), tuple(args.output_len), engine.model_config.vocab_size, NUM_SPECIAL_TOKENS, args.seed + c
        )
        for c in args.concurrency
    }
    warmup = [BenchRequest(tuple(range(100, 100 + n)), 4) for n in (40, 70)]
    results = []
    run_in_process(engine, warmup, 2)
    for concurrency in args.concurrency:
        results.append(run_in_process(engine, workloads[concurrency], concurrency))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    del engine

    threads = torch.get_num_threads()
    for mode in args.modes:
        disaggregated = mode == "disaggregated"
        system = "grpc_disaggregated" if disaggregated else "grpc"
        worker_threads = max(1, threads // 2) if disaggregated else threads
        config = ClusterConfig(
            engine=engine_config,
            worker=WorkerConfig(num_threads=worker_threads),
            prefill=PrefillWorkerConfig(num_threads=worker_threads),
            router=RouterConfig(port=0),
            num_prefill=1 if disaggregated else 0,
        )
        cluster = Cluster(config)
        status = cluster.start()
        try:
            with SplitServeClient(status.grpc_address) as client:
                run_grpc(client, warmup, 2, system)
                for concurrency in args.concurrency:
                    results.append(run_grpc(client, workloads[concurrency], concurrency, system))
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        finally:
            cluster.stop()
    report = {
        "model": args.model,
        "kv_dtype": args.kv_dtype,
        "num_requests": args.num_requests,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "results": results,
        "serving_overhead": _overhead(results),
        "disaggregated_vs_aggregated": _versus(results, "grpc_disaggregated", "grpc"),
    }
    emit_report(report, args.json)
    return 0


def _overhead(results: list[dict]) -> dict[str, dict[str, float]]:
    by = {(r["system"], r["concurrency"]): r for r in results}
    out = {}
    for (system, c), grpc_run in by.items():
        local = by.get(("in_process", c))
        if system == "grpc" and local:
            out[str(c)] = {
                "throughput_loss": round(1 - grpc_run["output_tok_per_s"] / local["output_tok_per_s"], 4),
                "ttft_ms_p50_added": round(grpc_run["ttft_ms_p50"] - local["ttft_ms_p50"], 2),
            }
    return out


def _versus(results: list[dict], system: str, baseline: str) -> dict[str, dict[str, float]]:
    by = {(r["system"], r["concurrency"]): r for r in results}
    out = {}
    for (name, c), run in by.items():
        base = by.get((baseline, c))
        if name == system and base:
            out[str(c)] = {
                "throughput_ratio": round(run["output_tok_per_s"] / base["output_tok_per_s"], 3),
                "ttft_ms_p50_delta": round(run["ttft_ms_p50"] - base["ttft_ms_p50"], 2),
                "itl_ms_p50_delta": round(run["itl_ms_p50"] - base["itl_ms_p50"], 2),
            }
    return out


if __name__ == "__main__":
    sys.exit(main())
