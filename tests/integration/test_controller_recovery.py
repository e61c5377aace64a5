"""The control plane survives its own faults (real Ray, real gRPC): the controller killed with
SIGKILL is restarted by Ray and rebuilds its map from the live replica actors; replicas and
routers outlive it; a dead router is started again on its port; an old generation is fenced.

One cluster for the module (two decode replicas, two routers); each test leaves it whole.
Recovery times are printed (``-s`` shows them) and asserted only against the issue's bound.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from dataclasses import replace

import pytest
import ray

from decode_worker.actor import DecodeWorker
from engine.config import EngineConfig
from ray.experimental import internal_kv
from router.client import SplitServeClient
from router.config import RouterConfig
from router.config import NAMESPACE
from router.control.controller import ControllerConfig, StaleGenerationError
from router.control.controller_config import parse_replica_name
from router.control.controller_store import ControllerStore
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster, wait_until
from tests.integration.test_generate_api import collect

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HEALS_WITHIN_S = 60.0
"""The issue's bound on a pool healing after the controller and then a decode replica are killed."""
GREEDY = dict(temperature=0, max_tokens=200, ignore_eos=True)
FAST_HEALTH = ControllerConfig(health_check_interval_s=0.3, health_check_timeout_s=3.0, max_failed_health_checks=2, restart_backoff_s=0.5)


