"""Prometheus metrics of a worker process, read from snapshots at scrape time (both worker roles use them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields, replace

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.outputs import EngineStats


class EngineStatsCollector(Collector):
    """Exposes an EngineStats snapshot as gauges and counters labelled with the replica."""

    def __init__(self, stats: Callable[[], EngineStats], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator:
        s = self._stats()
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        yield gauge("splitserve_worker_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("splitserve_worker_requests_waiting", "Requests queued for a batch slot.", s.num_waiting)
        yield gauge("splitserve_kv_blocks_total", "KV blocks in the pool.", s.num_kv_blocks)
        yield gauge("splitserve_kv_blocks_free", "KV blocks no request holds (cached or empty).", s.num_free_kv_blocks)
        yield gauge("splitserve_kv_blocks_used", "KV blocks held by requests.", s.num_kv_blocks - s.num_free_kv_blocks)
        yield gauge("splitserve_kv_blocks_cached", "KV blocks findable in the prefix cache.", s.num_cached_kv_blocks)
        preemptions = CounterMetricFamily("splitserve_worker_preemptions", "Requests preempted for blocks.", labels=names)
        preemptions.add_metric(values, s.num_preemptions)
        yield preemptions
        aborted = CounterMetricFamily("splitserve_worker_requests_aborted", "Requests cancelled before finishing.", labels=names)
        aborted.add_metric(values, s.num_aborted_requests)
        yield aborted
        failed = CounterMetricFamily(
            "splitserve_worker_requests_failed", "Requests failed alone because a step raised for them (the replica kept serving).", labels=names
        )
        failed.add_metric(values, s.num_failed_requests)
        yield failed
        computed = CounterMetricFamily(
            "splitserve_worker_prompt_tokens_computed", "Prompt tokens computed (cache hits excluded).", labels=names
        )
        computed.add_metric(values, s.num_computed_prompt_tokens)
        yield computed
        # rate(step_seconds) / rate(steps) is the mean step; (step_seconds - step_cpu_seconds) is
        # how long the engine thread waited inside steps (GIL, a core, its OpenMP team).
        for name, doc, value in (
            ("splitserve_engine_steps", "Engine steps that computed tokens.", s.num_steps),
            ("splitserve_engine_step_tokens", "Tokens computed by engine steps (prompt chunks and decode tokens).", s.num_step_tokens),
            ("splitserve_engine_step_seconds", "Wall time spent in engine steps.", s.step_s),
            ("splitserve_engine_step_cpu_seconds", "CPU time of the engine thread in engine steps.", s.step_cpu_s),
            ("splitserve_engine_spec_draft_tokens", "Speculative draft tokens verified by the model.", s.num_draft_tokens),
            ("splitserve_engine_spec_accepted_tokens", "Speculative draft tokens accepted.", s.num_accepted_draft_tokens),
            ("splitserve_engine_forced_tokens", "Output tokens constraints forced, appended without a step each (jump-forward).", s.num_forced_tokens),
            ("splitserve_engine_grammar_compiles", "Constraints compiled (grammar cache misses).", s.num_grammar_compiles),
            ("splitserve_engine_grammar_compile_seconds", "Wall time spent compiling constraints.", s.grammar_compile_s),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, value)
            yield counter


_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 30, 60, 120)


class RequestTimingHistograms:
    """Per-request latency histograms measured on a worker, labelled with the replica: how long
    requests queue in the engine, wait for a KV hand-off, and take to their first token. Set
    beside the router's TTFT, the last one shows what the serving path (router, Ray) adds."""

    def __init__(self, labels: dict[str, str]) -> None:
        names, values = list(labels), list(labels.values())

        self.collectors: list[Histogram] = []

        def histogram(name: str, doc: str):
            family = Histogram(name, doc, names, buckets=_LATENCY_BUCKETS_S, registry=None)
            self.collectors.append(family)
            return family.labels(*values)

        self.admit = histogram("splitserve_worker_admit_seconds", "Reaching the worker to the engine thread taking it in (the rest of the step it was running).")
        self.queue = histogram("splitserve_worker_queue_seconds", "Reaching the worker to the first scheduled step (the wait for the engine thread included).")
        self.first_token = histogram("splitserve_worker_first_token_seconds", "Reaching the worker to its first token leaving for the router.")
        self.kv_handoff = histogram("splitserve_worker_kv_handoff_seconds", "Asking a prefill worker to its KV having landed (remote prefills only).")

    def observe(self, admit_s: float, queue_s: float, first_token_s: float, kv_handoff_s: float) -> None:
        self.admit.observe(admit_s)
        self.queue.observe(queue_s)
        self.first_token.observe(first_token_s)
        if kv_handoff_s > 0:
            self.kv_handoff.observe(kv_handoff_s)


class CountersCollector(Collector):
    """Exposes the int fields of a dataclass snapshot: ``num_*`` fields named in ``gauges`` as
    gauges, the others as counters, each as ``{prefix}_{field without num_}``."""

    def __init__(self, prefix: str, snapshot: Callable[[], object], labels: dict[str, str], gauges: frozenset[str] = frozenset()) -> None:
        self._prefix = prefix
        self._snapshot = snapshot
        self._labels = labels
        self._gauges = gauges

    def collect(self) -> Iterator:
        snapshot = self._snapshot()
        names, values = list(self._labels), list(self._labels.values())
        for f in fields(snapshot):
            name = f"{self._prefix}_{f.name.removeprefix('num_')}"
            doc = (f.metadata.get("doc") or f.name.replace("_", " ")) + "."
            family = (GaugeMetricFamily if f.name in self._gauges else CounterMetricFamily)(name, doc, labels=names)
            family.add_metric(values, getattr(snapshot, f.name))
            yield family


