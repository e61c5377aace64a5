"""The benches run in-process: their replicas' follower ranks on the session's FollowerHosts."""

from __future__ import annotations

import pytest

FOLLOWER_CPUS = 0.5


@pytest.fixture
def ranks_on_hosts(follower_hosts, monkeypatch):
    """Every bench's ``ranked_engine`` with the follower ranks (the real TPFollower) on the
    session's hosts (tests/conftest.py ``follower_hosts``), not new Ray actors for every replica
    a bench builds: bench.kv_store builds one per tier, 12 in tests/unit/bench/test_kv_store_tp.py.
    (The benches that build one replica start their own: hosts saved them nothing measurable.)"""
    from bench import kv_store, moe, parallel
    from tests.integration.parallel_engines import ranked_engine_on_hosts

    ranked_engine = ranked_engine_on_hosts(follower_hosts, FOLLOWER_CPUS)
    for bench in (kv_store, moe, parallel):
        monkeypatch.setattr(bench, "ranked_engine", ranked_engine)
