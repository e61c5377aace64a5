"""Engines of several ranks (tensor- or expert-parallel) for tests, with the test process as rank 0."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import ray
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.parallel.follower import TPFollower
from engine.parallel.ranks import TPEngineBuilder

FOLLOWER_STOP_S = 60.0
"""How long a host waits for the follower of the previous engine to leave its group."""


class FollowerHost:
    """A Ray actor that runs rank r of each engine a test builds, one engine after another: the
    real ``TPFollower`` (its own thread, gloo group, shard), in a process that is started once.
    A replica's followers are Ray actors of their own (engine/parallel/ranks.py); here the test
    modules build dozens of engines, and a fresh process each would import torch dozens of times."""

    def __init__(self) -> None:
        self.follower: TPFollower | None = None

    def start(self, config: EngineConfig, rank: int, address: str, num_threads: int) -> None:
        """Join the group at ``address`` as ``rank`` and load the shard (returns once it is built)."""
        deadline = time.monotonic() + FOLLOWER_STOP_S
        while self.follower is not None and self.follower.alive():  # its leader has sent stop: it is leaving its group
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.follower.rank} of the previous engine is still in its group")
            time.sleep(0.01)
        self.follower = None  # free the previous engine's shard before this one loads
        self.follower = TPFollower(config, rank, address, num_threads)

    def info(self) -> dict:
        return self.follower.info()


def start_on_hosts(hosts: list, config: EngineConfig, num_cpus: float, num_threads: int, started: list) -> Callable[[str], list]:
    """A ``TPEngineBuilder`` ``start`` that runs ranks 1 .. N-1 of ``config`` on ``hosts``
    (FollowerHost handles, each asking Ray for ``num_cpus``; the list grows in place as needed).
    The refs of the hosts' ``start`` calls go to ``started``: get them once the leader has joined."""

    def start(address: str) -> list:  # called once the builder has checked the sizes
        host = ray.remote(FollowerHost).options(num_cpus=num_cpus, max_concurrency=4)
        hosts.extend(host.remote() for _ in range(len(hosts), config.num_ranks - 1))
        ranks = hosts[: config.num_ranks - 1]
        started.extend(h.start.remote(config, rank, address, num_threads) for rank, h in enumerate(ranks, 1))
        return ranks

    return start


def drop_killed_hosts(hosts: list, config: EngineConfig, started: list) -> None:
    """After a failed ``TPEngineBuilder`` call: it killed the ranks its ``start`` handed out
    (``hosts[:N-1]``, in place, as the list may be shared); hosts beyond them still serve. Nothing
    was handed out when the builder refused before starting any (``started`` empty)."""
    if started:
        del hosts[: config.num_ranks - 1]


def ranked_engine_on_hosts(hosts: list, num_cpus: float) -> Callable:
    """``bench.workload.ranked_engine`` with each replica's ranks 1 .. N-1 on ``hosts`` (as
    ``start_on_hosts``), for the benches the tests run in-process."""
    from bench import workload

    @contextlib.contextmanager
    def ranked_engine(config: EngineConfig, num_threads: int, name: str):
        started: list = []
        start = start_on_hosts(hosts, config, num_cpus, num_threads, started)
        built = False
        try:
            with workload.ranked_engine(config, num_threads, name, start=start) as (engine, followers):
                built = True
                ray.get(started)
                yield engine, followers
        except BaseException:
            if not built:  # a bench's own error left the ranks serving
                drop_killed_hosts(hosts, config, started)
            raise

    return ranked_engine


class ParallelEngines:
    """The engines a test asks for, built once per config. One-rank engines are kept; of the
    engines with followers only one lives at a time (a process joins one group at once), so
    asking for another closes the current one; its ranks' hosts then serve the next.

    ``hosts``: a list of FollowerHost handles shared with other ParallelEngines (the session's
    ``follower_hosts``), grown as needed and left running by ``close``; None: hosts of its own."""

    def __init__(self, follower_cpus: float, replica_id: str, hosts: list | None = None) -> None:
        self.follower_cpus = follower_cpus
        self.replica_id = replica_id
        self._single: dict[EngineConfig, LLMEngine] = {}
        self._config: EngineConfig | None = None
        self._engine: LLMEngine | None = None
        self._owns_hosts = hosts is None
        self._hosts: list = [] if hosts is None else hosts
        self.followers: list = []
        """Ray handles of the live engine's ranks 1 .. N-1."""

    def get(self, config: EngineConfig) -> LLMEngine:
        if config.num_ranks == 1:
            if config not in self._single:
                self._single[config] = LLMEngine(config)
            return self._single[config]
        if config != self._config:
            self.close_parallel()
            started: list = []
            start = start_on_hosts(self._hosts, config, self.follower_cpus, 1, started)
            builder = TPEngineBuilder(config, self.replica_id, num_cpus=self.follower_cpus, num_threads=1, start=start)
            try:
                self._engine = builder()
            except BaseException:  # the builder killed its ranks' hosts, which may have waited in the start-up barrier
                drop_killed_hosts(self._hosts, config, started)
                raise
            ray.get(started)
            self._config, self.followers = config, builder.followers
        return self._engine

    def follower_infos(self) -> list[dict]:
        return ray.get([f.info.remote() for f in self.followers])

    def close_parallel(self) -> None:
        """Close the live engine with followers (its ranks leave their group; the hosts stay)."""
        if self._engine is not None:
            self._engine.close()
        self._engine, self._config, self.followers = None, None, []

    def close(self) -> None:
        """Close the live engine with followers; kill the hosts unless they are shared."""
        self.close_parallel()
        if self._owns_hosts:
            for host in self._hosts:
                ray.kill(host)
            self._hosts.clear()


@contextlib.contextmanager
def parallel_engines(follower_cpus: float, replica_id: str, hosts: list | None = None):
    """ParallelEngines with this process on one torch thread, as each follower: on a small machine
    a leader's OpenMP team spinning on every core starves the followers it waits for."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engines = ParallelEngines(follower_cpus, replica_id, hosts)
    try:
        yield engines
    finally:
        engines.close()
        torch.set_num_threads(num_threads)


def wait_in_redis(engine: LLMEngine, keys: set[int], timeout_s: float = 20.0) -> None:
    """Until the replica reports every block of ``keys`` in Redis: each KV head's value written,
    by whichever rank holds it (``RedisTier`` confirms what other ranks write)."""
    from kv_store.events import Tier

    deadline = time.monotonic() + timeout_s
    while missing := keys - engine.kv_store.key_sets()[Tier.REDIS]:
        assert time.monotonic() < deadline, f"{len(missing)} of {len(keys)} blocks not confirmed in Redis"
        time.sleep(0.05)
