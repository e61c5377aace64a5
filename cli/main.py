"""``splitserve``: up (start a cluster), head / worker / router (one node of a cluster, as
Kubernetes pods run them), generate (stream an answer), status (pools and replicas), plan (the SLA planner)."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from cli.client_commands import EXIT_UNAVAILABLE, EXIT_USAGE, add_generate, add_status
from router.control.ray_node import RAY_START_TIMEOUT_S, HeadNodeConfig, WorkerNodeConfig, stop_on_signals

GCS_REDIS_PASSWORD_ENV = "REDIS_PASSWORD"
GCS_REDIS_USERNAME_ENV = "REDIS_USERNAME"
"""Where `splitserve head` finds the credentials of the Redis that Ray's GCS keeps its state in
(the address is RAY_REDIS_ADDRESS, which `ray start` reads itself): the variables KubeRay sets on
the head container from the RayCluster's gcsFaultToleranceOptions.redisPassword / redisUsername."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its options (each one's ``run`` in its defaults)."""
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_up(commands.add_parser("up", help="start a cluster (local Ray by default) and serve gRPC until Ctrl-C"))
    _add_head(commands.add_parser("head", help="start this host's Ray head, the controller and a router; pools follow the worker nodes"))
    _add_worker(commands.add_parser("worker", help="join a head as one replica slot of a pool; drain it on SIGTERM"))
    _add_router(commands.add_parser("router", help="join a head as a node of its own holding one router replica (off the head, as the chart runs routers)"))
    add_generate(commands.add_parser("generate", help="stream the answer to a prompt"))
    add_status(commands.add_parser("status", help="print the pools, replicas, their load and KV use"))
    from cli.plan import add_plan  # the planner sits above the router; this is the one entry point

    add_plan(commands.add_parser("plan", help="scale the prefill and decode pools to meet TTFT/ITL targets"))
    _add_node_cert(commands.add_parser("node-cert", help="issue this node's cluster TLS certificate from the cluster CA (a pod's init container)"))
    return parser


def _add_up(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--decode", type=int, default=1, help="decode replicas (default: %(default)s)")
    parser.add_argument(
        "--prefill", type=int, default=1, help="prefill replicas; 0 runs aggregated, decode replicas prefilling their own requests (default: %(default)s)"
    )
    _add_cluster_options(parser)
    parser.set_defaults(run=_run_up)


def _add_head(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ray-port", type=int, default=HeadNodeConfig.ray_port, help="port of Ray's GCS, which worker nodes join (default: %(default)s)")
    parser.add_argument("--node-ip-address", default=None, help="IP address this Ray node advertises, e.g. the pod's (default: the one Ray picks)")
    parser.add_argument(
        "--ray-start-args", default="",
        help="further `ray start` options as one string, e.g. \"--dashboard-port 8265 --metrics-export-port 8080\"",
    )
    _add_start_timeout(parser)
    _add_cluster_options(parser)
    parser.set_defaults(run=_run_head)


def _add_start_timeout(parser: argparse.ArgumentParser) -> None:
    """``--start-timeout-s``, which every role that starts a Ray node takes (head, worker, router)."""
    parser.add_argument(
        "--start-timeout-s", type=float, default=RAY_START_TIMEOUT_S,
        help="how long `ray start` may take to bring this node up, retries of a raylet that missed Ray's 30 s registration included (default: %(default)s)",
    )


def _add_joining_node_options(parser: argparse.ArgumentParser, connect_timeout_s: float) -> None:
    """The options of a node that joins the head's Ray cluster (`splitserve worker` and `splitserve router`)."""
    parser.add_argument("--address", required=True, help="the head's Ray GCS, HOST:PORT")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs this node offers Ray (default: what Ray detects)")
    parser.add_argument(
        "--connect-timeout-s", type=float, default=connect_timeout_s, help="how long to wait for the head to accept connections (default: %(default)s)"
    )
    parser.add_argument("--node-ip-address", default=None, help="IP address this Ray node advertises, e.g. the pod's (default: the one Ray picks)")
    parser.add_argument("--ray-start-args", default="", help="further `ray start` options as one string")
    _add_start_timeout(parser)


