"""The pods' command lines on one host: `splitserve head`, one `splitserve worker --pool prefill`
and one `splitserve worker --pool decode`, each a separate process that starts its own Ray node
(`ray start --block`) and joins one Ray cluster over loopback, as the chart's pods do, with
mutual TLS inside the cluster as the chart's clusterTLS sets it up: Ray's own gRPC between the
three nodes and the router's request plane to the workers (the public gRPC API stays plain here).

The pytest process may run the session's own local Ray (ray_session) beside this cluster, so
this cluster never uses `ray stop`: its Ray gets its own ports and temp dir, every process is
stopped by a signal to it, and the test ends by checking that none of them is left.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import grpc
import psutil
import pytest

from tests.certs import make_pki
from tests.integration.conftest import wait_until
from tests.integration.entrypoint_roles import CLI, Role, kill_all, ray_start_args, ray_temp_dir  # noqa: F401  (ray_temp_dir: a fixture)
from tests.redis_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

def _pools(client) -> dict[str, tuple[int, int, int]]:
    """Pool -> (healthy replicas, replicas, target)."""
    status = client.cluster_status()
    healthy = {pool.pool: sum(1 for r in status.replicas if r.pool == pool.pool and r.healthy) for pool in status.pools}
    return {pool.pool: (healthy[pool.pool], pool.num_replicas, pool.target_replicas) for pool in status.pools}


def test_head_and_one_worker_per_pool_serve_then_drain_and_stop(tiny_llama_dir, ray_temp_dir, tmp_path):
    from router.client import SplitServeClient

    cluster_tls = _node_certificate(tmp_path)
    ray_port, grpc_port = free_port(), free_port()
    address = f"127.0.0.1:{ray_port}"
    head_ray_args = ray_start_args(
        f"--temp-dir {ray_temp_dir}", f"--ray-client-server-port {free_port()}", f"--dashboard-port {free_port()}", "--include-dashboard false"
    )
    head = Role("head", [
        "head", "--ray-port", str(ray_port), "--node-ip-address", "127.0.0.1", "--ray-start-args", head_ray_args,
        "--port", str(grpc_port), "--model", str(tiny_llama_dir), "--kv-dtype", "fp32", "--num-kv-blocks", "64", "--max-model-len", "256",
        "--controller-health-check-interval-s", "0.5", "--worker-refresh-interval-s", "0.2", *cluster_tls,
    ])
    roles = [head]
    every_process: list[psutil.Process] = []
    client = SplitServeClient(f"127.0.0.1:{grpc_port}")
    try:
        head.wait_for(f"serving gRPC on 127.0.0.1:{grpc_port}", timeout_s=120)
        # No worker node yet: both pools are empty, and a request says why it cannot be served.
        assert _pools(client) == {"prefill": (0, 0, 0), "decode": (0, 0, 0)}
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate("hello", max_tokens=4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "no live decode worker" in refused.value.details()

        worker_args = ["--address", address, "--num-cpus", "1", "--node-ip-address", "127.0.0.1", *cluster_tls]
        # One node at a time: a raylet must register with the GCS within Ray's fixed 30 s, which
        # two starting at once beside the head's replica start-up can miss on a loaded 2-core machine.
        decode = Role("decode worker", ["worker", "--pool", "decode", "--drain-timeout-s", "60", *worker_args, "--ray-start-args", ray_start_args()])
        roles.append(decode)
        decode_node = decode.wait_for("with one decode slot", timeout_s=120).split(" node ")[1].split()[0]
        prefill = Role("prefill worker", ["worker", "--pool", "prefill", *worker_args, "--ray-start-args", ray_start_args()])
        roles.append(prefill)
        prefill.wait_for("with one prefill slot", timeout_s=120)
        wait_until(lambda: _pools(client) == {"prefill": (1, 1, 1), "decode": (1, 1, 1)}, timeout_s=120, interval_s=0.25)

        # Disaggregated across the nodes: the prompt prefilled on the prefill node, its KV handed
        # off to the decode node. (The router's view of the pools trails the controller's by a
        # refresh, so the first calls may find no decode replica yet or prefill locally.)
        responses = wait_until(lambda: _disaggregated_answer(client), timeout_s=60, interval_s=0.2)
        assert sum(len(r.token_ids) for r in responses) == 6
        assert responses[-1].timings.kv_handoff_s > 0

        every_process = [p for role in roles for p in role.tree()]
        assert len(every_process) >= 9  # 3 entrypoints, 3 `ray start`s, their daemons and 2 replicas

        # SIGTERM to the decode worker: its replica is drained through the controller and the
        # pool goes to 0 (nothing replaces it on the head or the prefill node); the worker exits 0.
        assert decode.stop(timeout_s=90) == 0
        lines = decode.drain_output()
        assert any(f"draining node {decode_node}" in line for line in lines)
        assert any("drained decode-0" in line for line in lines)
        assert _pools(client)["decode"] == (0, 0, 0)
        with pytest.raises(grpc.RpcError) as refused:
            list(client.generate("hello", max_tokens=4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

        assert prefill.stop(timeout_s=90) == 0
        assert any("drained prefill-0" in line for line in prefill.drain_output())
        assert _pools(client)["prefill"] == (0, 0, 0)

        assert head.stop(timeout_s=90) == 0
        head.wait_for("splitserve: stopped", timeout_s=5)
        _, alive = psutil.wait_procs(every_process, timeout=30)
        assert alive == [], f"left running: {[(p.pid, p.name()) for p in alive]}"
    finally:
        client.close()
        kill_all([p for role in roles for p in role.tree()] + every_process)
    assert not [p for p in psutil.process_iter(["cmdline"]) if ray_temp_dir in " ".join(p.info["cmdline"] or ())]
    current = Path(tempfile.gettempdir(), "ray", "ray_current_cluster")  # what ray.init(address="auto") reads
    assert not (current.exists() and current.read_text().strip() == address)


def _node_certificate(tmp_path: Path) -> list[str]:
    """The ``--cluster-tls-*`` options of a node whose certificate `splitserve node-cert` issued,
    as the chart's init container does: Ray checks the certificate against the address it dials,
    which here is one of the host's own IPs as `ray start` picks it (every node of this test
    shares the host), so the certificate names them all."""
    import socket

    pki = make_pki(tmp_path / "pki")
    out = tmp_path / "node-tls"
    ips = sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET})
    issued = subprocess.run(
        [*CLI, "node-cert", "--ca-cert", str(pki.ca_cert), "--ca-key", str(pki.ca_key), "--out", str(out), *(f"--ip={ip}" for ip in ips)],
        capture_output=True, text=True, timeout=60,
    )
    assert issued.returncode == 0, issued.stderr
    return ["--cluster-tls-cert", str(out / "tls.crt"), "--cluster-tls-key", str(out / "tls.key"), "--cluster-tls-ca", str(out / "ca.crt")]


def _disaggregated_answer(client):
    """The responses to a 40-token prompt (whole 16-token blocks to hand off) if a prefill
    replica computed it; None if the decode replica did, or the router knows no decode replica yet."""
    try:
        responses = list(client.generate([(7 * i) % 400 + 20 for i in range(40)], max_tokens=6, ignore_eos=True))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return None
        raise
    return responses if responses[-1].timings.prefill_steps == 0 else None


def test_a_replica_of_several_ranks_is_placed_on_the_node_it_is_pinned_to(ray_session):
    """What the controller does for a TP replica in a slot: a STRICT_PACK group whose bundles
    select the slot's node by its ``ray.io/node-id`` label; a node that is not there is refused
    at once, by name."""
    import asyncio

    import ray
    from ray.util.placement_group import placement_group_table

    from router.control import placement
    from router.errors import PlacementError

    node_id = ray.get_runtime_context().get_node_id()
    wanted = placement.bundles(2, 1.0, 1.0, "splitserve_prefill")
    group = asyncio.run(placement.reserve("a TP 2 prefill replica", wanted, 30.0, node_id))
    try:
        assert set(placement_group_table(group)["bundles_to_node_id"].values()) == {node_id}
    finally:
        placement.release(group)
    with pytest.raises(PlacementError, match="^a TP 2 prefill replica on node f{56}: no such alive Ray node$"):
        asyncio.run(placement.reserve("a TP 2 prefill replica", wanted, 30.0, "f" * 56))
    with pytest.raises(PlacementError, match=f"^a TP 2 prefill replica on node {node_id} needs 2 CPU, 1 splitserve_prefill, 1 GPU on one node"):
        asyncio.run(placement.reserve("a TP 2 prefill replica", placement.bundles(2, 1.0, 1.0, "splitserve_prefill", 0.5), 30.0, node_id))
