"""engine_cpus: the engine thread and its OpenMP team on their own CPUs, the serving threads on the rest."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.config import WorkerProcessConfig
from engine.cpus import format_cpu_list, move_serving_threads, parse_cpu_list, thread_cpus
from engine.engine_loop import EngineLoop
from engine.params import SamplingParams
from engine.request import EngineRequest
from tests.unit.engine.helpers import make_engine, random_prompts

REPO = Path(__file__).resolve().parents[3]
ALLOWED = frozenset(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(ALLOWED) < 2, reason="splitting CPUs needs at least two")


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-3,8", {0, 1, 2, 3, 8}), (" 2 , 4-5 ", {2, 4, 5}), ("3-3", {3}), ("1,1,0-1", {0, 1})],
)
def test_cpu_lists_parse_like_taskset(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "'' is not a CPU number"), ("a", "'a' is not a CPU number"), ("3-1", "'3-1' is a range that runs backwards"),
     ("1-", "'1-' is not a CPU number"), ("-1", "'-1' is not a CPU number"), ("0,,2", "'' is not a CPU number")],
)
def test_bad_cpu_lists_name_the_part(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_list(text)


def test_cpu_lists_format_as_ranges():
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert parse_cpu_list(format_cpu_list({4, 9, 10, 11})) == {4, 9, 10, 11}


def test_worker_config_names_engine_cpus():
    with pytest.raises(ValueError, match="engine_cpus: '0-x' is not a CPU number"):
        WorkerProcessConfig(engine_cpus="0-x")
    assert WorkerProcessConfig(engine_cpus="1,3-4").engine_cpu_set == {1, 3, 4}
    assert WorkerProcessConfig().engine_cpu_set is None


def test_engine_cpus_covering_every_cpu_leave_none_to_serve():
    with pytest.raises(ValueError, match=f"engine_cpus: {format_cpu_list(ALLOWED)} leaves no CPU for the serving threads"):
        move_serving_threads(ALLOWED)  # refused before any thread moves


def test_engine_loop_on_cpus_that_do_not_exist_fails_start(tiny_llama_dir):
    loop = EngineLoop(lambda: make_engine(tiny_llama_dir), max_waiting_requests=1, num_threads=1, cpus=frozenset({4095}))
    with pytest.raises(ValueError, match="engine_cpus: cannot run on CPUs 4095"):
        loop.start()


async def _drain(loop: EngineLoop, prompt: list[int]) -> list[int]:
    tokens = []
    request = EngineRequest("pin", prompt, None, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), None)
    async for out in loop.generate(request):
        tokens += out.new_token_ids
    return tokens


def test_the_engine_thread_and_its_openmp_team_run_on_the_engine_cpus(tiny_llama_dir):
    engine_cpu = max(ALLOWED)
    before = thread_cpus()
    loop = EngineLoop(lambda: make_engine(tiny_llama_dir), max_waiting_requests=1, num_threads=2, cpus=frozenset({engine_cpu}))
    loop.start()
    try:
        assert len(asyncio.run(_drain(loop, random_prompts([40])[0]))) == 4  # a parallel op starts the OpenMP team
        after = thread_cpus()
        assert after[loop._thread.native_id] == {engine_cpu}
        started = {tid: cpus for tid, cpus in after.items() if tid not in before and tid != loop._thread.native_id}
        assert started and all(cpus == {engine_cpu} for cpus in started.values())  # the OpenMP worker inherited the pin
        assert {tid: after[tid] for tid in before if tid in after} == {tid: before[tid] for tid in before if tid in after}
    finally:
        loop.stop()


REPLICA_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from engine.config import EngineConfig, WorkerProcessConfig
    from engine.cpus import thread_cpus
    from engine.params import SamplingParams
    from engine.replica import EngineReplica
    from engine.request import EngineRequest

    model, engine_cpus = sys.argv[1:]
    engine = EngineConfig(model=model, kv_dtype="fp32", num_kv_blocks=64, max_num_batched_tokens=32)
    replica = EngineReplica("r0", engine, WorkerProcessConfig(engine_cpus=engine_cpus, num_threads=2))

    async def run():
        request = EngineRequest("a", list(range(5, 45)), None, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), None)
        return [t async for out in replica.loop.generate(request) for t in out.new_token_ids]

    tokens = asyncio.run(run())
    threads = {tid: sorted(cpus) for tid, cpus in thread_cpus().items()}
    print(json.dumps({"tokens": tokens, "engine_tid": replica.loop._thread.native_id, "threads": threads}))
    replica.loop.stop()
    """
)


@needs_two_cpus
def test_a_replica_moves_its_serving_threads_off_the_engine_cpus(tiny_llama_dir):
    engine_cpu = max(ALLOWED)
    done = subprocess.run(
        [sys.executable, "-c", REPLICA_SCRIPT, str(tiny_llama_dir), str(engine_cpu)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report["tokens"]) == 3
    threads = {int(tid): set(cpus) for tid, cpus in report["threads"].items()}
    on_engine = {tid for tid, cpus in threads.items() if cpus == {engine_cpu}}
    assert report["engine_tid"] in on_engine and len(on_engine) >= 2  # the engine thread and its OpenMP worker
    serving = ALLOWED - {engine_cpu}
    assert all(cpus == serving for tid, cpus in threads.items() if tid not in on_engine)
    assert len(threads) - len(on_engine) >= 1  # at least the main thread serves


@needs_two_cpus
def test_a_replica_refuses_engine_cpus_that_leave_nothing_to_serve(tiny_llama_dir):
    done = subprocess.run(
        [sys.executable, "-c", REPLICA_SCRIPT, str(tiny_llama_dir), format_cpu_list(ALLOWED)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode != 0
    assert "leaves no CPU for the serving threads" in done.stderr
