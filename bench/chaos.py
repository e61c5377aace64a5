"""Chaos soak: a live cluster under steady load while faults run, every answer checked.

``soak``: a local cluster (2 prefill + 2 decode replicas, 2 routers, a Redis tier on a
redis-server this bench starts) serves ``--clients`` closed-loop clients for ``--duration-s``:
greedy calls that must complete, calls cancelled after a few tokens, calls with short deadlines.
The clients hold both routers' addresses (a stream cut by a dead router resumes on the other).
Meanwhile the faults cycle, ``rounds`` times each, evenly spread, one at a time::

    kill_controller  SIGKILL the controller's process (Ray starts it again; it rebuilds its map
                     from the live replicas; routers serve from their last map meanwhile)
    kill_prefill     ray.kill a random prefill replica (the controller replaces it)
    kill_decode      ray.kill a random decode replica (its calls migrate; it is replaced)
    kill_router      SIGKILL a random router's process (its streams resume on the other router;
                     the controller starts it again on its port)
    restart_redis    stop redis-server (its data is lost), start it again on the same port
    drop_transfer    the next 2 hand-offs of a random prefill replica fail (decode recomputes)

Every completed call is checked against a greedy reference from an in-process engine; then every
pool must drain, no block, lease or NIXL handle held. A fault not recovered from within
``--recovery-s`` is reported with ``recovered_s: null``; ``by_fault`` gives, per kind, the
recovery seconds and the longest gap a stream saw (bench/chaos_faults.py says how each is
measured). ``pauses``: what one stream sees when its decode replica is killed or frozen.

No GCS restart: Ray's GCS recovers only from an external Redis (``RAY_REDIS_ADDRESS`` set when
the head starts), and Ray 2.60 restarts nothing on one host: a SIGKILLed gcs_server takes its
head node down, and a stopped one must be started again by hand from its command line. The
soak's Ray is the one ``ray.init`` starts in this process (or a test session's), which has no
such Redis; tests/integration/test_gcs_fault_tolerance.py runs that fault on a head of its own.

The KV cache is fp32 by default: with fp8 a prefix read back quantized attends differently from
one computed in the same pass, so a greedy answer depends on what the cache held.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc
import ray

from bench.chaos_faults import FAULTS, baseline_gap, by_kind, inject, replicas, window_stats
from bench.report import arg_parser, emit_report, machine, percentile, positive, progress, run, user_error
from bench.workload import greedy, local_cluster, random_tokens, redis_server
from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.controller import ControllerConfig
from router.control.launch import Cluster, ClusterConfig

EXPECTED = {"cancel": "CANCELLED", "deadline": "DEADLINE_EXCEEDED"}
"""The one status each kind of call may end with instead of completing."""
PAUSES = {"kill_decode": (2, "kill"), "freeze_decode": (2, "freeze"), "kill_only_decode": (1, "kill")}
"""Case -> (decode replicas, what happens to the one serving the stream)."""


@dataclass
class Outcome:
    """How one call ended."""

    kind: str
    prompt: int
    """Index of its prompt."""
    started_s: float
    status: str = "OK"
    ttft_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    finished: bool = False
    """The last response carried a finish reason."""
    times: list[float] = field(default_factory=list)
    """When each response arrived, seconds since the soak began."""
    resumed_at: list[float] = field(default_factory=list)
    """When the first response after each move to another router mid-answer arrived (seconds since the soak began)."""
    detail: str = ""
    """The status's details when it failed."""


