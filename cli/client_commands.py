"""The commands that call a router as a client: ``generate`` (stream an answer) and ``status``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc

from proto import splitserve_pb2 as pb

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_REJECTED = 4


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


def add_generate(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("-n", type=int, default=None, help="samples of the prompt, printed one after another")
    parser.add_argument("--presence-penalty", type=float, default=None)
    parser.add_argument("--frequency-penalty", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", help="constrain the answer to this JSON Schema (JSON text, or @FILE)")
    constraint.add_argument("--json-object", action="store_true", help="constrain the answer to a JSON object")
    constraint.add_argument("--regex", help="constrain the answer to match this regular expression")
    constraint.add_argument("--choice", action="append", help="constrain the answer to one of these strings (repeatable)")
    constraint.add_argument("--grammar", help="constrain the answer to this Lark grammar (text, or @FILE)")
    parser.set_defaults(run=_run_generate)


def _constraint(args: argparse.Namespace) -> pb.Constraint | None:
    """The constraint the options ask for; ``@FILE`` reads a schema or grammar from a file."""

    def text(value: str) -> str:
        return Path(value[1:]).read_text() if value.startswith("@") else value

    if args.json_schema is not None:
        return pb.Constraint(json_schema=text(args.json_schema))
    if args.json_object:
        return pb.Constraint(json_object=True)
    if args.regex is not None:
        return pb.Constraint(regex=args.regex)
    if args.choice:
        return pb.Constraint(choice=pb.Choice(choices=args.choice))
    if args.grammar is not None:
        return pb.Constraint(grammar=pb.Grammar(source=text(args.grammar)))
    return None


def _run_generate(args: argparse.Namespace) -> int:
    with _client(args) as client:
        kwargs = dict(prompt=args.prompt) if args.raw else dict(messages=[{"role": "user", "content": args.prompt}])
        samples: dict[int, list[str]] = {}
        try:
            for response in client.generate(
                **kwargs, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=args.stop, model=args.model, timeout_s=args.timeout,
                n=args.n, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                repetition_penalty=args.repetition_penalty, constraint=_constraint(args),
            ):
                if (args.n or 1) > 1:
                    samples.setdefault(response.index, []).append(response.text)
                    continue
                sys.stdout.write(response.text)
                sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\nsplitserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return EXIT_UNAVAILABLE if e.code() == grpc.StatusCode.UNAVAILABLE else EXIT_REJECTED
    for index in sorted(samples):
        sys.stdout.write(f"[{index}] {''.join(samples[index])}\n")
    sys.stdout.write("" if samples else "\n")
    return 0


def add_status(parser: argparse.ArgumentParser) -> None:
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
        if r.pp_size > 1:
            for line in stage_lines(r):
                print(f"{'':8} {'':12} {line}")
        elif r.tp_size > 1:
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
        http = f", HTTP {router.http_url}" if router.http_url else ""
        print(f"router {router.router_id} at {router.grpc_address}: {router.num_inflight} in flight, metrics {router.metrics_url}{http}")
    print(controller_line(status.controller))
    return 0


def stage_lines(replica: pb.ReplicaStatus) -> list[str]:
    """``status``'s lines about a pipelined replica: its shape, then each stage's layers [start-end),
    node, busy seconds and ranks (with their KV heads when the stage is tensor-parallel)."""
    lines = [f"pp {replica.pp_size} x tp {replica.tp_size}"]
    for stage in range(replica.pp_size):
        ranks = [t for t in replica.tp_ranks if t.stage == stage]
        if not ranks:
            lines.append(f"  stage {stage}: no rank reported")
            continue
        heads = replica.tp_size > 1
        listed = ", ".join(
            f"{t.rank}: pid {t.pid} {'alive' if t.alive else 'DEAD'}" + (f" heads {t.kv_head_start}-{t.kv_head_end}" if heads else "") for t in ranks
        )
        first = ranks[0]
        lines.append(
            f"  stage {stage}: layers {first.layer_start}-{first.layer_end} on {first.node_ip or 'one node'}, "
            f"busy {max(t.busy_s for t in ranks):.1f} s (ranks {listed})"
        )
    return lines


def controller_line(controller: pb.ControllerStatus) -> str:
    """``status``'s line about the controller itself: its generation and restarts."""
    if not controller.num_restarts:
        restarts = "never restarted"
    else:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(controller.last_restart_unix_s))
        restarts = f"{controller.num_restarts} restart{'s' if controller.num_restarts != 1 else ''}, the last at {when}"
    return f"controller: generation {controller.generation}, {restarts}; {controller.num_router_restarts} routers started again"
