"""The same engine in this process and in a Ray actor, on the same pinned CPU, step for step.

    env -u OMP_NUM_THREADS python -m bench.actor_engine --json OUT
    OMP_NUM_THREADS=1 python -m bench.actor_engine --json OUT

bench.e2e compares a decode worker's engine (a Ray actor) with an engine in the bench's own
process, so anything that makes one process's engine faster than the other's, with no serving
path involved, lands in its verdict. This measures that alone: one engine here and one in an
actor started as the controller starts a decode worker (``num_cpus`` of a ``ReplicaSpec``), both
on ``--engine-cpu`` with one torch thread (``EngineReplica``, as a worker builds its engine),
everything else on the other CPUs. They take turns,
``--blocks`` times, order swapped every block (the machine's speed drifts between minutes), each
a block of ``--steps`` timed steps of one kind:

- ``decode``: 8 requests of 64 prompt tokens, decoding;
- ``prefill``: one request's ``--prompt-len`` tokens in one step.

Reported per kind: each side's median step (wall and the engine thread's CPU time) and, block by
block, the actor's median over this process's, with their mean. Ray sets ``OMP_NUM_THREADS`` in
an actor where it is unset; set in this process's environment, both have the same.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import ray

from bench.workload import emit_report
from engine.config import EngineConfig, WorkerProcessConfig
from engine.cpus import move_serving_threads
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from engine.replica import EngineReplica
from router.controller import ReplicaSpec

Timing = tuple[float, float]  # (wall s, engine thread CPU s) of one step


def _add(engine: LLMEngine, request_id: str, first: int, length: int, max_tokens: int) -> None:
    # A distinct first token: no two requests share a cached block.
    prompt = [100 + first] + list(range(1000, 1000 + length - 1))
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


def _timed(engine: LLMEngine) -> Timing:
    wall, cpu = time.perf_counter(), time.thread_time()
    engine.step()
    return time.perf_counter() - wall, time.thread_time() - cpu


def _finish(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def decode_steps(engine: LLMEngine, steps: int, block: int) -> list[Timing]:
    for i in range(8):
        _add(engine, f"d{block}-{i}", 8 * block + i, 64, steps + 2)
    engine.step()  # the prompts
    out = [_timed(engine) for _ in range(steps)]
    _finish(engine)
    return out


def prefill_steps(engine: LLMEngine, steps: int, block: int, prompt_len: int) -> list[Timing]:
    out = []
    for i in range(steps):
        _add(engine, f"p{block}-{i}", 20_000 + steps * block + i, prompt_len, 1)
        out.append(_timed(engine))
        _finish(engine)
    return out


class TimedReplica(EngineReplica):
    """An engine set up as a decode worker sets up its own, taking timed steps on request: one
    in this process, one as a Ray actor."""

    pool = "decode"

    def omp_num_threads(self) -> str | None:
        return os.environ.get("OMP_NUM_THREADS")

    async def run(self, kind: str, steps: int, block: int, prompt_len: int) -> list[Timing]:
        return await self.loop.call(lambda engine: run_kind(engine, kind, steps, block, prompt_len))


def run_kind(engine: LLMEngine, kind: str, steps: int, block: int, prompt_len: int) -> list[Timing]:
    return decode_steps(engine, steps, block) if kind == "decode" else prefill_steps(engine, steps, block, prompt_len)


def summarize(here: list[list[Timing]], actor: list[list[Timing]]) -> dict:
    """Per side the median step over all blocks (ms), and block by block the actor's median wall
    time over this process's."""
    med = lambda blocks, i: statistics.median(t[i] for block in blocks for t in block) * 1000  # noqa: E731
    ratios = [statistics.median(a[0] for a in ab) / statistics.median(h[0] for h in hb) for hb, ab in zip(here, actor)]
    return {
        "process_step_ms_p50": round(med(here, 0), 2),
        "process_step_cpu_ms_p50": round(med(here, 1), 2),
        "actor_step_ms_p50": round(med(actor, 0), 2),
        "actor_step_cpu_ms_p50": round(med(actor, 1), 2),
        "actor_over_process_by_block": [round(r, 4) for r in ratios],
        "actor_over_process_mean": round(statistics.fmean(ratios), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--engine-cpu", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per block (default: 12)")
    parser.add_argument("--prompt-len", type=int, default=150)
    parser.add_argument("--kinds", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.steps < 1 or args.prompt_len < 2:
        parser.error("--blocks and --steps must be at least 1, --prompt-len at least 2")
    cpu = args.engine_cpu
    try:
        move_serving_threads(frozenset({cpu}))  # before Ray: its processes inherit the other CPUs
    except ValueError as e:
        parser.error(f"--engine-cpu: {e}")
    config = EngineConfig(model=args.model, kv_cache_bytes=1 << 30)
    process = WorkerProcessConfig(engine_cpus=str(cpu), num_threads=1)
    here = TimedReplica("process", config, process)
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(TimedReplica).options(num_cpus=ReplicaSpec.num_cpus).remote("actor", config, process)
        report = {
            "model": args.model,
            "engine_cpu": cpu,
            "omp_num_threads": {"process": here.omp_num_threads(), "actor": ray.get(actor.omp_num_threads.remote())},
        }
        for kind in args.kinds:
            blocks: dict[str, list[list[Timing]]] = {"process": [], "actor": []}
            # Warm-up, both sides, then the blocks.
            ray.get(actor.run.remote(kind, 2, -1, args.prompt_len))
            asyncio.run(here.run(kind, 2, -2, args.prompt_len))
            for block in range(args.blocks):
                for side in ("process", "actor") if block % 2 == 0 else ("actor", "process"):
                    if side == "actor":
                        blocks[side].append(ray.get(actor.run.remote(kind, args.steps, 2 * block, args.prompt_len)))
                    else:
                        blocks[side].append(asyncio.run(here.run(kind, args.steps, 2 * block + 1, args.prompt_len)))
            report[kind] = summarize(blocks["process"], blocks["actor"])
    finally:
        ray.shutdown()
        here.stop_engine()
    emit_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
