"""What work on the other cores costs an engine that has cores of its own.

    python -m bench.interference --json OUT

The engine runs on ``--engine-cpu`` with one torch thread and steps a batch of ``--batch``
decoding requests (no prefill in the timed steps). Meanwhile one process runs on ``--load-cpu``:

- ``idle``: nothing (the peer every other load is compared with, in the same run);
- ``python``: a pure-Python loop, as a router or a client thread is between two syscalls;
- ``memory``: a single-threaded torch loop streaming a 256 MiB tensor through memory.

The loads alternate, ``--rounds`` times, because this machine's speed drifts between minutes.
Each is reported as the median decode step (wall and the engine thread's CPU time) and its
slowdown against ``idle``. The engine never shares a core or the GIL with the load, so what it
loses is what the cores share below the OS: caches, memory bandwidth and, in a VM, the host's
cores. That is what bench.e2e's ``engine_vs_bracket`` finds when the router and the gRPC clients
run on the core beside the engine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.workload import emit_report
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams

LOADS = {
    "idle": None,
    "python": "while True:\n    pass",
    "memory": "import torch\ntorch.set_num_threads(1)\na = torch.ones(64 << 20)\nwhile True:\n    a.add_(1.0)",
}


def decode_steps(engine: LLMEngine, batch: int, num_tokens: int, first_token: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each decode step of ``batch`` requests with 40-token prompts; the
    prefill steps are left out."""
    for i in range(batch):
        prompt = [first_token + i] + list(range(300, 339))
        engine.add_request(f"interference-{first_token}-{i}", prompt, SamplingParams(max_tokens=num_tokens, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        before = engine.stats()
        engine.step()
        after = engine.stats()
        if after.num_step_tokens - before.num_step_tokens <= batch:  # one token per request: decode only
            steps.append((after.step_s - before.step_s, after.step_cpu_s - before.step_cpu_s))
    return steps


def summarize(samples: dict[str, list[list[tuple[float, float]]]]) -> dict:
    """Median decode step per load (over all its rounds' steps) and its slowdown against idle."""
    out = {}
    for load, rounds in samples.items():
        steps = [s for r in rounds for s in r]
        wall = statistics.median(w for w, _ in steps)
        out[load] = {
            "decode_step_ms_p50": round(1000 * wall, 2),
            "decode_step_cpu_ms_p50": round(1000 * statistics.median(c for _, c in steps), 2),
            "decode_step_ms_p50_by_round": [round(1000 * statistics.median(w for w, _ in r), 2) for r in rounds],
            "num_steps": len(steps),
        }
    idle = out["idle"]["decode_step_ms_p50"]
    for load in out:
        out[load]["slowdown_vs_idle"] = round(out[load]["decode_step_ms_p50"] / idle - 1, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engine-cpu", type=int, default=0)
    parser.add_argument("--load-cpu", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=60, help="output tokens per request (default: 60)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    available = os.sched_getaffinity(0)
    for name, cpu in (("--engine-cpu", args.engine_cpu), ("--load-cpu", args.load_cpu)):
        if cpu not in available:
            parser.error(f"{name}: CPU {cpu} is not one this process may run on ({sorted(available)})")
    if args.engine_cpu == args.load_cpu:
        parser.error("--load-cpu: must differ from --engine-cpu (the point is a core of the engine's own)")

    os.sched_setaffinity(0, {args.engine_cpu})  # before torch starts its OpenMP team: it inherits the CPU
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_bytes=1 << 30))
    decode_steps(engine, args.batch, 8, first_token=100)  # warm up
    samples: dict[str, list] = {load: [] for load in LOADS}
    first_token = 1000
    for _ in range(args.rounds):
        for load, code in LOADS.items():
            process = None
            if code is not None:
                process = subprocess.Popen([sys.executable, "-c", code], preexec_fn=lambda: os.sched_setaffinity(0, {args.load_cpu}))
                time.sleep(1.0)  # its start-up (importing torch) out of the way
            try:
                samples[load].append(decode_steps(engine, args.batch, args.tokens, first_token))
            finally:
                if process is not None:
                    process.kill()
                    process.wait()
            first_token += args.batch
    report = {
        "model": args.model,
        "engine_cpu": args.engine_cpu,
        "load_cpu": args.load_cpu,
        "batch": args.batch,
        "rounds": args.rounds,
        "loads": summarize(samples),
    }
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
