"""``splitserve plan``: run the SLA planner beside a running cluster.

It reads the cluster through the router's admin API and the routers' metrics, decides every
``--interval-s``, and acts through a connector: ``ray`` (the local or joined Ray cluster's
controller) or ``kubernetes`` (the KubeRay RayCluster's worker groups). ``--dry-run`` only logs
the decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

EXIT_USAGE = 2


def add_plan(parser: argparse.ArgumentParser) -> None:
    from cli.args import add_dataclass_args
    from planner.config import PlannerConfig
    from planner.perf_model import DEFAULT_PERF_MODEL

    parser.add_argument("--addr", default="localhost:50051", help="router address HOST:PORT (default: %(default)s)")
    parser.add_argument("--tls-ca", type=Path, help="CA certificate to verify the router with (when the router serves TLS)")
    parser.add_argument("--token-file", type=Path, help="file holding the bearer token (when the router requires one)")
    parser.add_argument("--connector", choices=("ray", "kubernetes"), default="ray", help="how replicas are started and stopped (default: %(default)s)")
    parser.add_argument("--ray-address", default="auto", help="Ray cluster to join for the ray connector (default: %(default)s)")
    parser.add_argument("--kube-namespace", default="default", help="namespace of the RayCluster (kubernetes connector)")
    parser.add_argument("--raycluster", default="splitserve", help="name of the RayCluster (kubernetes connector)")
    parser.add_argument("--profile", type=Path, help="perf model profiled on this cluster (python -m planner.profile); default: --perf-model-csv")
    parser.add_argument("--perf-model-csv", type=Path, default=DEFAULT_PERF_MODEL, help="Splitwise-format perf model CSV (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, default=0, help="port of the planner's Prometheus endpoint; 0 picks one")
    parser.add_argument("--dry-run", action="store_true", help="log every decision, change nothing")
    add_dataclass_args(parser, PlannerConfig)
    parser.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    import sys

    from prometheus_client import start_http_server

    from planner.config import PlannerConfig
    from planner.connectors import connector_class
    from planner.live import ClusterSource, PlannerLoop, PlannerMetrics
    from planner.perf_model import load_profile, load_splitwise_csv
    from planner.policy import SLAPlanner
    from cli.args import dataclass_from_args
    from router.client import SplitServeClient

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        config = dataclass_from_args(PlannerConfig, args)
        perf_model = load_profile(args.profile) if args.profile else load_splitwise_csv(args.perf_model_csv)
        token = args.token_file.read_text().strip() if args.token_file else None
        client = SplitServeClient(args.addr, tls_ca_file=args.tls_ca, token=token)
    except (ValueError, OSError) as e:
        print(f"splitserve plan: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.connector == "ray":
        import ray

        ray.init(address=args.ray_address, log_to_driver=False)
        connector = connector_class("ray")()
    else:
        connector = connector_class("kubernetes")(args.kube_namespace, args.raycluster)
    metrics = PlannerMetrics()
    server, _ = start_http_server(args.metrics_port, registry=metrics.registry)
    print(f"splitserve plan: deciding every {config.interval_s:g} s{' (dry run)' if args.dry_run else ''}; metrics on port {server.server_port}", flush=True)
    with client:
        loop = PlannerLoop(SLAPlanner(config, perf_model), connector, ClusterSource(client.cluster_status, (config.ttft_slo_s, config.itl_slo_s)), dry_run=args.dry_run, metrics=metrics)

        async def main() -> None:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            await loop.run(config.interval_s, stop)

        asyncio.run(main())
    return 0
