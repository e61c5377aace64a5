"""A tensor-parallel decode replica in a real aggregated cluster: SmolLM2-135M at TP 3 placed as
a STRICT_PACK placement group of three Ray actors (fractional CPUs, so it fits a 2-core machine),
served over real gRPC; sizes the model or the cluster cannot take are refused with a sentence;
a follower rank killed mid-prefill takes the replica down as a whole and the controller replaces it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import ray
import torch

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control import placement
from router.control.controller import ControllerConfig, pool_resource
from router.control.launch import Cluster, ClusterConfig
from router.errors import PlacementError
from tests.integration.conftest import running_cluster, wait_until
from tests.integration.test_generate_api import collect
from tests.integration.test_tensor_parallel import expected_rank_bytes
from tests.unit.engine.helpers import random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-m", "cli.main"]
PROMPT = "The three primary colors are"
GREEDY = dict(max_tokens=16, temperature=0, ignore_eos=True)
RANK_CPUS = 0.5
HEALTH = ControllerConfig(health_check_interval_s=0.5, health_check_timeout_s=5.0, max_failed_health_checks=2, restart_backoff_s=0.5)
"""Fast health checks, with a timeout that a TP 3 replica busy prefilling on 2 cores still meets."""
REFUSAL_DEADLINE_S = 60.0
"""A refused start fails within this (loading SmolLM2's shards takes a few seconds); it never waits."""


@pytest.fixture(scope="module")
def engine_config(smollm2_dir, smollm2_cache_dir):
    return EngineConfig(model="smollm2-135m", weights="fp32", cache_dir=smollm2_cache_dir, kv_dtype="fp32", num_kv_blocks=256, max_num_batched_tokens=256)


def tp_cluster_config(engine_config: EngineConfig, decode_tp_size: int = 3, rank_cpus: float = RANK_CPUS) -> ClusterConfig:
    return ClusterConfig(
        engine=engine_config,
        worker=WorkerConfig(tp_rank_cpus=rank_cpus, num_threads=1),
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25),
        controller=HEALTH,
        num_prefill=0,
        decode_tp_size=decode_tp_size,
    )


def start_error(config: ClusterConfig, deadline_s: float) -> BaseException:
    """What ``Cluster.start`` raised for ``config``; fails the test if it started, or had not
    returned within ``deadline_s``. The cluster is stopped either way."""
    cluster = Cluster(config)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = pool.submit(cluster.start)
        try:
            error = started.exception(timeout=deadline_s)
        except concurrent.futures.TimeoutError:
            error = TimeoutError(f"Cluster.start had not returned after {deadline_s} s")
        finally:
            cluster.stop()  # kills the controller, which owns the replica being started: start() returns
    if error is None:
        pytest.fail("the cluster started")
    if isinstance(error, TimeoutError):
        pytest.fail(str(error))
    return error


def groups_in(*states: str) -> dict[str, dict]:
    return {pg_id: g for pg_id, g in ray.util.placement_group_table().items() if g["state"] in states}


def live_placement_groups() -> dict[str, dict]:
    return groups_in("CREATED")


def test_tp_2_of_smollm2_is_refused_with_the_models_sentence(ray_session, engine_config):
    groups_before = live_placement_groups()
    error = start_error(tp_cluster_config(engine_config, decode_tp_size=2), REFUSAL_DEADLINE_S)
    assert "model 'smollm2-135m' (9 attention heads, 3 KV heads) cannot run with tensor parallel size 2" in str(error)
    assert "Sizes that work: 1, 3" in str(error)
    # The refused replica's group is released by the controller, and so is the group of a
    # replacement start that the stop cancelled (a group belongs to the job, so nothing else
    # would release it); removals reach the table asynchronously.
    wait_until(lambda: live_placement_groups().keys() == groups_before.keys())


def test_a_tp_replica_no_node_can_hold_is_refused_with_what_it_needs_and_what_exists(ray_session, engine_config):
    groups_before = live_placement_groups()
    error = start_error(tp_cluster_config(engine_config, rank_cpus=1000), REFUSAL_DEADLINE_S)
    assert isinstance(error, PlacementError)
    resources = ray.cluster_resources()
    slots = pool_resource("decode")
    assert (
        f"a TP 3 decode replica needs {1 + 2 * 1000:g} CPU, 1 {slots} on one node, "
        f"but the largest node has {resources['CPU']:g} CPU, {resources[slots]:g} {slots} (1 nodes alive)"
    ) in str(error)
    assert live_placement_groups().keys() == groups_before.keys()  # refused before any group was asked for


def test_a_start_cancelled_while_its_group_waits_for_room_releases_the_group(ray_session):
    """The controller cancels the starts it has in flight when it stops; a start cancelled while
    Ray holds its group pending (others hold the room) must not leave the group behind, since a
    group outlives the controller that asked for it (it belongs to the job)."""
    slots = pool_resource("decode")
    blocker = ray.util.placement_group([{slots: ray.available_resources()[slots]}], strategy="STRICT_PACK")
    ray.get(blocker.ready())
    try:
        groups_before = groups_in("PENDING", "CREATED")

        async def reserve_then_cancel():
            task = asyncio.create_task(placement.reserve("a TP 2 decode replica", [{slots: 1}], 600.0))
            while not groups_in("PENDING").keys() - groups_before.keys() and not task.done():
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(reserve_then_cancel())
        wait_until(lambda: groups_in("PENDING", "CREATED").keys() == groups_before.keys())
    finally:
        ray.util.remove_placement_group(blocker)


