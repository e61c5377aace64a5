"""``splitserve``: up (start a cluster), generate (stream an answer), status (pools and replicas), plan (the SLA planner)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

import grpc

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_REJECTED = 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_up(commands.add_parser("up", help="start a cluster (local Ray by default) and serve gRPC until Ctrl-C"))
    _add_generate(commands.add_parser("generate", help="stream the answer to a prompt"))
    _add_status(commands.add_parser("status", help="print the pools, replicas, their load and KV use"))
    from planner.cli import add_plan  # the planner sits above the router; this is the one entry point

    add_plan(commands.add_parser("plan", help="scale the prefill and decode pools to meet TTFT/ITL targets"))
    args = parser.parse_args(argv)
    return args.run(args)


def _add_client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--addr", default="localhost:50051", help="router address HOST:PORT (default: %(default)s)")
    parser.add_argument("--tls-ca", type=Path, help="CA certificate to verify the router with (enables TLS)")
    parser.add_argument("--tls-cert", type=Path, help="client certificate, for mutual TLS")
    parser.add_argument("--tls-key", type=Path, help="client private key, for mutual TLS")
    parser.add_argument("--token-file", type=Path, help="file holding the bearer token")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")


def _client(args: argparse.Namespace):
    from router.client import SplitServeClient

    token = args.token_file.read_text().strip() if args.token_file else None
    return SplitServeClient(args.addr, tls_ca_file=args.tls_ca, client_cert_file=args.tls_cert, client_key_file=args.tls_key, token=token)


def _add_generate(parser: argparse.ArgumentParser) -> None:
    _add_client_options(parser)
    parser.add_argument("prompt", help="the prompt (sent as one user chat message unless --raw)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--model", default="")
    parser.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    with _client(args) as client:
        kwargs = dict(prompt=args.prompt) if args.raw else dict(messages=[{"role": "user", "content": args.prompt}])
        try:
            for response in client.generate(
                **kwargs, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop, model=args.model, timeout_s=args.timeout,
            ):
                sys.stdout.write(response.text)
                sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\nsplitserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return EXIT_UNAVAILABLE if e.code() == grpc.StatusCode.UNAVAILABLE else EXIT_REJECTED
    sys.stdout.write("\n")
    return 0


def _add_status(parser: argparse.ArgumentParser) -> None:
    _add_client_options(parser)
    parser.set_defaults(run=_run_status)


def _run_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            status = client.cluster_status()
        except grpc.RpcError as e:
            print(f"splitserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return EXIT_UNAVAILABLE
    print(f"{'POOL':8} {'REPLICA':12} {'MODEL':24} {'HEALTHY':8} {'RUNNING':>8} {'WAITING':>8} {'KV USED':>14}")
    for r in sorted(status.replicas, key=lambda r: (r.pool, r.replica_id)):
        used = r.num_kv_blocks - r.num_free_kv_blocks
        kv = f"{used}/{r.num_kv_blocks} ({used / max(1, r.num_kv_blocks):.0%})"
        print(f"{r.pool:8} {r.replica_id:12} {r.model:24} {str(r.healthy).lower():8} {r.num_running:>8} {r.num_waiting:>8} {kv:>14}")
        if r.tp_size > 1:
            ranks = ", ".join(f"{t.rank}: pid {t.pid} {'alive' if t.alive else 'DEAD'} heads {t.kv_head_start}-{t.kv_head_end}" for t in r.tp_ranks)
            print(f"{'':8} {'':12} tp {r.tp_size} on {r.tp_ranks[0].node_ip or 'one node'} (ranks {ranks})")
        if r.ep_size > 1:
            ranks = ", ".join(f"{t.rank}: pid {t.pid} {'alive' if t.alive else 'DEAD'}" for t in r.tp_ranks)
            print(f"{'':8} {'':12} ep {r.ep_size} on {r.tp_ranks[0].node_ip or 'one node'} (ranks {ranks})")
        if r.hottest_experts:
            hot = ", ".join(f"layer {e.layer} expert {e.expert}: {e.tokens}" for e in r.hottest_experts)
            print(f"{'':8} {'':12} experts: busiest EP rank {r.ep_load_max_over_mean:.2f}x the mean; hottest {hot}")
    for pool in status.pools:
        if not (pool.target_replicas or pool.num_replicas or pool.num_restarts):
            continue
        backoff = f", next start in {pool.restart_backoff_s:.1f} s" if pool.restart_backoff_s else ""
        last = f", last failure: {pool.last_failure}" if pool.last_failure else ""
        print(
            f"pool {pool.pool}: {pool.num_replicas}/{pool.target_replicas} replicas, {pool.num_starting} starting, {pool.num_draining} draining, "
            f"{pool.num_restarts} restarts, {pool.num_failed_starts} failed starts{backoff}{last}"
        )
    for router in status.routers:
        print(f"router {router.router_id} at {router.grpc_address}: {router.num_inflight} in flight, metrics {router.metrics_url}")
    return 0


def _add_up(parser: argparse.ArgumentParser) -> None:
    from decode_worker.config import WorkerConfig
    from engine.config import EngineConfig
    from prefill_worker.config import PrefillWorkerConfig
    from router.cli_args import add_dataclass_args
    from router.config import RouterConfig
    from router.controller import ControllerConfig

    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--decode", type=int, default=1, help="decode replicas (default: %(default)s)")
    parser.add_argument(
        "--prefill", type=int, default=1, help="prefill replicas; 0 runs aggregated, decode replicas prefilling their own requests (default: %(default)s)"
    )
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel ranks of each prefill replica (default: %(default)s)")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks of each decode replica (default: %(default)s)")
    parser.add_argument(
        "--decode-ep", type=int, default=1,
        help="expert-parallel ranks of each decode replica of a mixture-of-experts model: experts split, attention data-parallel (default: %(default)s)",
    )
    parser.add_argument("--tls-cert", type=Path, help="server certificate (enables TLS)")
    parser.add_argument("--tls-key", type=Path, help="server private key")
    parser.add_argument("--tls-client-ca", type=Path, help="CA of client certificates (enables mutual TLS)")
    parser.add_argument(
        "--cluster-tls-cert", type=Path,
        help="this node's certificate (serverAuth and clientAuth) signed by --cluster-tls-ca: enables mutual TLS between routers and workers and on Ray's own gRPC",
    )
    parser.add_argument("--cluster-tls-key", type=Path, help="private key of --cluster-tls-cert")
    parser.add_argument("--cluster-tls-ca", type=Path, help="the cluster CA: peers whose certificate it did not sign are refused")
    add_dataclass_args(parser, EngineConfig, skip=("tp_size", "ep_size"))
    add_dataclass_args(parser, RouterConfig, skip=("tls", "cluster_tls"))
    add_dataclass_args(parser, WorkerConfig, prefix="worker", skip=("cluster_tls",))
    add_dataclass_args(parser, PrefillWorkerConfig, prefix="prefill")
    add_dataclass_args(parser, ControllerConfig, prefix="controller")
    parser.set_defaults(run=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    import os

    from decode_worker.config import WorkerConfig
    from engine.config import EngineConfig
    from prefill_worker.config import PrefillWorkerConfig
    from proto.tls import ClusterTLSConfig, ray_tls_env
    from router.cli_args import dataclass_from_args
    from router.config import RouterConfig, TLSConfig
    from router.controller import ControllerConfig
    from router.launch import Cluster, ClusterConfig

    from ray.exceptions import RayTaskError

    from router.errors import cause_line

    try:
        tls = None
        if args.tls_cert or args.tls_key:
            tls = TLSConfig(cert_file=args.tls_cert, key_file=args.tls_key, client_ca_file=args.tls_client_ca)
        cluster_tls = None
        cluster_tls_files = (args.cluster_tls_cert, args.cluster_tls_key, args.cluster_tls_ca)
        if any(cluster_tls_files):
            if not all(cluster_tls_files):
                raise ValueError("cluster_tls: --cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca go together")
            cluster_tls = ClusterTLSConfig(*cluster_tls_files)
        config = ClusterConfig(
            engine=dataclass_from_args(EngineConfig, args),
            worker=dataclass_from_args(WorkerConfig, args, prefix="worker", cluster_tls=cluster_tls),
            prefill=dataclass_from_args(PrefillWorkerConfig, args, prefix="prefill"),
            router=dataclass_from_args(RouterConfig, args, tls=tls, cluster_tls=cluster_tls),
            controller=dataclass_from_args(ControllerConfig, args, prefix="controller"),
            num_decode=args.decode,
            num_prefill=args.prefill,
            ray_address=args.address,
            prefill_tp_size=args.prefill_tp,
            decode_tp_size=args.decode_tp,
            decode_ep_size=args.decode_ep,
        )
    except (ValueError, TypeError) as e:
        print(f"splitserve up: {e}", file=sys.stderr)
        return EXIT_USAGE

    ray_env = ray_tls_env(cluster_tls) if cluster_tls else {}
    if sys.argv[1:2] == ["up"] and any(os.environ.get(k) != v for k, v in ray_env.items()):
        # Ray takes its TLS settings from the environment when it is imported, which it already is:
        # start again with them (same pid), so this process and every Ray process it starts use TLS.
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "router.cli", *sys.argv[1:]], {**os.environ, **ray_env})

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = Cluster(config)
    mode = f"{config.num_prefill} prefill + {config.num_decode} decode replica(s)" if config.num_prefill else f"{config.num_decode} decode replica(s), aggregated"
    print(f"splitserve: starting {mode} of {config.engine.model} ...", flush=True)
    try:
        try:
            status = cluster.start()
        except RayTaskError as e:  # a replica could not start: say why in one sentence
            print(f"splitserve up: {cause_line(e)}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        print(f"splitserve: serving gRPC on {status.grpc_address} (metrics {status.metrics_url})", flush=True)
        tls_flag = " --tls-ca CA.pem" if tls else ""
        print(f"try: splitserve generate --addr {status.grpc_address}{tls_flag} \"What is the capital of France?\"", flush=True)
        stop.wait()
        print("splitserve: shutting down", flush=True)
    finally:
        cluster.stop()
        import ray

        ray.shutdown()
    print("splitserve: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