def sample(url: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` at the Prometheus endpoint ``url``."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    [value] = [float(line.split(" ")[1]) for line in text.splitlines() if line.split(" ")[0] == name]
    return value


def live_names() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}


def replica_names() -> set[str]:
    return {n for n in live_names() if parse_replica_name(n) is not None}


def named_groups() -> set[str]:
    return {g["name"] for g in ray.util.placement_group_table().values() if g.get("name", "").startswith("splitserve-") and g["state"] != "REMOVED"}


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=128, max_num_seqs=4, max_model_len=512)
    config = ClusterConfig(
        engine=engine, router=RouterConfig(port=0, worker_refresh_interval_s=0.25), controller=FAST_HEALTH, num_decode=2, num_routers=2
    )
    with running_cluster(config) as c:
        yield c
    assert not {n for n in live_names() if n.startswith("splitserve-")}, "a detached actor outlived Cluster.stop"
    assert not named_groups(), "a replica's placement group outlived Cluster.stop"


@pytest.fixture(scope="module")
def clients(cluster):
    with SplitServeClient(cluster.router_statuses[0].grpc_address) as first, SplitServeClient(cluster.router_statuses[1].grpc_address) as second:
        yield first, second


def pid_of(handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))


def generation(cluster) -> int:
    return ray.get(cluster.controller.controller_history.remote()).generation


def decode_ids(client) -> list[str]:
    return sorted(r.replica_id for r in client.cluster_status().replicas if r.pool == "decode" and r.healthy)


def kill_controller(cluster) -> tuple[int, float]:
    """SIGKILL the controller's process; its generation before, and when it was killed."""
    before = generation(cluster)
    os.kill(pid_of(cluster.controller), signal.SIGKILL)
    return before, time.monotonic()


def controller_back(cluster, before: int) -> None:
    def answers() -> bool:
        try:
            return ray.get(cluster.controller.controller_history.remote(), timeout=5).generation == before + 1
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return False

    wait_until(answers, HEALS_WITHIN_S, 0.1)


def test_kill_9_of_the_controller_then_of_a_decode_replica_heals_the_pool(cluster, clients):
    first, second = clients
    prompt = "the controller dies under this stream"
    expected = collect(first.generate(prompt, **GREEDY))[0]
    replicas_before = replica_names()
    pids_before = {name: pid_of(ray.get_actor(name, namespace=NAMESPACE)) for name in replicas_before}

    stream = second.generate(prompt, **GREEDY)
    head = [next(stream) for _ in range(3)]
    before, killed_at = kill_controller(cluster)
    assert collect(first.generate(prompt, **GREEDY))[0] == expected  # served from the router's last map
    controller_back(cluster, before)
    controller_s = time.monotonic() - killed_at
    status = ray.get(cluster.controller.cluster_status.remote()).controller  # what `splitserve status` prints
    assert status.generation == before + 1 and status.num_restarts >= 1 and status.last_restart_unix_s > 0
    assert collect(head)[0] + collect(stream)[0] == expected

    # Adopted, not restarted: the same replica actors, in the same processes.
    assert replica_names() == replicas_before
    assert {name: pid_of(ray.get_actor(name, namespace=NAMESPACE)) for name in replicas_before} == pids_before
    wait_until(lambda: decode_ids(first) == ["decode-0", "decode-1"], HEALS_WITHIN_S)

    victim = ray.get_actor("splitserve-decode-0", namespace=NAMESPACE)
    os.kill(pid_of(victim), signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: len(decode_ids(first)) == 2 and "decode-0" not in decode_ids(first), HEALS_WITHIN_S, 0.1)
    healed_s = time.monotonic() - killed_at
    assert decode_ids(first) == ["decode-1", "decode-2"]  # the new id follows the observed ones: none reused
    wait_until(lambda: replica_names() == {"splitserve-decode-1", "splitserve-decode-2"})
    assert collect(second.generate(prompt, **GREEDY))[0] == expected
    print(f"\ncontroller back after SIGKILL: {controller_s:.2f} s; decode pool healed after SIGKILL of a replica: {healed_s:.2f} s")

    metrics = ray.get(cluster.controller.metrics_address.remote())
    assert sample(metrics, "splitserve_controller_restarts_total") == 1
    assert sample(metrics, "splitserve_controller_generation") == before + 1
    assert time.time() - 120 < sample(metrics, "splitserve_controller_last_restart_timestamp_seconds") < time.time()


def hold_busy(worker) -> None:
    """Run inside a decode replica: its status reports one request waiting, so a drain waits."""
    real = worker.status_fields

    async def busy():
        fields = await real()
        fields["num_waiting"] += 1
        return fields

    busy.real = real
    worker.status_fields = busy


def let_go(worker) -> None:
    worker.status_fields = worker.status_fields.real


def test_a_controller_killed_during_a_scale_down_finishes_it_with_no_replica_lost_or_doubled(cluster, clients):
    first, _ = clients
    wait_until(lambda: len(decode_ids(first)) == 2, HEALS_WITHIN_S)
    older, newest = decode_ids(first)
    draining = ray.get_actor(f"splitserve-{newest}", namespace=NAMESPACE)
    ray.get(draining.__ray_call__.remote(hold_busy))
    store = ControllerStore()

    ray.get(cluster.controller.scale_pool.remote("decode", 1))
    assert store.replicas()[newest].draining  # recorded before the controller acts on it
    before, _ = kill_controller(cluster)
    controller_back(cluster, before)

    [pool] = [p for p in first.cluster_status().pools if p.pool == "decode"]
    assert (pool.target_replicas, pool.num_replicas, pool.num_draining, pool.num_starting) == (1, 2, 1, 0)
    assert replica_names() == {f"splitserve-{older}", f"splitserve-{newest}"}
    ray.get(draining.__ray_call__.remote(let_go))
    wait_until(lambda: replica_names() == {f"splitserve-{older}"}, HEALS_WITHIN_S)
    assert decode_ids(first) == [older]
    assert collect(first.generate("one replica left", max_tokens=5))[0]

    ray.get(cluster.controller.scale_pool.remote("decode", 2))
    assert len(decode_ids(first)) == 2
    wait_until(lambda: len(replica_names()) == 2)


GATE = b"slow-start-gate"
GATE_NAMESPACE = "splitserve-test"


class SlowDecodeWorker(DecodeWorker):
    """A decode replica whose start waits until the test opens a gate (a key in Ray's internal KV)."""

    def __init__(self, *args, **kwargs) -> None:
        while internal_kv._internal_kv_get(GATE, namespace=GATE_NAMESPACE) is None:
            time.sleep(0.05)
        super().__init__(*args, **kwargs)


def test_a_controller_killed_during_a_scale_up_rolls_the_half_started_replica_back_and_finishes_it(cluster, clients):
    first, _ = clients
    wait_until(lambda: len(decode_ids(first)) == 2, HEALS_WITHIN_S)
    spec = cluster.config.replica_spec("decode")
    slow = replace(spec, actor_class=f"{__name__}:SlowDecodeWorker")
    internal_kv._internal_kv_del(GATE, namespace=GATE_NAMESPACE)
    ray.get(cluster.controller.set_pool.remote(slow, 2))  # the pool's next replicas start slowly; its two replicas stay
    before_names = replica_names()

    scaling = cluster.controller.scale_pool.remote("decode", 3)
    [half_started] = wait_until(lambda: replica_names() - before_names)
    before, _ = kill_controller(cluster)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(scaling)
    controller_back(cluster, before)

    # The half-started replica is stopped and one new replica starts in its place, with a new id.
    [replacement] = wait_until(lambda: replica_names() - before_names - {half_started})
    wait_until(lambda: half_started not in replica_names())  # a killed actor's name goes once Ray has it dead
    assert parse_replica_name(replacement)[1] == parse_replica_name(half_started)[1] + 1
    internal_kv._internal_kv_put(GATE, b"open", namespace=GATE_NAMESPACE)
    wait_until(lambda: len(decode_ids(first)) == 3, HEALS_WITHIN_S)
    assert replica_names() == before_names | {replacement}
    assert not named_groups() - {f"splitserve-{rid}" for rid in decode_ids(first)}

    ray.get(cluster.controller.set_pool.remote(spec, 2))  # back to two replicas of the usual class
    wait_until(lambda: replica_names() == before_names)


def test_a_dead_router_is_started_again_on_its_port(cluster, clients):
    first, second = clients
    address = cluster.router_statuses[1].grpc_address
    old = cluster.router_handle("router-1")
    os.kill(pid_of(old), signal.SIGKILL)
    killed_at = time.monotonic()

    def replaced() -> bool:
        try:
            new = cluster.router_handle("router-1")
            return new != old and ray.get(new.__ray_call__.remote(lambda self: self._server is not None), timeout=5)
        except (ValueError, ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return False

    wait_until(replaced, HEALS_WITHIN_S, 0.1)
    print(f"\nrouter started again after SIGKILL: {time.monotonic() - killed_at:.2f} s")
    wait_until(lambda: second.list_models(), HEALS_WITHIN_S)  # the same address serves again
    assert collect(second.generate("after the router came back", max_tokens=5))[0]
    assert {r.router_id: r.grpc_address for r in first.cluster_status().routers}["router-1"] == address
    assert sample(ray.get(cluster.controller.metrics_address.remote()), "splitserve_router_restarts_total") == 1


def test_acts_of_a_stale_generation_are_refused(cluster, clients):
    first, _ = clients
    current = generation(cluster)
    with pytest.raises(StaleGenerationError, match=f"generation {current - 1} is stale: this controller is generation {current}"):
        ray.get(cluster.controller.scale_pool.remote("decode", 1, generation=current - 1))

    store = ControllerStore()
    history = store.history()
    store._put("history", type(history)(current + 1, history.num_restarts, history.last_restart_unix_s))  # a newer controller took over
    try:
        with pytest.raises(StaleGenerationError, match=f"controller generation {current} is fenced: generation {current + 1} has taken over"):
            ray.get(cluster.controller.scale_pool.remote("decode", 1))
    finally:
        store._put("history", history)
    [pool] = [p for p in first.cluster_status().pools if p.pool == "decode"]
    assert (pool.target_replicas, pool.num_replicas, pool.num_draining) == (2, 2, 0)
    assert len(replica_names()) == 2


def test_the_store_keeps_what_a_restart_cannot_observe(ray_session):
    """Ray's internal KV, under a namespace of the test's own (the cluster's is in use)."""
    from router.control.controller_store import ReplicaRecord

    store = ControllerStore("splitserve-test-store")
    store.clear()
    first = store.begin_generation(restarted=False)
    store.save_pool("decode", "a spec", 2)
    store.save_replica(ReplicaRecord("decode-0", "decode", "node-a", 100.0))
    store.save_draining_node("node-b", 30.0)
    assert [store.reserve_id("decode", 0), store.reserve_id("decode", 0), store.reserve_id("decode", 7), store.reserve_id("decode", 0)] == [0, 1, 7, 8]

    restarted = store.begin_generation(restarted=True)
    assert (restarted.generation, restarted.num_restarts) == (first.generation + 1, first.num_restarts + 1)
    assert store.pools() == {"decode": ("a spec", 2)}
    assert store.replicas() == {"decode-0": ReplicaRecord("decode-0", "decode", "node-a", 100.0)}
    assert store.reserve_id("decode", 0) == 9
    assert store.draining_nodes() == {"node-b": 30.0}

    kept = store.begin_generation(restarted=False, keep_cluster=True)  # a new head's controller finds the cluster: a restart
    assert (kept.generation, kept.num_restarts, store.pools()) == (first.generation + 2, first.num_restarts + 2, {"decode": ("a spec", 2)})

    fresh = store.begin_generation(restarted=False)  # a new cluster: nothing of the last one, the generation still counts up
    assert (fresh.generation, fresh.num_restarts, fresh.last_restart_unix_s) == (first.generation + 3, 0, 0.0)
    assert (store.pools(), store.replicas(), store.routers(), store.draining_nodes(), store.reserve_id("decode", 0)) == ({}, {}, {}, {}, 0)
    assert store.begin_generation(restarted=False, keep_cluster=True).num_restarts == 0  # nothing to keep: no restart
    store.clear()
