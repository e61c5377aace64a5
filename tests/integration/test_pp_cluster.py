"""A pipeline-parallel decode replica in a real aggregated cluster: the tiny Llama's two layers
in two stages, each stage a STRICT_PACK placement group of its own (stage 0's holding the
leader), served over real gRPC; `status` and the replica's metrics show the stages; a shape no
set of nodes can hold is refused with a sentence; a stage killed mid-stream takes the replica
down as a whole, its call migrates and the controller replaces it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import urllib.request

import pytest
import ray

from bench.chaos import metric_total
from cli import main as cli
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
from tests.unit.engine.helpers import random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RANK_CPUS = 0.5
HEALTH = ControllerConfig(health_check_interval_s=0.5, health_check_timeout_s=5.0, max_failed_health_checks=2, restart_backoff_s=0.5)
PROMPT = random_prompts([40], seed=8)[0]
LONG_GREEDY = dict(max_tokens=300, temperature=0, ignore_eos=True)
REFUSAL_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def engine_config(tiny_llama_dir):
    return EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=256, max_num_seqs=8, max_model_len=512)


def pp_cluster_config(engine_config: EngineConfig, rank_cpus: float = RANK_CPUS) -> ClusterConfig:
    return ClusterConfig(
        engine=engine_config,
        worker=WorkerConfig(tp_rank_cpus=rank_cpus, num_threads=1, kv_transport="none"),  # aggregated: no hand-off
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25),
        controller=HEALTH,
        decode_pp_size=2,
        num_layers=2,
    )


def replica_groups() -> dict[str, dict]:
    """Name -> entry of every live placement group of a decode replica."""
    return {g["name"]: g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED" and g["name"].startswith("splitserve-decode-")}


def test_a_pp_shape_no_node_set_can_hold_is_refused_naming_the_layers_and_what_nodes_offer(ray_session, engine_config):
    groups_before = replica_groups()
    cluster = Cluster(pp_cluster_config(engine_config, rank_cpus=1000))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = pool.submit(cluster.start)
        try:
            error = started.exception(timeout=REFUSAL_DEADLINE_S)
        finally:
            cluster.stop()
    assert isinstance(error, PlacementError), error
    slots = pool_resource("decode")
    offers = "; ".join(f"{n['Resources']['CPU']:g} CPU, {n['Resources'].get(slots, 0):g} {slots}" for n in ray.nodes() if n["Alive"])
    assert str(error).endswith(
        f"a PP 2 x TP 1 decode replica (2 layers in 2 stages) needs, for each stage on one node, 1 CPU, 1 {slots} (stage 0) "
        f"and 1000 CPU (stage 1), but the {offers.count(';') + 1} alive nodes offer {offers}: at most 1 of its 2 stages fit"
    )
    assert replica_groups().keys() == groups_before.keys()  # refused before any group was asked for


def test_stages_are_reserved_together_and_a_stage_that_cannot_be_placed_releases_them_all(ray_session):
    """Stage 1 (CPUs only) is ready at once; stage 0 waits for a pool slot that others hold: when
    the wait times out, stage 1's ready group goes too."""
    slots = pool_resource("decode")
    blocker = ray.util.placement_group([{slots: ray.available_resources()[slots]}], strategy="STRICT_PACK")
    ray.get(blocker.ready())
    stages = placement.stage_bundles(2, 1, 1.0, RANK_CPUS, slots)

    def probes() -> dict:
        return {g["name"]: g["state"] for g in ray.util.placement_group_table().values() if g["name"].startswith("pp-probe") and g["state"] != "REMOVED"}

    try:
        with pytest.raises(PlacementError, match=r"^a PP 2 x TP 1 decode replica: its stages could not be placed within 2 s; free now: "):
            asyncio.run(placement.reserve_stages("a PP 2 x TP 1 decode replica", stages, 2.0, name="pp-probe"))
        wait_until(lambda: not probes())
    finally:
        ray.util.remove_placement_group(blocker)
    groups = asyncio.run(placement.reserve_stages("a PP 2 x TP 1 decode replica", stages, 30.0, name="pp-probe"))
    assert probes() == {"pp-probe": "CREATED", "pp-probe-stage-1": "CREATED"}
    assert [g.id.hex() for g in placement.find_replica_groups("pp-probe")] == [g.id.hex() for g in groups]  # stage 0's first
    placement.release(groups)
    wait_until(lambda: not probes())


@pytest.fixture(scope="module")
def cluster(ray_session, engine_config):
    with running_cluster(pp_cluster_config(engine_config)) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with SplitServeClient(cluster.router_status.grpc_address) as c:
        yield c


def decode_replica(client):
    [replica] = [r for r in client.cluster_status().replicas if r.pool == "decode"]
    return replica


def test_two_stages_each_in_its_own_group_hold_one_layer_each_and_answer_as_pp_1(client, engine_config):
    engine = LLMEngine(engine_config)
    [expected] = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    engine.close()
    assert collect(client.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True))[0] == list(expected.output_token_ids)

    replica = decode_replica(client)
    assert (replica.healthy, replica.pp_size, replica.tp_size) == (True, 2, 1)
    ranks = list(replica.tp_ranks)
    assert [(r.rank, r.stage, r.layer_start, r.layer_end, r.alive) for r in ranks] == [(0, 0, 0, 1, True), (1, 1, 1, 2, True)]
    assert len({r.pid for r in ranks}) == 2 and os.getpid() not in {r.pid for r in ranks}
    assert all(r.kv_bytes > 0 and r.param_bytes > 0 for r in ranks)
    name = f"splitserve-{replica.replica_id}"
    groups = replica_groups()
    assert sorted(groups) == [name, f"{name}-stage-1"]
    assert {g["strategy"] for g in groups.values()} == {"STRICT_PACK"}
    assert groups[name]["bundles"] == {0: {"CPU": 1.0, pool_resource("decode"): 1.0}}
    assert groups[f"{name}-stage-1"]["bundles"] == {0: {"CPU": RANK_CPUS}}


