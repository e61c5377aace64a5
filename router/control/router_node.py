"""``splitserve router``: one router replica on a Ray node of its own, off the head.

On Kubernetes the head pod holds Ray's GCS and the controller; the routers run in the chart's
``router`` worker group, so a head restart (GCS fault tolerance on a Redis) leaves the API up:
each router keeps serving from its last worker map while the head is away. A router pod::

    head reachable? ──> ray start --address HEAD --resources {"splitserve_router": 1} --block
        ──> the controller exists? ──> RouterReplica on this node ──> start (registers) ... SIGTERM
        ──> router.stop (in-flight calls finish, unregisters) ──> SIGTERM to ray start ──> exit 0

The router actor belongs to this process (its driver); if it dies, this process exits with an
error so that its pod is restarted, rather than keeping a node that serves nothing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass

from router.config import CONTROLLER_NAME, NAMESPACE
from router.control.ray_node import RAY_START_TIMEOUT_S, RayNode, RayNodeError, _check_extra_args, join_command, node_id_named, parse_address, stop_on_signals, wait_reachable

ROUTER_RESOURCE = "splitserve_router"
"""The custom Ray resource a router node offers: no replica slot, so the controller places none here."""
HEADLESS_NODE_STOP_S = 5.0
"""By default, how long ``ray start`` may take to stop when the head seems gone (``RouterNodeConfig.headless_stop_s``)."""
STOP_MARGIN_S = 10.0
"""How much longer than its grace a router's stop may take (closing channels, unregistering)
before the node goes anyway: a controller that is gone with its head must not hold up a pod's exit."""


@dataclass(frozen=True)
class RouterNodeConfig:
    """A Ray node of ``splitserve router``: one router replica that joins the head's cluster."""

    address: str
    """The head's Ray GCS, HOST:PORT."""
    router_id: str = ""
    """Name of the router replica in ``splitserve status``; "" names it router-<hostname> (the pod's name)."""
    num_cpus: int | None = None
    """CPUs the node offers Ray; None: what Ray detects (the router actor itself asks for none)."""
    connect_timeout_s: float = 60.0
    """How long to wait for the head to accept connections before giving up."""
    controller_timeout_s: float = 120.0
    """How long to wait for the head's controller to exist before giving up."""
    health_check_interval_s: float = 5.0
    """How often this process checks that its router actor is alive."""
    stop_grace_s: float = 5.0
    """On SIGTERM, how long the router's in-flight calls may take to finish."""
    headless_stop_s: float = HEADLESS_NODE_STOP_S
    """How long ``ray start`` may take to stop when the head seems gone (the router could not
    unregister): it would first ask a GCS to drain the node, and wait for one to answer."""
    node_ip_address: str | None = None
    """IP address the node advertises (a pod's IP); None: the one Ray picks."""
    ray_start_args: tuple[str, ...] = ()
    """Further ``ray start`` options, passed as given."""
    start_timeout_s: float = RAY_START_TIMEOUT_S
    """How long ``ray start`` may take to join the node."""

    def __post_init__(self) -> None:
        parse_address(self.address)
        if self.router_id and not all(c.isalnum() or c in "-_." for c in self.router_id):
            raise ValueError(f"router_id: {self.router_id!r} may hold only letters, digits, '-', '_' and '.'")
        if self.num_cpus is not None and self.num_cpus < 0:
            raise ValueError(f"num_cpus: must be >= 0, got {self.num_cpus}")
        for name in ("connect_timeout_s", "controller_timeout_s", "stop_grace_s", "headless_stop_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")
        if self.health_check_interval_s <= 0:
            raise ValueError(f"health_check_interval_s: must be > 0, got {self.health_check_interval_s}")
        _check_extra_args(self.ray_start_args)

    @property
    def name(self) -> str:
        """The router replica's id: ``router_id``, or router-<hostname>."""
        return self.router_id or f"router-{socket.gethostname()}"

    def command(self, node_ip: str, node_name: str) -> list[str]:
        """The ``ray start`` command line: join the head with one router slot and no GPU."""
        return join_command(self.address, node_ip, node_name, ROUTER_RESOURCE, self.num_cpus, 0, self.ray_start_args)


def wait_for_controller(timeout_s: float):
    """The controller's handle once it exists (this process must be connected to Ray)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise RayNodeError(f"no controller {CONTROLLER_NAME!r} in the cluster after {timeout_s:g} s (is `splitserve head` running?)") from None
            time.sleep(0.5)


def start_router_on(node_id: str, router_id: str, router_config):
    """A started RouterReplica actor pinned to Ray node ``node_id``; its RouterStatus."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from router.replica import RouterReplica

    actor = (
        ray.remote(RouterReplica)
        .options(
            name=f"splitserve-{router_id}", namespace=NAMESPACE, num_cpus=0, max_concurrency=10_000,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        )
        .remote(router_id, router_config)
    )
    return actor, ray.get(actor.start.remote())


def run_router(config: RouterNodeConfig, router_config) -> None:
    """Join the cluster as a router node, serve one router replica until SIGTERM or SIGINT, then
    stop it (in-flight calls finish) and take the node down. Raises RayNodeError when the head
    or its controller cannot be reached, the node cannot join, or the router or node dies."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    host, port = parse_address(config.address)
    wait_reachable(host, port, config.connect_timeout_s)
    stop = stop_on_signals(threading.Event())
    node_ip = config.node_ip_address or ray.util.get_node_ip_address()
    node_name = f"splitserve-router-{socket.gethostname()}-{os.getpid()}"
    node = RayNode(config.command(node_ip, node_name), on_exit=stop.set)
    node.start(config.start_timeout_s)
    node_stop_timeout_s = 60.0
    try:
        try:
            ray.init(address=config.address, namespace=NAMESPACE, log_to_driver=False)
        except (ConnectionError, RuntimeError) as e:
            raise RayNodeError(f"could not connect to the Ray cluster at {config.address}: {str(e).splitlines()[0]}") from e
        stop_on_signals(stop)  # again: ray.init put its own SIGTERM handler in place of ours
        node_id = node_id_named(node_name)
        wait_for_controller(config.controller_timeout_s)
        router, status = start_router_on(node_id, config.name, router_config)
        http = f", OpenAI/KServe HTTP on {status.http_url}" if status.http_url else ""
        _say(f"{config.name} on node {node_id} serving gRPC on {status.grpc_address}{http} (metrics {status.metrics_url})")
        while not stop.wait(config.health_check_interval_s):
            try:
                ray.get(router.__ray_ready__.remote(), timeout=30)
            except GetTimeoutError:
                continue  # a restarting GCS slows calls down; the actor itself answers its clients
            except RayActorError as e:
                raise RayNodeError(f"its router actor died: {str(e).splitlines()[0]}") from e
        if node.returncode is not None:
            raise RayNodeError(f"its Ray node stopped on its own (ray start exit code {node.returncode})")
        _say(f"stopping {config.name} (in-flight calls get {config.stop_grace_s:g} s)")
        try:
            ray.get(router.stop.remote(config.stop_grace_s), timeout=config.stop_grace_s + STOP_MARGIN_S)
        except (RayActorError, RayTaskError, GetTimeoutError) as e:  # e.g. the head (its controller) is gone
            _say(f"{config.name} stopped without unregistering: {str(e).splitlines()[0]}")
            node_stop_timeout_s = config.headless_stop_s
    finally:
        ray.shutdown()
        node.stop(node_stop_timeout_s)  # the router actor's process goes with its node
    _say("stopped")


def _say(message: str) -> None:
    print(f"splitserve router: {message}", flush=True)
