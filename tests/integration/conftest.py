"""Real clusters on the session's Ray (``ray_session``, tests/conftest.py)."""

from __future__ import annotations

import contextlib
import time

import pytest


@contextlib.contextmanager
def running_cluster(config):
    """A started Cluster (controller, replicas, router-0) that is stopped afterwards."""
    from router.control.launch import Cluster

    cluster = Cluster(config)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def running_http_cluster(engine, max_waiting_requests: int):
    """A cluster of one decode worker whose router-0 also serves HTTP (OpenAI, KServe), running
    ``engine`` (an EngineConfig); stopped afterwards."""
    from decode_worker.config import WorkerConfig
    from router.config import RouterConfig
    from router.control.launch import ClusterConfig

    config = ClusterConfig(engine=engine, worker=WorkerConfig(max_waiting_requests=max_waiting_requests),
                           router=RouterConfig(port=0, http_port=0, worker_refresh_interval_s=0.25))
    with running_cluster(config) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def http_address(cluster) -> str:
    """host:port of router-0's HTTP API, as its status reports it (``cluster``: the module's)."""
    return cluster.router_status.http_url.removeprefix("http://")


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.05):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)