def test_status_and_metrics_show_each_stage(client, cluster, capsys):
    wait_until(lambda: all(r.busy_s > 0 for r in decode_replica(client).tp_ranks))  # both stages have stepped
    replica = decode_replica(client)
    assert cli.main(["status", "--addr", cluster.router_status.grpc_address]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    p0, p1 = (r.pid for r in replica.tp_ranks)
    assert "pp 2 x tp 1" in lines
    assert any(line.startswith("stage 0: layers 0-1 on 127.0.0.1, busy ") and line.endswith(f"(ranks 0: pid {p0} alive)") for line in lines), lines
    assert any(line.startswith("stage 1: layers 1-2 on 127.0.0.1, busy ") and line.endswith(f"(ranks 1: pid {p1} alive)") for line in lines), lines

    samples = dict(line.rsplit(" ", 1) for line in urllib.request.urlopen(replica.metrics_url, timeout=10).read().decode().splitlines() if line[:1] != "#")
    for stage in ("0", "1"):
        labels = f'{{pool="decode",replica="{replica.replica_id}",stage="{stage}"}}'
        assert samples[f"splitserve_pp_stage_up{labels}"] == "1.0"
        assert samples[f"splitserve_pp_stage_layers{labels}"] == "1.0"
        assert float(samples[f"splitserve_pp_stage_busy_seconds_total{labels}"]) > 0
        assert float(samples[f"splitserve_pp_stage_kv_bytes{labels}"]) > 0


def process_gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_a_stage_killed_mid_stream_fails_the_replica_whose_call_migrates_to_its_replacement(client, cluster):
    expected_ids, _, expected_last = collect(client.generate(PROMPT, **LONG_GREEDY))
    old = decode_replica(client)
    [pool] = [p for p in client.cluster_status().pools if p.pool == "decode"]
    migrations = metric_total(urllib.request.urlopen(cluster.router_status.metrics_url, timeout=10).read().decode(), "splitserve_migrations_total")
    old_groups = replica_groups()

    stream = client.generate(PROMPT, **LONG_GREEDY)
    streamed = [next(stream) for _ in range(3)]
    os.kill(old.tp_ranks[1].pid, signal.SIGKILL)  # stage 1: its neighbour's sockets break, the leader's step fails
    ids, _, last = collect(stream)

    assert collect(streamed)[0] + ids == expected_ids
    assert last.usage.completion_tokens == expected_last.usage.completion_tokens
    router_metrics = urllib.request.urlopen(cluster.router_status.metrics_url, timeout=10).read().decode()
    assert metric_total(router_metrics, "splitserve_migrations_total") == migrations + 1

    def replaced():
        fresh = [
            r for r in client.cluster_status().replicas
            if r.pool == "decode" and r.replica_id != old.replica_id and r.healthy and r.pp_size == 2 and all(t.alive for t in r.tp_ranks)
        ]
        return fresh and fresh[0]

    new = wait_until(replaced, 120)
    assert not {t.pid for t in new.tp_ranks} & {t.pid for t in old.tp_ranks}
    assert [(t.stage, t.layer_start, t.layer_end) for t in new.tp_ranks] == [(0, 0, 1), (1, 1, 2)]
    wait_until(lambda: all(process_gone(t.pid) for t in old.tp_ranks), 30)  # the whole replica went, not just the stage
    [pool_after] = [p for p in client.cluster_status().pools if p.pool == "decode"]
    assert pool_after.num_restarts == pool.num_restarts + 1
    assert old.replica_id in pool_after.last_failure
    # Every stage's group of the dead replica is released; the replacement has its own two.
    name = f"splitserve-{new.replica_id}"
    wait_until(lambda: sorted(replica_groups()) == [name, f"{name}-stage-1"], 30)
    assert not old_groups.keys() & replica_groups().keys()
    assert collect(client.generate(PROMPT, **LONG_GREEDY))[0] == expected_ids


def test_a_restarted_controller_adopts_the_pipelined_replica_and_releases_every_stage_group_with_it(client, cluster):
    """Last: it empties the pool. The controller finds both stage groups by the replica's name."""
    replica = decode_replica(client)
    history = ray.get(cluster.controller.controller_history.remote())
    os.kill(ray.get(cluster.controller.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)

    def adopted():
        try:
            back = ray.get(cluster.controller.controller_history.remote(), timeout=5).generation == history.generation + 1
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            return False
        return back and [(r.replica_id, [t.pid for t in r.tp_ranks]) for r in client.cluster_status().replicas] == [
            (replica.replica_id, [t.pid for t in replica.tp_ranks])
        ]

    wait_until(adopted, 60, 0.1)
    name = f"splitserve-{replica.replica_id}"
    assert sorted(replica_groups()) == [name, f"{name}-stage-1"]  # adopted with the replica, not removed as orphans
    ray.get(cluster.controller.set_pool.remote(cluster.config.replica_spec("decode"), 0))
    wait_until(lambda: not replica_groups(), 30)
    wait_until(lambda: all(process_gone(t.pid) for t in replica.tp_ranks), 30)