class TierStatsCollector(Collector):
    """Hits, misses, bytes and evictions per KV tier, plus the Redis tier's own counters: the
    replica's, every rank's added (``rank_redis``: the other ranks' ``RedisTierStats`` fields, as
    of the last status probe; each rank writes and reads its own values)."""

    def __init__(self, store, labels: dict[str, str], rank_redis: Callable[[], list[dict]] = list) -> None:
        self._store = store
        self._labels = labels
        self._rank_redis = rank_redis

    def collect(self) -> Iterator:
        names, values = list(self._labels) + ["tier"], list(self._labels.values())
        docs = {
            "hits": "KV blocks served from the tier.",
            "misses": "Prefix lookups that stopped at a block the tier did not have.",
            "bytes": "Bytes of KV served from the tier.",
            "evictions": "KV blocks the tier dropped or passed down for space.",
        }
        tiers = self._store.stats.tiers
        for short, doc in docs.items():
            family = CounterMetricFamily(f"splitserve_kv_tier_{short}", doc, labels=names)
            for tier, stats in tiers.items():
                family.add_metric(values + [tier.value], getattr(stats, f"num_{short}"))
            yield family
        redis = self._store.redis
        if redis is not None:
            yield from CountersCollector("splitserve_redis_tier", lambda: self._replica_redis(redis.stats_snapshot()), self._labels).collect()

    def _replica_redis(self, own):
        total = replace(own)
        for rank in self._rank_redis():
            for f in fields(own):
                setattr(total, f.name, getattr(total, f.name) + rank.get(f.name, 0))
        return total


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> str:
    """Start the Prometheus HTTP endpoint on a daemon thread; returns its URL."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return f"http://{host}:{server.server_port}/metrics"


class KeyedCounterCollector(Collector):
    """One counter whose samples are the entries of a ``{key tuple: value}`` snapshot, the key
    parts as labels named ``keys`` (e.g. bytes per (tp_rank, decode_rank) pair)."""

    def __init__(self, name: str, doc: str, snapshot: Callable[[], dict[tuple, float]], labels: dict[str, str], keys: tuple[str, ...]) -> None:
        self._name, self._doc, self._snapshot, self._labels, self._keys = name, doc, snapshot, labels, keys

    def collect(self) -> Iterator:
        family = CounterMetricFamily(self._name, self._doc, labels=list(self._labels) + list(self._keys))
        for key, value in sorted(self._snapshot().items()):
            family.add_metric(list(self._labels.values()) + [str(k) for k in key], value)
        yield family


class TPRankCollector(Collector):
    """Per rank of a tensor-parallel replica: whether it is up and the parameter bytes it holds,
    as of the replica's last status probe (``tp_rank`` label)."""

    def __init__(self, ranks: Callable[[], list[dict]], labels: dict[str, str]) -> None:
        self._ranks = ranks
        self._labels = labels

    def collect(self) -> Iterator:
        names, values = list(self._labels) + ["tp_rank"], list(self._labels.values())
        up = GaugeMetricFamily("splitserve_tp_rank_up", "1 while the rank's process answers and its step loop runs.", labels=names)
        params = GaugeMetricFamily("splitserve_tp_rank_parameter_bytes", "Bytes of model parameters the rank holds.", labels=names)
        for rank in self._ranks():
            up.add_metric(values + [str(rank["rank"])], 1.0 if rank["alive"] else 0.0)
            params.add_metric(values + [str(rank["rank"])], rank.get("param_bytes", 0))
        yield up
        yield params


class PipelineStageCollector(Collector):
    """Per pipeline stage of a replica (one stage, 0, without pipeline parallelism), from its
    ranks' fields as of the last status probe (``stage`` label): whether every rank of the stage
    is up, the seconds its busiest rank spent stepping (the stage's share of the pipeline's
    time: a stage busier than the others sets the pace), its layers, parameter and KV bytes."""

    def __init__(self, ranks: Callable[[], list[dict]], labels: dict[str, str]) -> None:
        self._ranks = ranks
        self._labels = labels

    def collect(self) -> Iterator:
        names, values = list(self._labels) + ["stage"], list(self._labels.values())
        up = GaugeMetricFamily("splitserve_pp_stage_up", "1 while every rank of the stage answers and its step loop runs.", labels=names)
        busy = CounterMetricFamily("splitserve_pp_stage_busy_seconds", "Seconds the stage's busiest rank spent running steps.", labels=names)
        layers = GaugeMetricFamily("splitserve_pp_stage_layers", "Decoder layers the stage holds.", labels=names)
        params = GaugeMetricFamily("splitserve_pp_stage_parameter_bytes", "Bytes of model parameters the stage's ranks hold.", labels=names)
        kv = GaugeMetricFamily("splitserve_pp_stage_kv_bytes", "Bytes of the KV pools of the stage's ranks.", labels=names)
        stages: dict[int, list[dict]] = {}
        for rank in self._ranks():
            stages.setdefault(rank.get("stage", 0), []).append(rank)
        for stage, ranks in sorted(stages.items()):
            label = values + [str(stage)]
            up.add_metric(label, 1.0 if all(r["alive"] for r in ranks) else 0.0)
            busy.add_metric(label, max(r.get("busy_s", 0.0) for r in ranks))
            layers.add_metric(label, max(r.get("layer_end", 0) - r.get("layer_start", 0) for r in ranks))
            params.add_metric(label, sum(r.get("param_bytes", 0) for r in ranks))
            kv.add_metric(label, sum(r.get("kv_bytes", 0) for r in ranks))
        yield from (up, busy, layers, params, kv)
