"""What both worker roles share as Ray actors: an engine on its own thread, its Prometheus
endpoint, and the questions every replica answers (its model, its KV namespace, its KV events,
its load). The roles subclass ``EngineReplica``; the protos are theirs to build (the engine
knows no proto), from the plain fields returned here.
"""

from __future__ import annotations

import os
import sys

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from engine.config import EngineConfig, WorkerProcessConfig
from engine.cpus import move_serving_threads
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStatsCollector, TierStatsCollector, serve_metrics
from kv_store.events import KVEventBatch, KVSnapshot
from kv_store.keys import KeyNamespace


class EngineReplica:
    """Base of the worker actors: builds the engine loop and the metrics endpoint."""

    pool = ""
    """"prefill" or "decode"."""

    def __init__(self, replica_id: str, engine_config: EngineConfig, config: WorkerProcessConfig) -> None:
        engine_cpus = config.engine_cpu_set
        if engine_cpus is not None:
            move_serving_threads(engine_cpus)  # before the engine thread exists: it starts there and pins itself
        num_threads = config.num_threads or len(engine_cpus or os.sched_getaffinity(0))
        sys.setswitchinterval(config.gil_switch_interval_s)
        self.replica_id = replica_id
        self.loop = EngineLoop(
            lambda: LLMEngine(engine_config, worker_id=replica_id),
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

    def serve_metrics(self, *collectors: Collector) -> None:
        """Start the Prometheus endpoint: engine and tier metrics plus the role's ``collectors``."""
        registry = CollectorRegistry()
        registry.register(EngineStatsCollector(lambda: self.loop.stats, self.metrics_labels))
        registry.register(TierStatsCollector(self.engine.kv_store, self.metrics_labels))
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

    def status_fields(self) -> dict:
        """The fields of splitserve.v1.ReplicaStatus; a dead engine thread reports unhealthy."""
        s = self.loop.stats
        return dict(
            replica_id=self.replica_id,
            pool=self.pool,
            model=self.engine.model_name,
            healthy=self.loop.alive,
            num_running=s.num_running,
            num_waiting=s.num_waiting + s.num_parked,
            num_kv_blocks=s.num_kv_blocks,
            num_free_kv_blocks=s.num_free_kv_blocks,
            metrics_url=self.metrics_url,
            num_aborted_requests=s.num_aborted_requests,
            num_queued_prefill_tokens=s.num_queued_prefill_tokens,
        )

    def stop_engine(self) -> None:
        """Stop the engine thread (requests still running are dropped) and its background work."""
        self.loop.stop()
        self.engine.close()