@dataclass
class Soak:
    """The cluster under test and what the bench recorded of it."""

    cluster: Cluster
    client: SplitServeClient
    redis: object
    """The tests' ``RedisServer`` the cluster's Redis tier runs on."""
    prompts: list[list[int]]
    references: list[list[int]]
    max_tokens: int
    outcomes: list[Outcome] = field(default_factory=list)
    fault_log: list[dict] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    t0: float = field(default_factory=time.monotonic)
    streams: dict = field(default_factory=dict)
    """Client thread id -> the call it is making now and its stream."""

    def now(self) -> float:
        return time.monotonic() - self.t0


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--duration-s", type=positive, default=600, help="how long the load runs (default: 600)")
    parser.add_argument("--kv-dtype", default="fp32", help="fp32 (default) keeps greedy answers exact whatever the cache held; see the docstring")
    parser.add_argument("--clients", type=positive, default=4)
    parser.add_argument("--prompts", type=positive, default=24, help="distinct prompts; they share a prefix (default: 24)")
    parser.add_argument("--max-tokens", type=positive, default=24)
    parser.add_argument("--recovery-s", type=positive, default=120, help="a fault not recovered from by then is reported as such")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", nargs="+", choices=("soak", "pauses"), default=["soak", "pauses"])
    args = parser.parse_args(argv)
    report = {}
    if "soak" in args.phases:
        with redis_server("chaos") as redis:
            # fp32 weights: every answer is checked token for token against one engine's greedy run,
            # and the quantized kernels (picked by the rows of a step) vary with the batch.
            engine = EngineConfig(model=args.model, weights="fp32", kv_dtype=args.kv_dtype, num_kv_blocks=192, max_num_seqs=16, max_model_len=1024, redis_url=redis.url)
            prompts, references = _references(engine, args)
            config = ClusterConfig(
                engine=engine,
                worker=WorkerConfig(kv_transfer_timeout_s=10),
                router=RouterConfig(port=0, worker_refresh_interval_s=0.2),
                controller=ControllerConfig(health_check_interval_s=0.5, health_check_timeout_s=5, restart_backoff_s=1, stable_after_s=10),
                num_prefill=2,
                num_decode=2,
                num_routers=2,
            )
            progress("chaos", "starting 2 prefill + 2 decode replicas and 2 routers with a Redis tier")
            with _cluster(config) as (cluster, client):
                report = _soak(Soak(cluster, client, redis, prompts, references, args.max_tokens), args)
    if "pauses" in args.phases:
        report["pauses"] = _pauses(args)
        report.setdefault("machine", machine())
    emit_report(report, args.json)
    return 0


def _references(engine: EngineConfig, args) -> tuple[list[list[int]], list[list[int]]]:
    """``--prompts`` prompts sharing a 96-token prefix, and each one's greedy answer from an in-process engine."""
    progress("chaos", f"greedy references for {args.prompts} prompts from an in-process engine of {args.model}")
    with user_error(EngineError, ValueError, prefix=f"--model {args.model}: "):
        reference = LLMEngine(engine)
    rng = random.Random(args.seed)
    vocab = reference.model_config.vocab_size
    shared = random_tokens(rng, 96, vocab)
    prompts = [shared + random_tokens(rng, rng.randrange(8, 64), vocab) for _ in range(args.prompts)]
    references = [list(c.output_token_ids) for c in reference.generate(prompts, greedy(args.max_tokens))]
    reference.close()
    return prompts, references


@contextlib.contextmanager
def _cluster(config: ClusterConfig):
    """A local cluster started from ``config`` and a client holding every router's address; both stopped after."""
    cluster = Cluster(config)
    try:
        cluster.start()
        with SplitServeClient([s.grpc_address for s in cluster.router_statuses]) as client:
            yield cluster, client
    finally:
        cluster.stop()


def _pauses(args) -> dict:
    """What one streaming client sees when its decode replica is killed (SIGKILL) or frozen
    (SIGSTOP: it stops answering), on an aggregated cluster with the default controller and
    router settings: the longest gap between two of its tokens, whether its tokens equal an
    undisturbed run's, and how long until the pool is whole again."""
    results = {}
    for case, (num_decode, how) in PAUSES.items():
        progress("chaos", f"pauses: {case} ({num_decode} decode replica(s))")
        config = ClusterConfig(engine=EngineConfig(model=args.model, weights="fp32", kv_dtype=args.kv_dtype), router=RouterConfig(port=0), num_decode=num_decode)
        with local_cluster(config) as (cluster, client):
            sampling = dict(max_tokens=200, temperature=0, ignore_eos=True)
            expected = [t for r in client.generate("Tell me about the sea.", **sampling) for t in r.token_ids]
            stream = client.generate("Tell me about the sea.", **sampling)
            ids = [t for _, r in zip(range(4), stream) for t in r.token_ids]
            victim = next(r.replica_id for r in client.cluster_status().replicas if r.num_running)
            handle = replicas(cluster)[victim]
            pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
            struck = last = time.monotonic()
            if how == "kill":
                ray.kill(handle)
            else:
                os.kill(pid, signal.SIGSTOP)
            intervals = []
            for response in stream:
                now = time.monotonic()
                intervals.append(now - last)
                last = now
                ids += response.token_ids
            while len([r for r in client.cluster_status().replicas if r.replica_id != victim]) < num_decode:
                time.sleep(0.1)
            results[case] = {"max_gap_s": round(max(intervals), 3), "identical": ids == expected, "pool_whole_after_s": round(time.monotonic() - struck, 2)}
            if how == "freeze":
                with contextlib.suppress(ProcessLookupError):  # the controller has killed it already
                    os.kill(pid, signal.SIGKILL)
    return results


