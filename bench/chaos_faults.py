"""The faults bench.chaos runs on a live cluster, how long each took to recover from, and the
longest gap the streams in flight saw while it lasted.

A fault is over (``recovered_s``) when the cluster is whole again: the replica replaced, the
controller answering as the next generation with the pools it had, the router serving again on
its port. ``max_gap_s``: the longest interval between two consecutive responses of any call,
over the fault's window, which runs from its start until the next fault starts (or the load
stops): the faults run one at a time, and a cut stream may resume after the cluster is whole.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable

import grpc
import ray

from router.client import SplitServeClient
from router.control.controller_config import POOLS

FAULTS = ("kill_controller", "kill_prefill", "kill_decode", "kill_router", "restart_redis", "drop_transfer")
"""In the order they run: the controller first, so the replica kills after it show that a
restarted controller still heals its pools."""
_RAY_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError)


def pid_of(handle) -> int:
    """The process id of a Ray actor."""
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=10)


def replicas(cluster, pool: str | None = None) -> dict:
    """Replica id -> actor handle of each replica (of ``pool``) the controller holds."""
    return {s.replica_id: h for s, _, h in ray.get(cluster.controller.replicas.remote()) if pool in (None, s.pool)}


def _until(predicate: Callable[[], bool], started: float, recovery_s: float) -> float | None:
    """Seconds from ``started`` until ``predicate`` holds; None if it did not within ``recovery_s``."""
    while time.monotonic() - started < recovery_s:
        try:
            if predicate():
                return round(time.monotonic() - started, 2)
        except (*_RAY_GONE, grpc.RpcError):
            pass  # the actor or router asked is restarting
        time.sleep(0.1)
    return None


def inject(cluster, redis, fault: str, rng: random.Random, recovery_s: float, serving: Callable[[], set[str]] = set) -> tuple[str, float | None]:
    """Run one fault on ``cluster`` (its Redis tier on ``redis``, a tests ``RedisServer``);
    returns what it hit and how long until the cluster was whole again (None: not within
    ``recovery_s``). ``serving``: the addresses of the routers streaming an answer now (some of
    its tokens sent, not all), which ``kill_router`` picks from (any router when none is)."""
    started = time.monotonic()
    if fault == "restart_redis":
        redis.stop()
        time.sleep(1.0)
        redis.start()
        return "redis", round(time.monotonic() - started, 2)
    if fault == "kill_controller":
        return _kill_controller(cluster, recovery_s)
    if fault == "kill_router":
        return _kill_router(cluster, rng, recovery_s, serving)
    pool = "decode" if fault == "kill_decode" else "prefill"
    live = replicas(cluster, pool)
    if not live:
        return "none live", None
    target = rng.choice(sorted(live))
    if fault == "drop_transfer":
        ray.get(live[target].inject_faults.remote(fail_next=2))
        return target, 0.0
    ray.kill(live[target])
    return target, _until(lambda: target not in (now := replicas(cluster, pool)) and len(now) == len(live), started, recovery_s)


def _kill_controller(cluster, recovery_s: float) -> tuple[str, float | None]:
    """SIGKILL the controller's process; over when Ray has started it again, it answers as the
    next generation, and it holds as many healthy replicas per pool as before."""
    before = ray.get(cluster.controller.controller_history.remote(), timeout=10).generation
    sizes = {pool: len(replicas(cluster, pool)) for pool in POOLS}
    pid = pid_of(cluster.controller)
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def whole() -> bool:
        if ray.get(cluster.controller.controller_history.remote(), timeout=5).generation != before + 1:
            return False
        statuses = [s for s, _, _ in ray.get(cluster.controller.replicas.remote(), timeout=5)]
        return {pool: sum(1 for s in statuses if s.pool == pool and s.healthy) for pool in POOLS} == sizes

    return f"controller generation {before}", _until(whole, started, recovery_s)


def _kill_router(cluster, rng: random.Random, recovery_s: float, serving: Callable[[], set[str]]) -> tuple[str, float | None]:
    """SIGKILL the process of a random router among those ``serving`` returns (a stream is cut); over
    when the controller has started it again and it serves on the port it had (the soak's clients
    know no other address)."""
    ids = [f"router-{i}" for i in range(cluster.config.num_routers)]
    handles = {router_id: cluster.router_handle(router_id) for router_id in ids}
    pids = {router_id: pid_of(handle) for router_id, handle in handles.items()}  # before the pick: the stream picked is cut, not finished meanwhile
    addresses = dict(zip(ids, [s.grpc_address for s in cluster.router_statuses]))
    streaming = serving()
    router_id = rng.choice([r for r in ids if addresses[r] in streaming] or ids)
    started = time.monotonic()
    os.kill(pids[router_id], signal.SIGKILL)
    old, address = handles[router_id], addresses[router_id]

    def back() -> bool:
        try:
            new = cluster.router_handle(router_id)
        except ValueError:  # not named yet
            return False
        if new == old or not ray.get(new.__ray_call__.remote(lambda self: self._server is not None), timeout=5):
            return False
        with SplitServeClient(address) as probe:  # a fresh channel: no reconnect backoff left from the dead one
            return bool(probe.list_models())

    return router_id, _until(back, started, recovery_s)


def window_stats(calls: list, fault_log: list[dict]) -> list[dict]:
    """What the calls saw in each fault's window (its start to the next fault's start; the last
    one's to the end): ``max_gap_s``, the longest interval between two consecutive responses of
    any call (``times``: when they arrived, seconds since the soak began) that ended in the window
    (a gap belongs to the fault it ended after), None when no call answered twice in it;
    ``resumed_calls``, the calls that moved to another router mid-answer in it (``resumed_at``:
    when the first response after each move arrived)."""
    starts = [f["at_s"] for f in fault_log]
    return [
        {"max_gap_s": _max_gap(calls, start, end), "resumed_calls": sum(1 for c in calls if any(start <= t < end for t in c.resumed_at))}
        for start, end in zip(starts, [*starts[1:], float("inf")])
    ]


def baseline_gap(calls: list, before_s: float) -> float | None:
    """The longest interval between two consecutive responses that both came before ``before_s``
    (the first fault's start): what the load alone does, to set the faults' gaps against."""
    return _max_gap(calls, float("-inf"), before_s)


def _max_gap(calls: list, start: float, end: float) -> float | None:
    """The longest interval between two consecutive responses that ended in [start, end)."""
    longest = None
    for call in calls:
        for a, b in zip(call.times, call.times[1:]):
            if start <= b < end and (longest is None or b - a > longest):
                longest = b - a
    return None if longest is None else round(longest, 3)


def by_kind(fault_log: list[dict], baseline_gap_s: float | None) -> dict:
    """Per fault kind: how many ran, their recovery seconds (None: not recovered), the longest
    gap a stream saw and the calls resumed on another router; ``baseline_gap_s``, the longest gap
    before the first fault, for comparison."""
    summary = {}
    for kind in FAULTS:
        runs = [f for f in fault_log if f["kind"] == kind]
        recovered = [f["recovered_s"] for f in runs if f["recovered_s"] is not None]
        gaps_s = [f["max_gap_s"] for f in runs if f.get("max_gap_s") is not None]
        summary[kind] = {
            "count": len(runs),
            "recovered_s": [f["recovered_s"] for f in runs],
            "recovered_s_max": max(recovered) if recovered else None,
            "max_gap_s": max(gaps_s) if gaps_s else None,
            "resumed_calls": sum(f.get("resumed_calls", 0) for f in runs),
        }
    summary["before_faults"] = {"max_gap_s": baseline_gap_s}
    return summary
