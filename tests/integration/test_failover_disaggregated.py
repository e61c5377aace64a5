"""Each pool's only replica dies on a real disaggregated cluster (1 prefill + 1 decode, real
NIXL over UCX): the controller replaces it, a call cut during its KV hand-off migrates to the
replacement, and nothing is left leased or open."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

import pytest
import ray

from decode_worker.config import WorkerConfig
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster, wait_until
from tests.integration.test_failover import FAST_HEALTH, GREEDY, collect, engine_config, handles, pool_status  # noqa: F401 (fixture)
from tests.unit.engine.helpers import random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HANDED_OFF = dict(GREEDY, max_tokens=16)
"""A request whose decode replica dies during the hand-off, before its first decode step: its
tokens all come from the replacement, so a few show it recomputed them right."""


@pytest.fixture(scope="module")
def disaggregated(ray_session, engine_config):
    config = ClusterConfig(
        engine=engine_config,
        worker=WorkerConfig(kv_transfer_timeout_s=20),
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25),
        controller=FAST_HEALTH,
        num_prefill=1,
    )
    with running_cluster(config) as c:
        with SplitServeClient(c.router_status.grpc_address) as dc:
            yield c, dc


def quiet(cluster, client):
    """Both pools whole, every block free, no lease or NIXL handle open on either side."""

    def settled():
        live = {s.pool: h for s, _, h in ray.get(cluster.controller.replicas.remote())}
        if set(live) != {"prefill", "decode"}:
            return False
        decode, prefill = ray.get([live["decode"].transfer_stats.remote(), live["prefill"].transfer_stats.remote()])
        replicas = client.cluster_status().replicas
        full = all(r.healthy and r.num_running == 0 and r.num_free_kv_blocks == r.num_kv_blocks for r in replicas)
        return full and (decode.num_open_leases, decode.num_open_handles, prefill.num_open_leases, prefill.num_open_handles) == (0, 0, 0, 0)

    wait_until(settled, 60)


def test_decode_killed_during_the_kv_hand_off_migrates_to_its_replacement(disaggregated):
    cluster, client = disaggregated
    [prompt] = random_prompts([70], seed=9)
    expected, _, _ = collect(client.generate(prompt, **HANDED_OFF))
    [prefill] = handles(cluster, "prefill").values()
    [(victim, decode)] = handles(cluster, "decode").items()
    prefills_before = ray.get(prefill.transfer_stats.remote()).num_prefills
    ray.get(prefill.inject_faults.remote(delay_s=2.0))
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: collect(client.generate(prompt, **HANDED_OFF)))
        wait_until(lambda: ray.get(prefill.transfer_stats.remote()).num_prefills > prefills_before)  # the hand-off is under way
        ray.kill(decode)
        ids, _, _ = answer.result(timeout=120)
    ray.get(prefill.inject_faults.remote())
    assert ids == expected
    assert victim not in handles(cluster, "decode")
    quiet(cluster, client)


def served(client, deadline: float) -> list[int] | None:
    """The tokens of one successful call, or None after an UNAVAILABLE (no live replica yet)."""
    try:
        ids, _, _ = collect(client.generate("hello again", max_tokens=4, ignore_eos=True, timeout_s=max(1.0, deadline - time.monotonic())))
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return None
    return ids


def test_each_pools_only_replica_killed_is_replaced_and_serves_within_60_s(disaggregated):
    cluster, client = disaggregated
    for pool in ("decode", "prefill"):
        [(victim, handle)] = handles(cluster, pool).items()
        restarts = pool_status(client, pool).num_restarts
        ray.kill(handle)
        deadline = time.monotonic() + 60
        ids = wait_until(lambda: served(client, deadline), 60)  # a client retrying on UNAVAILABLE, as clients do
        assert len(ids) == 4
        replaced = wait_until(lambda: (h := handles(cluster, pool)) and victim not in h and h, 60)
        assert pool_status(client, pool).num_restarts == restarts + 1
        quiet(cluster, client)
    [new_prefill] = replaced.values()
    prompts = iter(random_prompts([90] * 50, seed=10))

    def handed_off() -> bool:  # once the router's view has the new prefill replica, it takes the hand-offs
        before = ray.get(new_prefill.transfer_stats.remote()).num_done
        collect(client.generate(next(prompts), max_tokens=4, ignore_eos=True))
        return ray.get(new_prefill.transfer_stats.remote()).num_done == before + 1

    wait_until(handed_off, 30)
