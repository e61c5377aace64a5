"""What both worker roles share as Ray actors: an engine on its own thread, its Prometheus
endpoint, and the questions every replica answers (its model, its KV namespace, its KV events,
its load). The roles subclass ``EngineReplica``; the protos are theirs to build (the engine
knows no proto), from the plain fields returned here.

Importing this module (and the roles' actor modules) does not import torch: the controller
imports the actor classes by path to create the replicas, and torch would cost that process
about 2.7 CPU-s at every cluster start. The engine's modules load in ``__init__``, in the
replica's own process, and a role names its follower class by path for the same reason.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from engine.config import EngineConfig, WorkerProcessConfig
from engine.cpus import move_serving_threads
from engine.metrics import EngineStatsCollector, KeyedCounterCollector, PipelineStageCollector, TierStatsCollector, TPRankCollector, serve_metrics
from engine.parallel.sharding import rank_fields
from kv_store.events import KVEventBatch, KVSnapshot
from kv_store.keys import KeyNamespace


class EngineReplica:
    """Base of the worker actors: builds the engine loop and the metrics endpoint."""

    pool = ""
    """"prefill" or "decode"."""
    follower_class = "engine.parallel.follower:TPFollower"
    """``module:Class`` the follower ranks of a tensor-parallel replica run: the role's subclass of TPFollower."""

    def __init__(self, replica_id: str, engine_config: EngineConfig, config: WorkerProcessConfig) -> None:
        from engine.engine_loop import EngineLoop  # torch: imported in the replica's process only (module docstring)
        from engine.llm_engine import LLMEngine
        from engine.parallel.ranks import TPEngineBuilder

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
            build = TPEngineBuilder(engine_config, replica_id, num_cpus=config.tp_rank_cpus, num_threads=num_threads, follower_class=_import_class(self.follower_class))
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
        self._rank_redis: list[dict] = []
        """The other ranks' Redis tier counters (``RedisTierStats`` fields), as of the last status probe."""
        self._rank_expert_tokens: list[list[list[int]]] = []
        """Per rank, per layer, tokens each expert it holds computed, as of the last status probe."""

    def serve_metrics(self, *collectors: Collector) -> None:
        """Start the Prometheus endpoint: engine and tier metrics plus the role's ``collectors``."""
        registry = CollectorRegistry()
        registry.register(EngineStatsCollector(lambda: self.loop.stats, self.metrics_labels))
        registry.register(TierStatsCollector(self.engine.kv_store, self.metrics_labels, lambda: self._rank_redis))
        registry.register(TPRankCollector(lambda: self._tp_ranks, self.metrics_labels))
        registry.register(PipelineStageCollector(lambda: self._tp_ranks, self.metrics_labels))
        registry.register(
            KeyedCounterCollector(
                "splitserve_moe_expert_tokens", "Tokens the expert of the layer computed (routed tokens, every rank's).",
                self.expert_load, self.metrics_labels, ("layer", "expert"),
            )
        )
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
        runner = self.engine.runner
        model = runner.model
        ranks = [dict(rank_fields(0, model, self.tp_node_ip, self.loop.alive), **stage_fields(runner))]
        leader_tokens = model.expert_tokens()
        expert_tokens = [leader_tokens.tolist() if leader_tokens is not None else []]
        calls = [asyncio.ensure_future(f.info.remote()) for f in self.tp_followers]
        if calls:
            await asyncio.wait(calls, timeout=timeout_s)
        rank_redis = []
        for rank, call in enumerate(calls, start=1):
            if call.done() and call.exception() is None:
                info = call.result()
                ranks.append({k: info[k] for k in ranks[0]})
                expert_tokens.append(info["expert_tokens"])
                rank_redis.append(info.get("redis_stats", {}))
            else:
                call.cancel()
                ranks.append(self._lost_rank(rank))
        self._tp_ranks = ranks
        if len(rank_redis) == len(ranks) - 1:  # counters only grow: keep the last complete picture otherwise
            self._rank_redis = rank_redis
        if len(expert_tokens) == len(ranks):  # keep the last complete picture otherwise
            self._rank_expert_tokens = expert_tokens
        return ranks

    def _lost_rank(self, rank: int) -> dict:
        """A rank that does not answer: not alive, where and what it was at the last probe that
        reached it (its stage, at least, follows from its rank)."""
        known = next((dict(r) for r in self._tp_ranks if r["rank"] == rank and r["alive"]), None)
        if known is None:
            known = dict(rank=rank, node_ip=self.tp_node_ip, stage=rank // (self.engine.config.num_ranks // self.engine.config.pp_size))
        known["alive"] = False
        return known

    def expert_load(self) -> dict[tuple[int, int], int]:
        """Tokens computed per (layer, expert) of a mixture-of-experts model, over every rank; empty for a dense one."""
        load = {}
        for rank, rank_tokens in enumerate(self._rank_expert_tokens):
            for layer, held in enumerate(rank_tokens):  # rank r holds experts [r * len(held), (r + 1) * len(held))
                for i, tokens in enumerate(held):
                    load[(layer, rank * len(held) + i)] = tokens
        return load

    def expert_status_fields(self) -> dict:
        """ReplicaStatus's EP fields: size, the busiest rank's routed tokens over the mean, the hottest experts."""
        ranks = [sum(sum(layer) for layer in r) for r in self._rank_expert_tokens]
        mean = sum(ranks) / len(ranks) if ranks else 0.0
        hottest = sorted(self.expert_load().items(), key=lambda item: -item[1])[:3]
        return dict(
            ep_size=self.engine.config.ep_size,
            ep_load_max_over_mean=max(ranks) / mean if mean else 0.0,
            hottest_experts=[dict(layer=layer, expert=expert, tokens=tokens) for (layer, expert), tokens in hottest if tokens],
        )

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
            tp_size=self.engine.config.tp_size,
            pp_size=self.engine.config.pp_size,
            tp_ranks=ranks,
            **self.expert_status_fields(),
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


def stage_fields(runner) -> dict:
    """The pipeline fields of splitserve.v1.TPRank for the rank stepping ``runner`` (a ModelRunner):
    its stage, the stage's layers, its KV pool's bytes and its busy seconds (as ``TPFollower.info``)."""
    stage = runner.model.stage
    return dict(
        stage=stage.index, layer_start=stage.layers.start, layer_end=stage.layers.stop,
        kv_bytes=runner.kv_cache.buffer.numel() * runner.kv_cache.buffer.element_size(), busy_s=round(runner.busy_s, 4),
    )


def _import_class(path: str) -> type:
    """The class at ``module:Class``."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
