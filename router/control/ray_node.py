"""This host's Ray node, started by splitserve itself, as Kubernetes pods run it.

The chart's pods use KubeRay's ``ray.io/overwrite-container-cmd``: their command is
``splitserve head`` or ``splitserve worker``, which start Ray themselves by running
``ray start --block`` as a child. That child owns every Ray daemon of the node (it makes them
its own process group and stops them all when it gets SIGTERM), so stopping this node is one
signal to one process, never ``ray stop`` (which stops every Ray on the host).

A worker's life::

    head reachable? ──> ray start --address HEAD --resources {"splitserve_<pool>": 1} --block
        ──> the controller starts a replica in the node's slot ... SIGTERM
        ──> controller.drain_node(this node): requests finish, the replica leaves the map
        ──> SIGTERM to ray start (the node goes) ──> exit 0
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.config import CONTROLLER_NAME, NAMESPACE
from router.control.controller_config import HEAD_RESOURCE, POOLS, pool_resource
from router.control.node_slots import is_alive

READY_LINE = "Ray runtime started"
"""What ``ray start`` prints once its node has joined (Ray 2.x)."""
REGISTRATION_TIMEOUT = "timed out during startup"
"""What ``ray start`` fails with when its raylet has not registered with the GCS within the 30 s
Ray 2.x allows (a fixed wait, no setting): on a node whose cores are busy it passes now and then."""
RAY_START_ATTEMPTS = 3
"""Tries of ``ray start`` when it fails with ``REGISTRATION_TIMEOUT``; any other failure is final."""
RAY_START_TIMEOUT_S = 300.0
"""How long ``ray start`` may take to bring a node up, its tries together. On a node whose cores are
busy one try can take a minute or more (Ray's 30 s wait for its raylet comes after its daemons have
started), and a second try then needs as long again; a pod that gives up restarts from nothing."""
OWN_FLAGS = (
    "--head", "--address", "--port", "--resources", "--block", "--node-name", "--node-ip-address", "--num-cpus", "--num-gpus",
    "--redis-password", "--redis-username",
)
"""``ray start`` options the entrypoints set themselves; ``ray_start_args`` may not repeat them."""


class RayNodeError(RuntimeError):
    """This host's Ray node could not start, join or stay up; the message says why in one sentence."""


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); ValueError naming the problem otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address: {address!r} is not HOST:PORT")
    return host, int(port)


def _check_extra_args(extra: tuple[str, ...]) -> None:
    taken = sorted({a.split("=")[0] for a in extra if a.split("=")[0] in OWN_FLAGS})
    if taken:
        raise ValueError(f"ray_start_args: {', '.join(taken)} is set by splitserve itself; use its own option")


@dataclass(frozen=True)
class HeadNodeConfig:
    """The Ray head node of ``splitserve head``: the controller and routers run on it, no replica does."""

    ray_port: int = 6379
    """Port of Ray's GCS, which worker nodes join."""
    node_ip_address: str | None = None
    """IP address the node advertises (a pod's IP); None: the one Ray picks."""
    ray_start_args: tuple[str, ...] = ()
    """Further ``ray start`` options (ports, object store size, temp dir, dashboard), passed as given."""
    start_timeout_s: float = RAY_START_TIMEOUT_S
    """How long ``ray start`` may take to bring the node up."""
    redis_password: str | None = field(default=None, repr=False)
    """Password of the Redis that Ray's GCS keeps its state in (GCS fault tolerance: the Redis is
    ``RAY_REDIS_ADDRESS``, which ``ray start`` reads itself); None: a Redis without one."""
    redis_username: str | None = None
    """User name on that Redis (Redis 6 ACLs); None: the default user."""

    def __post_init__(self) -> None:
        if not 0 < self.ray_port < 65536:
            raise ValueError(f"ray_port: {self.ray_port} is not a port")
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")
        _check_extra_args(self.ray_start_args)

    def command(self, node_ip: str) -> list[str]:
        """The ``ray start`` command line; the head offers no pool resource, so no replica lands on
        it, and the head resource, which the controller asks for (``HEAD_RESOURCE``)."""
        command = [*_RAY, "start", "--head", "--block", "--port", str(self.ray_port), "--node-ip-address", node_ip]
        command += ["--resources", json.dumps({HEAD_RESOURCE: 1})]
        if self.redis_password:
            command += ["--redis-password", self.redis_password]
        if self.redis_username:
            command += ["--redis-username", self.redis_username]
        return command + list(self.ray_start_args)