LONG_PROMPT = random_prompts([800], vocab=49152, seed=5)[0]
"""4 chunks of 256: a window to kill a rank in mid-prefill."""
LONG_GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(engine_config):
    """What TP 1 gives, computed in this process before the cluster starts (one engine for both prompts)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine(engine_config)
        [completion] = engine.generate([PROMPT], SamplingParams(**GREEDY))
        [long_completion] = engine.generate([LONG_PROMPT], SamplingParams(**LONG_GREEDY))
        rank_bytes = expected_rank_bytes(engine.runner.model, 3)
        engine.close()
        return dict(tokens=list(completion.output_token_ids), long_tokens=list(long_completion.output_token_ids), rank_bytes=rank_bytes)
    finally:
        torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def cluster(ray_session, reference, engine_config):
    with running_cluster(tp_cluster_config(engine_config)) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with SplitServeClient(cluster.router_status.grpc_address) as c:
        yield c


def decode_replica(client):
    [replica] = [r for r in client.cluster_status().replicas if r.pool == "decode"]
    return replica


def test_greedy_tokens_equal_tp1(client, reference):
    ids, _, last = collect(client.generate(PROMPT, **GREEDY))
    assert ids == reference["tokens"]
    assert last.usage.completion_tokens == GREEDY["max_tokens"]


def test_status_shows_three_live_ranks_on_one_node_each_with_its_kv_head(client, reference):
    replica = decode_replica(client)
    assert (replica.healthy, replica.tp_size) == (True, 3)
    ranks = list(replica.tp_ranks)
    assert [r.rank for r in ranks] == [0, 1, 2]
    assert all(r.alive for r in ranks)
    assert len({r.pid for r in ranks}) == 3 and os.getpid() not in {r.pid for r in ranks}
    assert {r.node_ip for r in ranks} == {"127.0.0.1"}
    assert [(r.kv_head_start, r.kv_head_end) for r in ranks] == [(0, 1), (1, 2), (2, 3)]
    assert [r.param_bytes for r in ranks] == [reference["rank_bytes"]] * 3
    [group] = [g for g in live_placement_groups().values() if len(g["bundles"]) == 3]
    assert group["strategy"] == "STRICT_PACK"
    assert group["bundles"] == {0: {"CPU": 1.0, pool_resource("decode"): 1.0}, 1: {"CPU": RANK_CPUS}, 2: {"CPU": RANK_CPUS}}


def test_cli_status_prints_the_tp_line(client, cluster):
    replica = decode_replica(client)
    result = subprocess.run(CLI + ["status", "--addr", cluster.router_status.grpc_address], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    p0, p1, p2 = (r.pid for r in replica.tp_ranks)
    expected = f"tp 3 on 127.0.0.1 (ranks 0: pid {p0} alive heads 0-1, 1: pid {p1} alive heads 1-2, 2: pid {p2} alive heads 2-3)"
    assert expected in [line.strip() for line in result.stdout.splitlines()]


def process_gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_a_follower_rank_killed_mid_prefill_fails_the_replica_whose_calls_migrate_to_its_replacement(client, reference):
    long_prompt = LONG_PROMPT
    old = decode_replica(client)
    [pool] = [p for p in client.cluster_status().pools if p.pool == "decode"]
    outcome: dict = {}

    def call():
        try:
            outcome["tokens"] = collect(client.generate(long_prompt, **LONG_GREEDY))[0]
        except grpc.RpcError as e:
            outcome["error"] = e
        outcome["answered_s"] = time.monotonic()

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(lambda: 0 < decode_replica(client).num_queued_prefill_tokens < len(long_prompt), 60)  # mid-prefill: a chunk done, more to do
    victim = old.tp_ranks[1].pid
    killed_s = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    caller.join(120)
    assert not caller.is_alive(), "the call neither finished nor failed"

    # The replica's engine failed with the rank: the call migrates to the replacement and is recomputed there.
    assert "error" not in outcome, outcome.get("error")
    assert outcome["tokens"] == reference["long_tokens"]  # the tokens an undisturbed TP 1 run gives

    def replaced():
        fresh = [
            r for r in client.cluster_status().replicas
            if r.pool == "decode" and r.replica_id != old.replica_id and r.healthy and r.tp_size == 3 and all(t.alive for t in r.tp_ranks)
        ]
        return fresh and fresh[0]

    new = wait_until(replaced, 120)
    replaced_s = time.monotonic()
    assert not {t.pid for t in new.tp_ranks} & {t.pid for t in old.tp_ranks}
    wait_until(lambda: all(process_gone(t.pid) for t in old.tp_ranks), 30)  # the whole replica went, not just the rank
    [pool_after] = [p for p in client.cluster_status().pools if p.pool == "decode"]
    assert pool_after.num_restarts == pool.num_restarts + 1
    assert old.replica_id in pool_after.last_failure

    ids, _, _ = collect(client.generate(PROMPT, **GREEDY))
    assert ids == reference["tokens"]
    print(
        f"answered {outcome['answered_s'] - killed_s:.2f} s after the kill; replacement {new.replica_id} healthy after "
        f"{replaced_s - killed_s:.1f} s, served a new request after {time.monotonic() - killed_s:.1f} s; "
        f"pool's last failure: {pool_after.last_failure!r}"
    )