def _soak(soak: Soak, args) -> dict:
    rounds = max(1, args.duration_s // 180)
    interval_s = args.duration_s / (len(FAULTS) * rounds + 1)
    clients = [threading.Thread(target=_client, args=(soak, random.Random(args.seed + i)), daemon=True) for i in range(args.clients)]
    faults = threading.Thread(target=_faults, args=(soak, interval_s, rounds, args.recovery_s, random.Random(args.seed)), daemon=True)
    progress("chaos", f"{args.clients} clients for {args.duration_s} s; {rounds} round(s) of {len(FAULTS)} faults, one every {interval_s:.0f} s")
    for thread in (*clients, faults):
        thread.start()
    faults.join(args.duration_s + args.recovery_s * len(FAULTS) * rounds)
    soak.stop.set()
    for thread in clients:
        thread.join(args.recovery_s)
    progress("chaos", "load stopped; waiting for every pool to drain")
    leaks = _drain(soak, args.recovery_s)
    return _report(soak, args, leaks)


def _client(soak: Soak, rng: random.Random) -> None:
    while not soak.stop.is_set():
        index = rng.randrange(len(soak.prompts))
        kind = rng.choices(("plain", "cancel", "deadline"), weights=(70, 15, 15))[0]
        outcome = Outcome(kind, index, soak.now())
        timeout_s = rng.uniform(0.05, 1.0) if kind == "deadline" else 300.0
        cancel_after = rng.randrange(0, 6) if kind == "cancel" else None
        started = time.monotonic()
        stream = soak.client.generate(soak.prompts[index], max_tokens=soak.max_tokens, temperature=0, ignore_eos=True, timeout_s=timeout_s)
        soak.streams[threading.get_ident()] = outcome, stream
        try:
            for num_responses, response in enumerate(stream):
                outcome.times.append(soak.now())
                if stream.num_resumes > len(outcome.resumed_at):
                    outcome.resumed_at.append(outcome.times[-1])
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - started
                outcome.token_ids += response.token_ids
                if response.finish_reason:
                    outcome.finished, outcome.completion_tokens = True, response.usage.completion_tokens
                if cancel_after is not None and num_responses >= cancel_after and not outcome.finished:
                    stream.cancel()
        except grpc.RpcError as e:
            outcome.status, outcome.detail = e.code().name, e.details() or ""
        soak.streams.pop(threading.get_ident(), None)
        soak.outcomes.append(outcome)


def _faults(soak: Soak, interval_s: float, rounds: int, recovery_s: float, rng: random.Random) -> None:
    for fault in [f for _ in range(rounds) for f in FAULTS]:
        if soak.stop.wait(interval_s):
            return
        started = soak.now()
        progress("chaos", f"{started:.0f} s: {fault}")
        target, recovered_s = inject(soak.cluster, soak.redis, fault, rng, recovery_s, lambda: {s.address for o, s in list(soak.streams.values()) if o.token_ids and not o.finished})
        progress("chaos", f"{fault} on {target}: recovered after {recovered_s} s")
        soak.fault_log.append({"kind": fault, "at_s": round(started, 2), "target": target, "recovered_s": recovered_s})
    soak.stop.wait(interval_s)  # the load runs on after the last fault, as between two


def _drain(soak: Soak, timeout_s: float) -> dict:
    """Blocks, leases and NIXL handles still held once the pools had ``timeout_s`` to drain."""
    deadline = time.monotonic() + timeout_s
    while True:
        handles = replicas(soak.cluster)
        statuses = soak.client.cluster_status().replicas
        held = {r.replica_id: {"blocks": r.num_kv_blocks - r.num_free_kv_blocks, "leases": 0, "handles": 0} for r in statuses}
        for rid, stats in zip(handles, ray.get([h.transfer_stats.remote() for h in handles.values()])):
            held.setdefault(rid, {"blocks": 0}).update(leases=stats.num_open_leases, handles=stats.num_open_handles)
        leaks = {
            "leaked_blocks": sum(r["blocks"] for r in held.values()),
            "open_leases": sum(r["leases"] for r in held.values()),
            "open_handles": sum(r["handles"] for r in held.values()),
            "replicas": len(statuses),
            "leaks_by_replica": {rid: held[rid] for rid in sorted(held) if any(held[rid].values())},
        }
        if not any(leaks[k] for k in ("leaked_blocks", "open_leases", "open_handles")) or time.monotonic() > deadline:
            return leaks
        time.sleep(0.5)


def _report(soak: Soak, args, leaks: dict) -> dict:
    pools = {p.pool: {"restarts": p.num_restarts, "failed_starts": p.num_failed_starts, "replicas": p.num_replicas} for p in soak.client.cluster_status().pools}
    for fault, seen in zip(soak.fault_log, window_stats(soak.outcomes, soak.fault_log)):
        fault.update(seen)
    first_fault_s = soak.fault_log[0]["at_s"] if soak.fault_log else float("inf")
    counts = tally(soak.outcomes, soak.references, soak.fault_log)
    leaked = leaks["leaked_blocks"] or leaks["open_leases"] or leaks["open_handles"]
    return {
        "duration_s": args.duration_s,
        "model": args.model,
        "clients": args.clients,
        **counts,
        **leaks,
        "stream_resumes": sum(len(o.resumed_at) for o in soak.outcomes),
        "controller_restarts": ray.get(soak.cluster.controller.controller_history.remote()).num_restarts,
        **_router_metrics([r.metrics_url for r in soak.client.cluster_status().routers]),
        "pools": pools,
        "by_fault": by_kind(soak.fault_log, baseline_gap(soak.outcomes, first_fault_s)),
        "fault_log": soak.fault_log,
        "survived": not (counts["lost"] or counts["wrong"] or counts["failed_unasked"] or counts["unrecovered_faults"] or leaked),
        "machine": machine(),
    }


def tally(outcomes: list[Outcome], references: list[list[int]], fault_log: list[dict], window_s: float = 15.0) -> dict:
    """What the calls came to: completed and checked against ``references``, failed (asked for
    by a cancel or deadline, or not), lost; faults by kind; TTFT of calls started within
    ``window_s`` after a fault began."""
    completed = [o for o in outcomes if o.status == "OK" and o.finished]
    wrong, duplicated, wrong_examples = 0, 0, []
    for o in completed:
        reference = references[o.prompt]
        if o.token_ids != reference or o.completion_tokens != len(o.token_ids):
            wrong += 1
            duplicated += max(0, len(o.token_ids) - len(reference))
            diverged = next((i for i, (a, b) in enumerate(zip(o.token_ids, reference)) if a != b), min(len(o.token_ids), len(reference)))
            wrong_examples.append({"prompt": o.prompt, "started_s": round(o.started_s, 2), "diverged_at": diverged, "tokens": len(o.token_ids)})
    windows = [(f["at_s"], f["at_s"] + window_s) for f in fault_log]
    during = [o.ttft_s for o in outcomes if o.ttft_s is not None and any(a <= o.started_s <= b for a, b in windows)]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    faults = {kind: sum(1 for f in fault_log if f["kind"] == kind) for kind in FAULTS}
    return {
        "requests": len(outcomes),
        "completed": len(completed),
        "failed_with_status": dict(Counter(o.status for o in outcomes if o.status != "OK")),
        "failed_unasked": sum(1 for o in outcomes if o.status != "OK" and EXPECTED.get(o.kind) != o.status),
        "failed_unasked_examples": [
            {"kind": o.kind, "status": o.status, "started_s": round(o.started_s, 2), "tokens": len(o.token_ids), "detail": o.detail[:300]}
            for o in outcomes
            if o.status != "OK" and EXPECTED.get(o.kind) != o.status
        ][:5],
        "lost": sum(1 for o in outcomes if o.status == "OK" and not o.finished),
        "wrong": wrong,
        "duplicated_tokens": duplicated,
        "wrong_examples": wrong_examples[:5],
        "faults": {**faults, "cancel": sum(o.kind == "cancel" for o in outcomes), "deadline": sum(o.kind == "deadline" for o in outcomes)},
        "unrecovered_faults": sum(1 for f in fault_log if f["recovered_s"] is None),
        "ttft_s_p99_during_faults": percentile(during, 99) if during else None,
        "ttft_s_p50_all": percentile(ttfts, 50) if ttfts else None,
    }


def metric_total(text: str, name: str) -> float:
    """The sum over every labelled sample of ``name`` in a Prometheus exposition."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _router_metrics(metrics_urls: list[str]) -> dict:
    """Migrations the routers made, and their mean time from a replica's death to the next event
    (a router killed by the soak took its own counts with it)."""
    text = "\n".join(urllib.request.urlopen(url, timeout=10).read().decode() for url in metrics_urls)
    count = metric_total(text, "splitserve_migration_seconds_count")
    return {
        "migrations": int(metric_total(text, "splitserve_migrations_total")),
        "migration_s_mean": metric_total(text, "splitserve_migration_seconds_sum") / count if count else None,
    }


if __name__ == "__main__":
    raise SystemExit(run("chaos", main))
