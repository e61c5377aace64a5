"""Ray's GCS restarted under a serving cluster, with its state in a Redis (GCS fault tolerance).

The pods' command lines on one host, each its own process and Ray node on loopback, as in
test_entrypoints: `splitserve head` (GCS, controller, router-0) with ``RAY_REDIS_ADDRESS`` and
``REDIS_PASSWORD`` set as KubeRay sets them, one `splitserve worker --pool decode` and one
`splitserve router` (the chart's router pods). Then the GCS process is stopped and started again
with the command line and environment it ran with, read from /proc: what a head pod restart
does to the GCS, without taking the head's raylet and controller with it.

What Ray 2.60 does here (the test asserts each):

- ``ray start --block`` (the head's own child) watches its daemons and takes the whole node down
  when one exits with anything but SIGTERM's codes, so a SIGKILLed gcs_server is a head crash,
  not a GCS restart. SIGTERM is the way to stop the GCS alone: it closes its port at once, then
  hangs in its shutdown ("flushing remaining events") until the node stops (``ray start`` kills
  it with the node's other daemons, after 1 s).
- Nothing on the node starts the GCS again (KubeRay's answer is restarting the head pod); the
  test starts it with the same arguments and environment, and it recovers the cluster from Redis:
  the same nodes, the same named actors.
- While the GCS is away and after it is back, both routers answer every request, token for token
  as before: replicas, routers and the controller talk to each other directly, not through the GCS.
- Then a head crash (the GCS gone and the head's node with it: raylet, controller, router-0): the
  router node keeps answering from its last worker map, and its SIGTERM stop still ends cleanly
  (without unregistering: no controller is left) instead of waiting for a GCS.

The pytest process may run the session's own Ray beside this cluster: this one has its own
ports and temp dir, is never touched by `ray stop`, and every process it started is checked gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.integration.conftest import wait_until
from tests.integration.entrypoint_roles import Role, kill_all, ray_start_args, ray_temp_dir  # noqa: F401  (ray_temp_dir: a fixture)
from tests.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [(11 * i) % 300 + 20 for i in range(24)]
MAX_TOKENS = 8


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _answer(client) -> list[int]:
    return [t for r in client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True) for t in r.token_ids]


class Traffic:
    """Requests one after another through every router, from a thread, until ``stop``: every
    answer and every error, tagged with the phase the test was in when it was sent."""

    def __init__(self, clients: dict[str, object]) -> None:
        self.clients = clients
        self.phase = "before"
        self.answers: list[tuple[str, str, list[int]]] = []
        self.longest_call_s: dict[str, float] = {}
        """Per phase, the longest a call took from sent to its last token (reported, not asserted)."""
        self.errors: list[tuple[str, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, client in self.clients.items():
                phase, sent = self.phase, time.monotonic()
                try:
                    self.answers.append((phase, name, _answer(client)))
                    self.longest_call_s[phase] = max(self.longest_call_s.get(phase, 0.0), time.monotonic() - sent)
                except Exception as e:  # noqa: BLE001 - every failure is a finding, reported by the test
                    self.errors.append((phase, name, f"{type(e).__name__}: {e}"))

    def count(self, phase: str) -> int:
        return sum(1 for p, _, _ in self.answers if p == phase)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def test_replicas_and_routers_serve_while_the_gcs_restarts_from_redis(tiny_llama_dir, ray_temp_dir, tmp_path):
    from router.client import SplitServeClient

    redis_server = RedisServer(tmp_path, password="gcs-secret").start()
    ray_port, head_grpc, router_grpc = free_port(), free_port(), free_port()
    address = f"127.0.0.1:{ray_port}"
    head_ray_args = ray_start_args(
        f"--temp-dir {ray_temp_dir}", f"--ray-client-server-port {free_port()}", f"--dashboard-port {free_port()}", "--include-dashboard false"
    )
    head = Role("head", [
        "head", "--ray-port", str(ray_port), "--node-ip-address", "127.0.0.1", "--ray-start-args", head_ray_args,
        "--port", str(head_grpc), "--model", str(tiny_llama_dir), "--kv-dtype", "fp32", "--num-kv-blocks", "64", "--max-model-len", "256",
        "--controller-health-check-interval-s", "0.5", "--worker-refresh-interval-s", "0.2",
    ], env={"RAY_REDIS_ADDRESS": f"127.0.0.1:{redis_server.port}", "REDIS_PASSWORD": "gcs-secret"})
    roles = [head]
    restarted_gcs: subprocess.Popen | None = None
    every_process: list[psutil.Process] = []
    clients = {"router-0 (head)": SplitServeClient(f"127.0.0.1:{head_grpc}"), "router node": SplitServeClient(f"127.0.0.1:{router_grpc}")}
    traffic = None
    try:
        head.wait_for(f"serving gRPC on 127.0.0.1:{head_grpc}", timeout_s=120)
        assert redis_server.client().dbsize() > 0, "the GCS keeps its tables in the Redis"
        decode = Role("decode worker", [
            "worker", "--pool", "decode", "--address", address, "--num-cpus", "1", "--node-ip-address", "127.0.0.1",
            "--drain-timeout-s", "30", "--ray-start-args", ray_start_args(),
        ])
        roles.append(decode)
        decode.wait_for("with one decode slot", timeout_s=120)
        router = Role("router node", [
            "router", "--address", address, "--router-id", "router-pod-a", "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
            "--port", str(router_grpc), "--worker-refresh-interval-s", "0.2", "--stop-grace-s", "2",
            "--headless-stop-s", "1", "--ray-start-args", ray_start_args(),
        ])
        roles.append(router)
        router.wait_for("router-pod-a on node", timeout_s=120)

        expected = wait_until(lambda: _try_answer(clients["router-0 (head)"]), timeout_s=60, interval_s=0.2)
        assert len(expected) == MAX_TOKENS
        assert wait_until(lambda: _try_answer(clients["router node"]), timeout_s=60, interval_s=0.2) == expected
        status = clients["router node"].cluster_status()
        assert sorted(r.router_id for r in status.routers) == ["router-0", "router-pod-a"]
        assert [(r.pool, r.healthy) for r in status.replicas] == [("decode", True)]

        gcs = _gcs_process(head)
        gcs_command, gcs_env = gcs.cmdline(), gcs.environ()
        assert gcs_env["RAY_REDIS_ADDRESS"] == f"127.0.0.1:{redis_server.port}"
        assert f"--redis_port={redis_server.port}" in gcs_command and "--redis_password=gcs-secret" in gcs_command
        nodes_before, actors_before = _cluster_view(address)
        assert len(nodes_before) == 3 and {"splitserve-controller", "splitserve-router-pod-a"} <= actors_before

        traffic = Traffic(clients)
        wait_until(lambda: traffic.count("before") >= 2, timeout_s=60)

        # SIGTERM: the GCS closes its port and stays away; `ray start` keeps the head's node up.
        gcs.send_signal(signal.SIGTERM)
        wait_until(lambda: not _accepts(ray_port), timeout_s=30, interval_s=0.1)
        down_at = time.monotonic()
        traffic.phase = "gcs down"
        wait_until(lambda: traffic.count("gcs down") >= 100, timeout_s=120)  # several controller health rounds and router refreshes
        assert head.process.poll() is None and not _accepts(ray_port)

        restarted_gcs = subprocess.Popen(
            gcs_command, env=gcs_env, cwd=gcs.cwd(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        wait_until(lambda: _accepts(ray_port), timeout_s=60, interval_s=0.1)
        back_at = time.monotonic()
        traffic.phase = "gcs back"
        nodes_after, actors_after = wait_until(lambda: _recovered_view(address, nodes_before), timeout_s=90, interval_s=1.0)
        recovered_at = time.monotonic()
        assert nodes_after == nodes_before and actors_before <= actors_after
        wait_until(lambda: traffic.count("gcs back") >= 4, timeout_s=60)
        traffic.stop()
        print(f"gcs restart: down {back_at - down_at:.1f} s; every node back in a new driver's view {recovered_at - back_at:.1f} s after; "
              f"answers per phase {[(p, traffic.count(p)) for p in ('before', 'gcs down', 'gcs back')]}; "
              f"longest call per phase {({p: round(t, 2) for p, t in traffic.longest_call_s.items()})}")

        assert traffic.errors == []
        assert {tuple(tokens) for _, _, tokens in traffic.answers} == {tuple(expected)}
        assert {(phase, name) for phase, name, _ in traffic.answers} == {(p, n) for p in ("before", "gcs down", "gcs back") for n in clients}
        status = clients["router node"].cluster_status()
        assert [(r.pool, r.healthy) for r in status.replicas] == [("decode", True)]

        every_process = [p for role in roles for p in role.tree()] + [psutil.Process(restarted_gcs.pid)]

        # A head crash, as a head pod's loss is: the GCS goes, and SIGKILL to the old one (still in
        # its SIGTERM shutdown), which `ray start` does not expect from its daemons, takes the
        # head's whole node down with it: raylet, controller, router-0.
        restarted_gcs.kill()
        restarted_gcs.wait()
        assert gcs.is_running() and gcs.status() != psutil.STATUS_ZOMBIE
        gcs.kill()
        assert head.process.wait(60) == 3
        assert any("its Ray node stopped on its own" in line for line in _drain(head))
        # No GCS, no controller, no head: the router node answers from its last map, within the
        # time its raylet waits for a GCS (RAY_gcs_rpc_server_reconnect_timeout_s, 60 s here).
        assert [_answer(clients["router node"]) for _ in range(10)] == [expected] * 10
        crashed_at = time.monotonic()
        assert router.stop(timeout_s=120) == 0
        print(f"head crash: router node stopped {time.monotonic() - crashed_at:.1f} s after its last answer")
        assert any("router-pod-a stopped without unregistering" in line for line in _drain(router))
        # The decode worker's drain goes through the controller, and none is left; the head's
        # agents outlive their raylet for a minute, waiting for a GCS. SIGKILL what is left.
        kill_all(every_process)
        alive = [p for p in every_process if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], f"left running: {[(p.pid, p.name()) for p in alive]}"
    finally:
        if traffic is not None:
            traffic.stop()
        for client in clients.values():
            client.close()
        leftovers = [p for role in roles for p in role.tree()] + every_process
        if restarted_gcs is not None and restarted_gcs.poll() is None:
            leftovers.append(psutil.Process(restarted_gcs.pid))
        kill_all(leftovers)
        redis_server.stop()
    assert not [p for p in psutil.process_iter(["cmdline"]) if ray_temp_dir in " ".join(p.info["cmdline"] or ())]


def _try_answer(client) -> list[int] | None:
    import grpc

    try:
        return _answer(client)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return None
        raise


def _drain(role: Role) -> list[str]:
    while not role.lines.empty():
        role.seen.append(role.lines.get())
    return role.seen


def _gcs_process(head: Role) -> psutil.Process:
    (gcs,) = [p for p in head.tree() if p.name() == "gcs_server"]
    return gcs


VIEW_SCRIPT = """
import json, ray
ray.init(address={address!r}, log_to_driver=False)
nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
actors = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
print(json.dumps([nodes, actors]))
"""


def _cluster_view(address: str) -> tuple[list[str], set[str]]:
    """The alive node ids and the named actors, as a new driver sees them through the GCS."""
    import json

    env = {**os.environ, "RAY_ADDRESS": "", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    done = subprocess.run([sys.executable, "-c", VIEW_SCRIPT.format(address=address)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    nodes, actors = json.loads(done.stdout.strip().splitlines()[-1])
    return nodes, set(actors)


def _recovered_view(address: str, nodes_before: list[str]):
    """The view once every node has reconnected to the restarted GCS (None before)."""
    nodes, actors = _cluster_view(address)
    return (nodes, actors) if nodes == nodes_before else None
