"""What both worker roles share as Ray actors: an engine on its own thread, its Prometheus
endpoint, and the questions every replica answers (its model, its KV namespace, its KV events,
its load). The roles subclass ``EngineReplica``; the protos are theirs to build (the engine
knows no proto), from the plain fields returned here.
"""

from __future__ import annotations

import asyncio
import os
import sys

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from engine.config import EngineConfig, WorkerProcessConfig
from engine.cpus import move_serving_threads
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStatsCollector, TierStatsCollector, TPRankCollector, serve_metrics
from engine.parallel.follower import TPFollower, rank_fields
from engine.parallel.ranks import TPEngineBuilder
from kv_store.events import KVEventBatch, KVSnapshot
from kv_store.keys import KeyNamespace


class EngineReplica:
    """Base of the worker actors: builds the engine loop and the metrics endpoint."""

    pool = ""
    """"prefill" or "decode"."""
    follower_class: type = TPFollower
    """What the follower ranks of a tensor-parallel replica run: the role's subclass of TPFollower."""

    def __init__(self, replica_id: str, engine_config: EngineConfig, config: WorkerProcessConfig) -> None:
        engine_cpus = config.engine_cpu_set
        if engine_cpus is not None:
            move_serving_threads(engine_cpus)  # before the engine thread exists: it starts there and pins itself
        num_threads = config.num_threads or len(engine_cpus or os.sched_getaffinity(0))
        sys.setswitchinterval(config.gil_switch_interval_s)
        self.replica_id = replica_id
        self.tp_followers: list = []
        """Ray handles of ranks 1 .. num_ranks-1 (owned by this actor: they die with it)."""
        self.tp_node_ip = ""
        build = lambda: LLMEngine(engine_config, worker_id=replica_id)  # noqa: E731
        if engine_config.num_ranks > 1:
            build = TPEngineBuilder(engine_config, replica_id, num_cpus=config.tp_rank_cpus, num_threads=num_threads, follower_class=self.follower_class)
            self.tp_followers = build.followers
            self.tp_node_ip = build.address.rpartition(":")[0]
        self.loop = EngineLoop(
            build,
            config.max_waiting_requests,
            num_threads,
            nice=config.engine_thread_nice,
            cpus=engine_cpus,
        )
        self.loop.start()
        self.engine: LLMEngine = self.loop.engine
        self.metrics_labels = {"replica": replica_id, "pool": self.pool}
        self.metrics_url = ""
        self._metrics_config = config
        self._tp_ranks: list[dict] = []
        """Each rank's fields as of the last status probe (for metrics)."""

    def serve_metrics(self, *collectors: Collector) -> None:
        """Start the Prometheus endpoint: engine and tier metrics plus the role's ``collectors``."""
        registry = CollectorRegistry()
        registry.register(EngineStatsCollector(lambda: self.loop.stats, self.metrics_labels))
        registry.register(TierStatsCollector(self.engine.kv_store, self.metrics_labels))
        registry.register(TPRankCollector(lambda: self._tp_ranks, self.metrics_labels))
        for collector in collectors:
            registry.register(collector)
        self.metrics_url = serve_metrics(registry, self._metrics_config.metrics_host, self._metrics_config.metrics_port)

    async def kv_namespace(self) -> KeyNamespace:
        """The key namespace of this worker's blocks (routers hash prompts with it)."""
        return self.engine.namespace

    async def kv_snapshot(self) -> KVSnapshot:
        """This worker's block keys per tier, with the number of the last KV event batch included."""
        return await self.loop.call(lambda engine: engine.kv_snapshot())

    async def kv_events(self, after_seq: int) -> list[KVEventBatch]:
        """KV event batches after ``after_seq``; EventGap (take a snapshot) if some are gone."""
        return self.engine.kv_events_since(after_seq)

    def model_fields(self) -> dict:
        """The fields of splitserve.v1.ModelInfo."""
        engine = self.engine
        return dict(
            id=engine.model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            kv_dtype=engine.config.kv_dtype,
            block_size=engine.config.block_size,
        )

    async def tp_rank_fields(self, timeout_s: float = 5.0) -> list[dict]:
        """The fields of splitserve.v1.TPRank for each rank, the leader first. A follower that is
        gone, or does not answer within ``timeout_s``, is reported not alive."""
        ranks = [rank_fields(0, self.engine.runner.model, self.tp_node_ip, self.loop.alive)]
        calls = [asyncio.ensure_future(f.info.remote()) for f in self.tp_followers]
        if calls:
            await asyncio.wait(calls, timeout=timeout_s)
        for rank, call in enumerate(calls, start=1):
            if call.done() and call.exception() is None:
                info = call.result()
                ranks.append({k: info[k] for k in ranks[0]})
            else:
                call.cancel()
                ranks.append(dict(rank=rank, node_ip=self.tp_node_ip, alive=False))
        self._tp_ranks = ranks
        return ranks

    async def status_fields(self) -> dict:
        """The fields of splitserve.v1.ReplicaStatus; a dead engine thread, or a dead rank of a
        tensor-parallel replica, reports unhealthy."""
        s = self.loop.stats
        ranks = await self.tp_rank_fields()
        return dict(
            replica_id=self.replica_id,
            pool=self.pool,
            model=self.engine.model_name,
            healthy=all(r["alive"] for r in ranks),
            tp_size=len(ranks),
            tp_ranks=ranks,
            num_running=s.num_running,
            num_waiting=s.num_waiting + s.num_parked,
            num_kv_blocks=s.num_kv_blocks,
            num_free_kv_blocks=s.num_free_kv_blocks,
            metrics_url=self.metrics_url,
            num_aborted_requests=s.num_aborted_requests,
            num_queued_prefill_tokens=s.num_queued_prefill_tokens,
        )

    def stop_engine(self) -> None:
        """Stop the engine thread (requests still running are dropped), its background work and
        its follower ranks (told to stop when the group still works; killed with this actor anyway)."""
        alive = self.loop.alive
        self.loop.stop()
        if alive:
            self.engine.close()
        else:
            self.engine.kv_store.close()