@dataclass(frozen=True)
class WorkerNodeConfig:
    """A Ray worker node of ``splitserve worker``: one replica slot of one pool."""

    pool: str
    """The pool whose replica runs on this node: "prefill" or "decode"."""
    address: str
    """The head's Ray GCS, HOST:PORT."""
    num_cpus: int | None = None
    """CPUs the node offers Ray; None: what Ray detects."""
    num_gpus: int | None = None
    """GPUs the node offers Ray; None: what Ray detects."""
    drain_timeout_s: float = 300.0
    """On SIGTERM, how long the node's replica may take to finish its running requests."""
    connect_timeout_s: float = 60.0
    """How long to wait for the head to accept connections before giving up."""
    node_ip_address: str | None = None
    """IP address the node advertises (a pod's IP); None: the one Ray picks."""
    ray_start_args: tuple[str, ...] = ()
    """Further ``ray start`` options, passed as given."""
    start_timeout_s: float = RAY_START_TIMEOUT_S
    """How long ``ray start`` may take to join the node."""

    def __post_init__(self) -> None:
        if self.pool not in POOLS:
            raise ValueError(f"pool: {self.pool!r} is not one of {', '.join(POOLS)}")
        parse_address(self.address)
        for name in ("num_cpus", "num_gpus"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("drain_timeout_s", "connect_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")
        _check_extra_args(self.ray_start_args)

    def command(self, node_ip: str, node_name: str) -> list[str]:
        """The ``ray start`` command line: join the head, offering one slot of the pool's resource."""
        return join_command(self.address, node_ip, node_name, pool_resource(self.pool), self.num_cpus, self.num_gpus, self.ray_start_args)


def join_command(
    address: str, node_ip: str, node_name: str, resource: str, num_cpus: int | None, num_gpus: int | None, ray_start_args: tuple[str, ...]
) -> list[str]:
    """``ray start`` joining the head at ``address`` as a node offering one ``resource`` slot;
    a count left None is what Ray detects."""
    command = [*_RAY, "start", "--block", "--address", address, "--node-ip-address", node_ip, "--node-name", node_name]
    command += ["--resources", json.dumps({resource: 1})]
    if num_cpus is not None:
        command += ["--num-cpus", str(num_cpus)]
    if num_gpus is not None:
        command += ["--num-gpus", str(num_gpus)]
    return command + list(ray_start_args)


_RAY = (sys.executable, "-m", "ray.scripts.scripts")
"""``ray`` of this interpreter, whatever PATH holds."""


def split_ray_start_args(text: str) -> tuple[str, ...]:
    """The ``--ray-start-args`` option: one string, split as a shell would."""
    return tuple(shlex.split(text))


def check_port_free(port: int) -> None:
    """RayNodeError unless ``port`` can be bound on every interface, as Ray's GCS will bind it
    (``ray start`` would otherwise fail after a minute of retries with a less direct message)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as e:
            raise RayNodeError(f"ray_port: {port} is in use on this host ({(e.strerror or str(e)).lower()})") from None


def stop_on_signals(stop: threading.Event) -> threading.Event:
    """Make SIGINT and SIGTERM (Ctrl-C, Kubernetes stopping the pod) set ``stop``; returns it.
    Call it again after ``ray.init``: Ray installs its own SIGTERM handler there, which ends
    the process at once, before any drain."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_reachable(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; RayNodeError after ``timeout_s``.
    ``ray start`` itself would retry an absent head for minutes without saying why."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            reason = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise RayNodeError(f"the Ray head at {host}:{port} is not reachable ({reason.lower()}) after {timeout_s:g} s")
        time.sleep(0.25)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when this process dies, however it dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RayNode:
    """A ``ray start --block`` child: ``start`` returns once the node is up; ``stop`` takes it down.
    Its output goes on to this process's stdout. ``on_exit`` runs if it ends without ``stop``."""

    def __init__(self, command: list[str], on_exit: Callable[[], None] = lambda: None) -> None:
        self.command = command
        self._on_exit = on_exit
        self._process: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._ended = threading.Event()
        self._stopping = False
        self._last_lines: deque[str] = deque(maxlen=20)

    @property
    def returncode(self) -> int | None:
        return self._process.returncode if self._process is not None and self._ended.is_set() else None

    def start(self, timeout_s: float) -> None:
        """Run ``ray start`` and wait until its node is up; RayNodeError if it exits or takes longer.
        A raylet that did not register in Ray's own 30 s is tried again, within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for attempt in range(1, RAY_START_ATTEMPTS + 1):
            try:
                return self._start_once(deadline, timeout_s)
            except RayNodeError as e:  # _stopping: it ran out of time, none is left to try again
                if self._stopping or REGISTRATION_TIMEOUT not in str(e) or attempt == RAY_START_ATTEMPTS or time.monotonic() >= deadline:
                    raise
                print(f"ray start: its raylet did not register within Ray's 30 s; starting it again ({attempt + 1} of {RAY_START_ATTEMPTS})", flush=True)

    def _start_once(self, deadline: float, timeout_s: float) -> None:
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}  # a head or worker is one node of many
        self._ready.clear()
        self._ended.clear()
        self._last_lines.clear()
        self._process = subprocess.Popen(
            self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        threading.Thread(target=self._follow_output, args=(self._process,), name="ray-start-output", daemon=True).start()
        while not self._ready.wait(0.1):
            if self._ended.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._process.pid, signal.SIGKILL)  # whatever it started and left behind
                raise RayNodeError(f"ray start failed (exit code {self._process.returncode}): {self._failure_line()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RayNodeError(f"ray start did not bring the node up within {timeout_s:g} s: {self._failure_line()}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the node (Ray drains it and stops its daemons); SIGKILL its group after ``timeout_s``."""
        self._stopping = True
        if self._process is None or self._ended.is_set():
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)  # the child leads its own session
            self._process.wait()
        self._ended.wait(5.0)

    def _follow_output(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.strip():
                self._last_lines.append(line.strip())
            if READY_LINE in line:
                self._ready.set()
        process.wait()
        self._ended.set()
        if not self._stopping and self._ready.is_set():  # a node that never came up is start's failure to report
            self._on_exit()

    def _failure_line(self) -> str:
        """The line of ``ray start``'s last output that best says what went wrong."""
        lines = list(self._last_lines)
        for marker in ("Error:", "Exception:", "PANIC", "Check failed"):
            matching = [line for line in lines if marker in line]
            if matching:
                return matching[-1]
        return (lines or ["no output"])[-1]


def node_id_named(node_name: str, timeout_s: float = 30.0) -> str:
    """The id of the alive Ray node called ``node_name`` (this process must be connected to Ray)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        ids = [n["NodeID"] for n in ray.nodes() if is_alive(n) and n.get("NodeName") == node_name]
        if ids:
            return ids[0]
        if time.monotonic() > deadline:
            raise RayNodeError(f"no alive Ray node is called {node_name!r} after {timeout_s:g} s")
        time.sleep(0.2)


def drain_this_node(node_id: str, timeout_s: float) -> str:
    """Ask the controller to drain the replicas on ``node_id`` and wait until they are gone;
    a sentence saying what happened (a head that is gone has nothing left to drain)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    from router.errors import cause_line

    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        return "no controller to drain with (the head is gone)"
    try:
        drained = ray.get(controller.drain_node.remote(node_id, timeout_s), timeout=timeout_s + 60)
    except (RayActorError, RayTaskError, GetTimeoutError) as e:
        return f"draining failed: {cause_line(e)}"
    return f"drained {', '.join(drained) if drained else 'no replica'}"


def run_worker(config: WorkerNodeConfig) -> None:
    """Join the cluster as one slot of ``config.pool`` and stay until SIGTERM or SIGINT; then
    drain this node's replicas through the controller and take the node down. Raises
    RayNodeError when the head is unreachable, the node cannot join, or it stops on its own."""
    import ray

    host, port = parse_address(config.address)
    wait_reachable(host, port, config.connect_timeout_s)
    stop = stop_on_signals(threading.Event())
    node_ip = config.node_ip_address or ray.util.get_node_ip_address()
    node_name = f"splitserve-{config.pool}-{socket.gethostname()}-{os.getpid()}"
    node = RayNode(config.command(node_ip, node_name), on_exit=stop.set)
    node.start(config.start_timeout_s)
    try:
        try:
            ray.init(address=config.address, namespace=NAMESPACE, log_to_driver=False)
        except (ConnectionError, RuntimeError) as e:
            raise RayNodeError(f"could not connect to the Ray cluster at {config.address}: {str(e).splitlines()[0]}") from e
        stop_on_signals(stop)  # again: ray.init put its own SIGTERM handler in place of ours
        node_id = node_id_named(node_name)
        _say(f"node {node_id} joined {config.address} with one {config.pool} slot")
        stop.wait()
        if node.returncode is not None:
            raise RayNodeError(f"its Ray node stopped on its own (ray start exit code {node.returncode})")
        _say(f"stopping: draining node {node_id} (up to {config.drain_timeout_s:g} s)")
        _say(drain_this_node(node_id, config.drain_timeout_s))
    finally:
        ray.shutdown()
        node.stop()
    _say("stopped")


def _say(message: str) -> None:
    print(f"splitserve worker: {message}", flush=True)
