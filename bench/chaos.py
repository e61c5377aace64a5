"""Chaos soak: a live cluster under steady load while faults run, every answer checked.

``soak``: a local cluster (2 prefill + 2 decode replicas, a Redis tier on a redis-server this
bench starts) serves ``--clients`` closed-loop clients for ``--duration-s``: greedy calls that
must complete, calls cancelled after a few tokens, calls with short deadlines. Meanwhile the
faults cycle, ``rounds`` times each, evenly spread::

    kill_prefill   ray.kill a random prefill replica (the controller replaces it)
    kill_decode    ray.kill a random decode replica (its calls migrate; it is replaced)
    restart_redis  stop redis-server (its data is lost), start it again on the same port
    drop_transfer  the next 2 hand-offs of a random prefill replica fail (decode recomputes)

Every completed call is checked against a greedy reference from an in-process engine; then every
pool must drain, no block, lease or NIXL handle held. A fault not recovered from within
``--recovery-s`` is reported with ``recovered_s: null``. ``pauses``: what one stream sees when
its decode replica is killed or frozen.

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

from bench.report import arg_parser, emit_report, machine, percentile, positive, progress, run, user_error
from bench.workload import greedy, local_cluster, random_tokens, redis_server
from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from router.client import SplitServeClient
from router.config import RouterConfig
from router.controller import ControllerConfig
from router.launch import Cluster, ClusterConfig

FAULTS = ("kill_prefill", "kill_decode", "restart_redis", "drop_transfer")
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
            )
            progress("chaos", "starting 2 prefill + 2 decode replicas with a Redis tier")
            with local_cluster(config) as (cluster, client):
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


def _replicas(cluster: Cluster, pool: str | None = None) -> dict:
    """Replica id -> actor handle of each replica (of ``pool``) the controller holds."""
    return {s.replica_id: h for s, _, h in ray.get(cluster.controller.replicas.remote()) if pool in (None, s.pool)}


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
            handle = _replicas(cluster)[victim]
            pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
            struck = last = time.monotonic()
            if how == "kill":
                ray.kill(handle)
            else:
                os.kill(pid, signal.SIGSTOP)
            gaps = []
            for response in stream:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                ids += response.token_ids
            while len([r for r in client.cluster_status().replicas if r.replica_id != victim]) < num_decode:
                time.sleep(0.1)
            results[case] = {"max_gap_s": round(max(gaps), 3), "identical": ids == expected, "pool_whole_after_s": round(time.monotonic() - struck, 2)}
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
        try:
            for num_responses, response in enumerate(stream):
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - started
                outcome.token_ids += response.token_ids
                if response.finish_reason:
                    outcome.finished, outcome.completion_tokens = True, response.usage.completion_tokens
                if cancel_after is not None and num_responses >= cancel_after and not outcome.finished:
                    stream.cancel()
        except grpc.RpcError as e:
            outcome.status = e.code().name
        soak.outcomes.append(outcome)


def _faults(soak: Soak, interval_s: float, rounds: int, recovery_s: float, rng: random.Random) -> None:
    for fault in [f for _ in range(rounds) for f in FAULTS]:
        if soak.stop.wait(interval_s):
            return
        started = soak.now()
        progress("chaos", f"{started:.0f} s: {fault}")
        target, recovered_s = _inject(soak, fault, rng, recovery_s)
        soak.fault_log.append({"kind": fault, "at_s": round(started, 2), "target": target, "recovered_s": recovered_s})


def _inject(soak: Soak, fault: str, rng: random.Random, recovery_s: float) -> tuple[str, float | None]:
    """Run one fault; returns what it hit and how long until the cluster was whole again (None: not within ``recovery_s``)."""
    started = time.monotonic()
    if fault == "restart_redis":
        soak.redis.stop()
        time.sleep(1.0)
        soak.redis.start()
        return "redis", round(time.monotonic() - started, 2)
    pool = "decode" if fault == "kill_decode" else "prefill"
    replicas = _replicas(soak.cluster, pool)
    if not replicas:
        return "none live", None
    target = rng.choice(sorted(replicas))
    if fault == "drop_transfer":
        ray.get(replicas[target].inject_faults.remote(fail_next=2))
        return target, 0.0
    ray.kill(replicas[target])
    while time.monotonic() - started < recovery_s:
        live = _replicas(soak.cluster, pool)
        if target not in live and len(live) == len(replicas):
            return target, round(time.monotonic() - started, 2)
        time.sleep(0.2)
    return target, None


def _drain(soak: Soak, timeout_s: float) -> dict:
    """Blocks, leases and NIXL handles still held once the pools had ``timeout_s`` to drain."""
    deadline = time.monotonic() + timeout_s
    while True:
        handles = _replicas(soak.cluster)
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
    counts = tally(soak.outcomes, soak.references, soak.fault_log)
    leaked = leaks["leaked_blocks"] or leaks["open_leases"] or leaks["open_handles"]
    return {
        "duration_s": args.duration_s,
        "model": args.model,
        "clients": args.clients,
        **counts,
        **leaks,
        **_router_metrics(soak.cluster.router_status.metrics_url),
        "pools": pools,
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


def _router_metrics(metrics_url: str) -> dict:
    """Migrations the router made, and their mean time from a replica's death to the next event."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    count = metric_total(text, "splitserve_migration_seconds_count")
    return {
        "migrations": int(metric_total(text, "splitserve_migrations_total")),
        "migration_s_mean": metric_total(text, "splitserve_migration_seconds_sum") / count if count else None,
    }


if __name__ == "__main__":
    raise SystemExit(run("chaos", main))