def _add_worker(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", required=True, help="the pool whose replica this node holds: prefill or decode")
    _add_joining_node_options(parser, WorkerNodeConfig.connect_timeout_s)
    parser.add_argument("--num-gpus", type=int, default=None, help="GPUs this node offers Ray (default: what Ray detects)")
    parser.add_argument(
        "--drain-timeout-s", type=float, default=WorkerNodeConfig.drain_timeout_s,
        help="on SIGTERM, how long the node's replica may take to finish its running requests (default: %(default)s)",
    )
    _add_cluster_tls_options(parser)
    parser.set_defaults(run=_run_worker)


def _add_router(parser: argparse.ArgumentParser) -> None:
    from cli.args import add_dataclass_args
    from router.config import RouterConfig
    from router.control.router_node import RouterNodeConfig

    _add_joining_node_options(parser, RouterNodeConfig.connect_timeout_s)
    parser.add_argument("--router-id", default="", help="the router's name in `splitserve status` (default: router-HOSTNAME)")
    parser.add_argument(
        "--controller-timeout-s", type=float, default=RouterNodeConfig.controller_timeout_s,
        help="how long to wait for the head's controller to exist (default: %(default)s)",
    )
    parser.add_argument(
        "--stop-grace-s", type=float, default=RouterNodeConfig.stop_grace_s, help="on SIGTERM, how long in-flight calls may take to finish (default: %(default)s)"
    )
    parser.add_argument(
        "--headless-stop-s", type=float, default=RouterNodeConfig.headless_stop_s,
        help="how long the node may take to stop when the head is gone, before it is killed (default: %(default)s)",
    )
    parser.add_argument("--tls-cert", type=Path, help="server certificate (enables TLS)")
    parser.add_argument("--tls-key", type=Path, help="server private key")
    parser.add_argument("--tls-client-ca", type=Path, help="CA of client certificates (enables mutual TLS)")
    _add_cluster_tls_options(parser)
    add_dataclass_args(parser, RouterConfig, skip=("tls", "cluster_tls"))
    parser.set_defaults(run=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from cli.args import dataclass_from_args
    from router.config import RouterConfig, TLSConfig
    from router.control.ray_node import RayNodeError, split_ray_start_args
    from router.control.router_node import RouterNodeConfig, run_router

    try:
        config = RouterNodeConfig(
            address=args.address, router_id=args.router_id, num_cpus=args.num_cpus, connect_timeout_s=args.connect_timeout_s,
            controller_timeout_s=args.controller_timeout_s, stop_grace_s=args.stop_grace_s, headless_stop_s=args.headless_stop_s,
            node_ip_address=args.node_ip_address, ray_start_args=split_ray_start_args(args.ray_start_args), start_timeout_s=args.start_timeout_s,
        )
        tls = TLSConfig(cert_file=args.tls_cert, key_file=args.tls_key, client_ca_file=args.tls_client_ca) if args.tls_cert or args.tls_key else None
        router_config = dataclass_from_args(RouterConfig, args, tls=tls, cluster_tls=_cluster_tls(args))
    except (ValueError, TypeError) as e:
        print(f"splitserve router: {e}", file=sys.stderr)
        return EXIT_USAGE
    _restart_with_ray_tls("router", router_config.cluster_tls)
    try:
        run_router(config, router_config)
    except RayNodeError as e:
        print(f"splitserve router: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0


def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """The options ``up`` and ``head`` share: what the replicas and the router run with."""
    from decode_worker.config import WorkerConfig
    from engine.config import EngineConfig
    from prefill_worker.config import PrefillWorkerConfig
    from cli.args import add_dataclass_args
    from router.config import RouterConfig
    from router.control.controller import ControllerConfig

    parser.add_argument(
        "--routers", type=int, default=1,
        help="router replicas, router-i on --port + i (and metrics/HTTP ports + i); all route alike from the same KV events (default: %(default)s)",
    )
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel ranks of each prefill replica (default: %(default)s)")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks of each decode replica (default: %(default)s)")
    parser.add_argument(
        "--prefill-pp", type=int, default=1,
        help="pipeline stages of each prefill replica: its layers split into runs, each stage's --prefill-tp ranks on one node, the stages on one or several (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-pp", type=int, default=1,
        help="pipeline stages of each decode replica: its layers split into runs, each stage's --decode-tp ranks on one node, the stages on one or several (default: %(default)s)",
    )
    parser.add_argument(
        "--decode-ep", type=int, default=1,
        help="expert-parallel ranks of each decode replica of a mixture-of-experts model: experts split, attention data-parallel (default: %(default)s)",
    )
    parser.add_argument("--tls-cert", type=Path, help="server certificate (enables TLS)")
    parser.add_argument("--tls-key", type=Path, help="server private key")
    parser.add_argument("--tls-client-ca", type=Path, help="CA of client certificates (enables mutual TLS)")
    _add_cluster_tls_options(parser)
    add_dataclass_args(parser, EngineConfig, skip=("tp_size", "ep_size", "pp_size"))
    add_dataclass_args(parser, RouterConfig, skip=("tls", "cluster_tls"))
    add_dataclass_args(parser, WorkerConfig, prefix="worker", skip=("cluster_tls",))
    add_dataclass_args(parser, PrefillWorkerConfig, prefix="prefill")
    add_dataclass_args(parser, ControllerConfig, prefix="controller", skip=("follow_nodes",))


def _add_node_cert(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ca-cert", type=Path, required=True, help="the cluster CA's certificate (PEM)")
    parser.add_argument("--ca-key", type=Path, required=True, help="the cluster CA's private key (PEM, unencrypted)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write tls.crt, tls.key and ca.crt into")
    parser.add_argument("--ip", action="append", default=[], help="an IP address the certificate covers, e.g. the pod's (repeatable)")
    parser.add_argument("--dns", action="append", default=[], help="a DNS name the certificate covers, e.g. the head's Service (repeatable)")
    parser.add_argument("--days", type=int, default=365, help="validity in days (default: %(default)s)")
    parser.set_defaults(run=_run_node_cert)


def _run_node_cert(args: argparse.Namespace) -> int:
    from proto.node_cert import issue_node_cert

    try:
        path = issue_node_cert(args.ca_cert, args.ca_key, args.out, args.ip, args.dns, args.days)
    except ValueError as e:
        print(f"splitserve node-cert: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"splitserve: wrote {path} for {', '.join(args.ip + args.dns)}", flush=True)
    return 0


def _add_cluster_tls_options(parser: argparse.ArgumentParser) -> None:
    """Mutual TLS inside the cluster: every node of it (``up``, ``head``, ``worker``) takes the same three."""
    parser.add_argument(
        "--cluster-tls-cert", type=Path,
        help="this node's certificate (serverAuth and clientAuth) signed by --cluster-tls-ca: enables mutual TLS between routers and workers and on Ray's own gRPC",
    )
    parser.add_argument("--cluster-tls-key", type=Path, help="private key of --cluster-tls-cert")
    parser.add_argument("--cluster-tls-ca", type=Path, help="the cluster CA: peers whose certificate it did not sign are refused")


def _cluster_tls(args: argparse.Namespace):
    """The ClusterTLSConfig of ``--cluster-tls-*``, None without them; ValueError for an incomplete set."""
    from proto.tls import ClusterTLSConfig

    files = (args.cluster_tls_cert, args.cluster_tls_key, args.cluster_tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise ValueError("cluster_tls: --cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca go together")
    return ClusterTLSConfig(*files)


def _cluster_config(args: argparse.Namespace, **fields):
    """The ClusterConfig of ``_add_cluster_options``' options and ``fields`` (pool sizes, Ray
    address, whether the controller follows the nodes); ValueError or TypeError for a bad value."""
    from decode_worker.config import WorkerConfig
    from engine.config import EngineConfig
    from prefill_worker.config import PrefillWorkerConfig
    from cli.args import dataclass_from_args
    from router.config import RouterConfig, TLSConfig
    from router.control.controller import ControllerConfig
    from router.control.launch import ClusterConfig

    tls = None
    if args.tls_cert or args.tls_key:
        tls = TLSConfig(cert_file=args.tls_cert, key_file=args.tls_key, client_ca_file=args.tls_client_ca)
    cluster_tls = _cluster_tls(args)
    follow_nodes = fields.pop("follow_nodes", False)
    engine = dataclass_from_args(EngineConfig, args)
    return ClusterConfig(
        engine=engine,
        worker=dataclass_from_args(WorkerConfig, args, prefix="worker", cluster_tls=cluster_tls),
        prefill=dataclass_from_args(PrefillWorkerConfig, args, prefix="prefill"),
        router=dataclass_from_args(RouterConfig, args, tls=tls, cluster_tls=cluster_tls),
        controller=dataclass_from_args(ControllerConfig, args, prefix="controller", follow_nodes=follow_nodes),
        prefill_tp_size=args.prefill_tp,
        decode_tp_size=args.decode_tp,
        decode_ep_size=args.decode_ep,
        prefill_pp_size=args.prefill_pp,
        decode_pp_size=args.decode_pp,
        num_layers=_checked_num_layers(engine, {"--prefill-pp": args.prefill_pp, "--decode-pp": args.decode_pp}),
        num_routers=args.routers,
        **fields,
    )


def _checked_num_layers(engine, pp_sizes: dict[str, int]) -> int:
    """The model's decoder layers when a pool is pipelined (named if its replicas cannot be placed),
    after refusing a PP size above them with the engine's sentence; 0 when no pool is pipelined or
    the model is not readable here (a head whose workers hold the checkpoint: the leaders check)."""
    if all(size == 1 for size in pp_sizes.values()):
        return 0
    from engine.bundled import resolve_model, served_model_name
    from engine.errors import EngineError, UnsupportedModelError
    from engine.model_config import ModelConfig
    from engine.parallel.pipeline import check_pp_size

    try:
        config = ModelConfig.from_dir(resolve_model(engine.model, engine.cache_dir))
    except EngineError:  # not here, or not a model the engine runs: each replica's leader says why
        return 0
    for flag, size in pp_sizes.items():
        try:
            check_pp_size(served_model_name(engine.model), config, size)
        except UnsupportedModelError as e:
            raise ValueError(f"{flag}: {e}") from None
    return config.num_layers


def _restart_with_ray_tls(command: str, cluster_tls) -> None:
    """Ray takes its TLS settings from the environment when it is imported, which it already is:
    start again with them (same pid), so this process and every Ray process it starts use TLS."""
    import os

    from proto.tls import ray_tls_env

    ray_env = ray_tls_env(cluster_tls) if cluster_tls else {}
    if sys.argv[1:2] == [command] and any(os.environ.get(k) != v for k, v in ray_env.items()):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "cli.main", *sys.argv[1:]], {**os.environ, **ray_env})


def _run_up(args: argparse.Namespace) -> int:
    try:
        config = _cluster_config(args, num_decode=args.decode, num_prefill=args.prefill, ray_address=args.address)
    except (ValueError, TypeError) as e:
        print(f"splitserve up: {e}", file=sys.stderr)
        return EXIT_USAGE
    _restart_with_ray_tls("up", config.router.cluster_tls)
    stop = stop_on_signals(threading.Event())
    mode = f"{config.num_prefill} prefill + {config.num_decode} decode replica(s)" if config.num_prefill else f"{config.num_decode} decode replica(s), aggregated"
    print(f"splitserve: starting {mode} of {config.engine.model} ...", flush=True)
    return _serve("up", config, stop)


def _run_head(args: argparse.Namespace) -> int:
    import os
    from dataclasses import replace

    from router.control.ray_node import RayNode, RayNodeError, check_port_free, split_ray_start_args

    try:
        head = HeadNodeConfig(
            ray_port=args.ray_port, node_ip_address=args.node_ip_address, ray_start_args=split_ray_start_args(args.ray_start_args),
            start_timeout_s=args.start_timeout_s,
            redis_password=os.environ.get(GCS_REDIS_PASSWORD_ENV) or None, redis_username=os.environ.get(GCS_REDIS_USERNAME_ENV) or None,
        )
        config = _cluster_config(args, num_decode=0, num_prefill=0, follow_nodes=True)
    except (ValueError, TypeError) as e:
        print(f"splitserve head: {e}", file=sys.stderr)
        return EXIT_USAGE
    _restart_with_ray_tls("head", config.router.cluster_tls)
    try:
        check_port_free(head.ray_port)
    except RayNodeError as e:
        print(f"splitserve head: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    import ray

    stop = stop_on_signals(threading.Event())
    node_ip = head.node_ip_address or ray.util.get_node_ip_address()
    node = RayNode(head.command(node_ip), on_exit=stop.set)
    try:
        node.start(head.start_timeout_s)
    except RayNodeError as e:
        print(f"splitserve head: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    try:
        config = replace(config, ray_address=f"{node_ip}:{head.ray_port}")
        routers = f"router-0 to router-{config.num_routers - 1}" if config.num_routers > 1 else "router-0" if config.num_routers else "no router (they run as `splitserve router` nodes)"
        print(f"splitserve: Ray head on {config.ray_address}; starting the controller and {routers} for {config.engine.model}; "
              "each worker node that joins gets a replica of its pool", flush=True)
        code = _serve("head", config, stop, ray_alive=lambda: node.returncode is None)
        ended_by_itself = node.returncode
    finally:
        node.stop()
    if ended_by_itself is not None:
        print(f"splitserve head: its Ray node stopped on its own (ray start exit code {ended_by_itself})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return code


def _serve(command: str, config, stop: threading.Event, ray_alive=lambda: True) -> int:
    """Start the cluster of ``config``, serve until ``stop`` is set, then stop it (unless
    ``ray_alive()`` says Ray itself is gone: calls to its actors would wait forever)."""
    from ray.exceptions import RayTaskError

    from router.errors import cause_line
    from router.control.launch import Cluster

    cluster = Cluster(config)
    try:
        try:
            status = cluster.start()
        except RayTaskError as e:  # a replica could not start: say why in one sentence
            print(f"splitserve {command}: {cause_line(e)}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        stop_on_signals(stop)  # again: ray.init put its own SIGTERM handler in place of ours
        for router in cluster.router_statuses:
            http = f", OpenAI/KServe HTTP on {router.http_url}" if router.http_url else ""
            print(f"splitserve: {router.router_id} serving gRPC on {router.grpc_address}{http} (metrics {router.metrics_url})", flush=True)
        if status is not None:
            tls_flag = " --tls-ca CA.pem" if config.router.tls else ""
            print(f"try: splitserve generate --addr {status.grpc_address}{tls_flag} \"What is the capital of France?\"", flush=True)
        else:
            print(f"splitserve: controller up; routers join with `splitserve router --address {config.ray_address}`", flush=True)
        stop.wait()
        print("splitserve: shutting down", flush=True)
    finally:
        if ray_alive():
            cluster.stop()
        import ray

        ray.shutdown()
    print("splitserve: stopped", flush=True)
    return 0


def _run_worker(args: argparse.Namespace) -> int:
    from router.control.ray_node import RayNodeError, run_worker, split_ray_start_args

    try:
        config = WorkerNodeConfig(
            pool=args.pool, address=args.address, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
            drain_timeout_s=args.drain_timeout_s, connect_timeout_s=args.connect_timeout_s,
            node_ip_address=args.node_ip_address, ray_start_args=split_ray_start_args(args.ray_start_args),
            start_timeout_s=args.start_timeout_s,
        )
        cluster_tls = _cluster_tls(args)
    except ValueError as e:
        print(f"splitserve worker: {e}", file=sys.stderr)
        return EXIT_USAGE
    _restart_with_ray_tls("worker", cluster_tls)  # this node's raylet and its replica's processes too
    try:
        run_worker(config)
    except RayNodeError as e:
        print(f"splitserve worker: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
