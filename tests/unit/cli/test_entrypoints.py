"""`splitserve head` / `worker` without a cluster: the slots a pool follows, the `ray start` command
lines, the options and their refusals, the controller's follow-nodes refusals, and the image."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import socket
from pathlib import Path

import pytest

from cli import main as cli
from router.control.controller import ClusterController, ControllerConfig
from router.control.node_slots import alive_node_ids, node_slots, slots_to_fill
from router.control.ray_node import HeadNodeConfig, WorkerNodeConfig, parse_address, split_ray_start_args
from tests.redis_server import free_port

REPO = Path(__file__).resolve().parents[3]
DOCKER = REPO / "deploy" / "docker"


def _node(node_id: str, alive: bool = True, **resources: float) -> dict:
    """One entry of ``ray.nodes()`` (the fields the controller reads, and some it does not)."""
    return {"NodeID": node_id, "Alive": alive, "NodeName": "10.0.0.7", "Resources": {"CPU": 8.0, "memory": 1e9, **resources}}


NODES = [
    _node("head", **{"node:__internal_head__": 1.0}),
    _node("decode-a", splitserve_decode=1.0),
    _node("decode-b", splitserve_decode=2.0),
    _node("prefill-a", splitserve_prefill=1.0),
    _node("decode-dead", alive=False, splitserve_decode=1.0),
    _node("decode-half", splitserve_decode=0.5),
]


def test_each_alive_node_offers_its_whole_slots_of_a_pool():
    assert node_slots(NODES, "splitserve_decode") == {"decode-a": 1, "decode-b": 2}
    assert node_slots(NODES, "splitserve_prefill") == {"prefill-a": 1}
    assert alive_node_ids(NODES) == {"head", "decode-a", "decode-b", "prefill-a", "decode-half"}


def test_a_draining_node_offers_no_slot():
    assert node_slots(NODES, "splitserve_decode", exclude={"decode-b"}) == {"decode-a": 1}
    assert node_slots(NODES, "splitserve_prefill", exclude={"prefill-a"}) == {}


@pytest.mark.parametrize("used, to_start", [
    ({}, ["decode-a", "decode-b", "decode-b"]),
    ({"decode-b": 1}, ["decode-a", "decode-b"]),
    ({"decode-a": 1, "decode-b": 2}, []),
    ({"decode-a": 3}, ["decode-b", "decode-b"]),  # a node holding more than its slots takes nothing more
])
def test_a_replica_starts_in_every_slot_that_holds_none(used, to_start):
    assert slots_to_fill({"decode-a": 1, "decode-b": 2}, used) == to_start


def test_the_head_runs_ray_start_with_the_head_resource_and_no_pool_resource():
    head = HeadNodeConfig(ray_port=6380, ray_start_args=split_ray_start_args("--metrics-export-port 8080 --dashboard-host '0.0.0.0'"))
    command = head.command("10.1.2.3")
    assert command[command.index("start"):] == [
        "start", "--head", "--block", "--port", "6380", "--node-ip-address", "10.1.2.3", "--resources", '{"splitserve_head": 1}',
        "--metrics-export-port", "8080", "--dashboard-host", "0.0.0.0",
    ]


def test_a_worker_runs_ray_start_with_one_slot_of_its_pool():
    worker = WorkerNodeConfig(pool="decode", address="head-svc:6379", num_cpus=4, num_gpus=1)
    command = worker.command("10.1.2.4", "splitserve-decode-pod-1")
    assert command[command.index("start"):] == [
        "start", "--block", "--address", "head-svc:6379", "--node-ip-address", "10.1.2.4", "--node-name", "splitserve-decode-pod-1",
        "--resources", '{"splitserve_decode": 1}', "--num-cpus", "4", "--num-gpus", "1",
    ]
    assert json.loads(command[command.index("--resources") + 1]) == {"splitserve_decode": 1}
    prefill = WorkerNodeConfig(pool="prefill", address="10.0.0.1:6379").command("10.1.2.5", "n")
    assert "--num-cpus" not in prefill and "--num-gpus" not in prefill  # Ray counts them itself


@pytest.mark.parametrize("fields, message", [
    (dict(pool="gpu"), "pool: 'gpu' is not one of prefill, decode"),
    (dict(address="head"), "address: 'head' is not HOST:PORT"),
    (dict(address=":6379"), "address: ':6379' is not HOST:PORT"),
    (dict(address="head:0"), "address: 'head:0' is not HOST:PORT"),
    (dict(address="head:port"), "address: 'head:port' is not HOST:PORT"),
    (dict(num_cpus=-1), "num_cpus: must be >= 0, got -1"),
    (dict(drain_timeout_s=-1.0), "drain_timeout_s: must be >= 0, got -1.0"),
    (dict(ray_start_args=("--resources", '{"x": 1}')), "ray_start_args: --resources is set by splitserve itself; use its own option"),
    (dict(ray_start_args=("--num-cpus=4",)), "ray_start_args: --num-cpus is set by splitserve itself; use its own option"),
])
def test_a_worker_config_that_cannot_work_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError) as refused:
        WorkerNodeConfig(**{"pool": "decode", "address": "head:6379", **fields})
    assert str(refused.value) == message


def test_a_head_config_refuses_a_port_that_is_not_one():
    for port in (0, 65536):
        with pytest.raises(ValueError, match=f"ray_port: {port} is not a port"):
            HeadNodeConfig(ray_port=port)
    with pytest.raises(ValueError, match="--head is set by splitserve itself"):
        HeadNodeConfig(ray_start_args=("--head",))


def test_an_address_parses_to_host_and_port():
    assert parse_address("raycluster-head-svc.default.svc:6379") == ("raycluster-head-svc.default.svc", 6379)
    assert parse_address("10.0.0.1:6380") == ("10.0.0.1", 6380)


def _options(command: str) -> set[str]:
    parser = cli.build_parser()
    [subparsers] = [a for a in parser._actions if a.dest == "command"]
    return {flag for action in subparsers.choices[command]._actions for flag in action.option_strings}


def test_head_takes_every_option_of_up_but_the_pool_sizes_and_the_address():
    up, head = _options("up"), _options("head")
    assert up - head == {"--decode", "--prefill", "--address"}
    assert head - up == {"--ray-port", "--node-ip-address", "--ray-start-args", "--start-timeout-s"}
    assert "--controller-follow-nodes" not in up | head  # up never follows nodes; head always does


def test_worker_takes_the_options_the_chart_passes():
    assert {"--pool", "--address", "--num-cpus", "--num-gpus", "--drain-timeout-s"} <= _options("worker")


def test_a_bad_pool_name_exits_with_one_sentence(capsys):
    assert cli.main(["worker", "--pool", "gpu", "--address", "head:6379"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == "splitserve worker: pool: 'gpu' is not one of prefill, decode\n"


def test_an_unreachable_head_exits_with_one_sentence(capsys):
    port = free_port()
    code = cli.main(["worker", "--pool", "decode", "--address", f"127.0.0.1:{port}", "--connect-timeout-s", "0.3"])
    assert code == cli.EXIT_UNAVAILABLE
    assert capsys.readouterr().err == f"splitserve worker: the Ray head at 127.0.0.1:{port} is not reachable (connection refused) after 0.3 s\n"


@pytest.mark.parametrize("role", [["head"], ["worker", "--pool", "decode", "--address", "127.0.0.1:1"], ["router", "--address", "127.0.0.1:1"]])
def test_each_node_takes_its_ray_start_budget_and_refuses_none(role, capsys):
    assert "--start-timeout-s" in _options(role[0])
    assert cli.main([*role, "--start-timeout-s", "0"]) == cli.EXIT_USAGE  # refused before it reaches for a head or starts Ray
    assert capsys.readouterr().err == f"splitserve {role[0]}: start_timeout_s: must be > 0, got 0.0\n"


def test_head_refuses_a_bad_option_before_starting_ray(capsys):
    assert cli.main(["head", "--kv-dtype", "int3"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err.startswith("splitserve head: kv_dtype: 'int3' is not one of")
    assert cli.main(["head", "--ray-start-args", "--port 1234"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == "splitserve head: ray_start_args: --port is set by splitserve itself; use its own option\n"


def test_a_ray_port_in_use_is_named_before_ray_starts(capsys):
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        assert cli.main(["head", "--ray-port", str(port)]) == cli.EXIT_UNAVAILABLE
    assert capsys.readouterr().err == f"splitserve head: ray_port: {port} is in use on this host (address already in use)\n"


def test_a_cluster_that_follows_the_nodes_takes_no_pool_sizes():
    from router.control.launch import ClusterConfig

    follow = ControllerConfig(follow_nodes=True)
    assert ClusterConfig(controller=follow, num_decode=0, num_prefill=0).controller.follow_nodes
    with pytest.raises(ValueError, match="num_decode, num_prefill: must be 0 when controller.follow_nodes sizes the pools, got 1, 0"):
        ClusterConfig(controller=follow, num_decode=1)
    with pytest.raises(ValueError, match="num_decode: must be >= 1, got 0"):
        ClusterConfig(num_decode=0)


def test_a_controller_refuses_the_other_way_of_sizing_its_pools():
    following = ClusterController(ControllerConfig(follow_nodes=True))
    with pytest.raises(ValueError, match="pool 'decode' follows the Ray nodes"):
        asyncio.run(following.scale_pool("decode", 2))
    with pytest.raises(ValueError, match="follow_nodes: off in this controller's config"):
        asyncio.run(ClusterController(ControllerConfig()).follow_nodes([]))
    assert asyncio.run(following.drain_node("no-such-node", timeout_s=1.0)) == []  # nothing there: done at once


def test_a_follow_round_fills_each_free_slot_on_its_node_and_forgets_replicas_of_gone_nodes(monkeypatch):
    """The controller's rounds over ray.nodes(), its starts recorded instead of run (a start needs
    a worker actor: tests/integration/test_entrypoints.py starts them for real)."""
    import ray

    from proto import splitserve_pb2 as pb
    from router.control.cluster_map import MapReplica
    from router.control.controller import ReplicaSpec

    controller = ClusterController(ControllerConfig(follow_nodes=True))
    started, removed = [], []

    def join(replica_id: str, pool: str, node_id: str) -> None:
        status = pb.ReplicaStatus(replica_id=replica_id, pool=pool, healthy=True)
        controller._state.replicas[replica_id] = MapReplica(None, pb.ModelInfo(), status, 0.0, node_id=node_id)

    async def record_start(spec, node_id=None):
        started.append((spec.pool, node_id))
        join(f"{spec.pool}-{len(started)}", spec.pool, node_id)
        return controller._state.replicas[f"{spec.pool}-{len(started)}"].status

    async def record_remove(replica_id):
        removed.append(replica_id)
        return controller._state.replicas.pop(replica_id, None) is not None

    monkeypatch.setattr(controller, "_start", record_start)
    monkeypatch.setattr(controller, "_remove", record_remove)
    monkeypatch.setattr(ray, "nodes", lambda: NODES)
    join("decode-0", "decode", "decode-a")
    join("decode-9", "decode", "decode-gone")

    async def rounds():
        assert await controller.drain_node("decode-b", timeout_s=1.0) == []  # its pod is stopping before anything ran there
        await controller.follow_nodes([ReplicaSpec("decode", "m:Decode", ()), ReplicaSpec("prefill", "m:Prefill", ())])
        await asyncio.sleep(0)  # the starts it spawned run
        first = (list(started), list(removed), {p: controller._state.pools[p].target for p in ("prefill", "decode")})
        await controller._follow_nodes_once()
        await asyncio.sleep(0)
        await controller.shutdown()
        return first

    first = asyncio.run(rounds())
    assert first == (
        [("prefill", "prefill-a")],  # decode-a's slot holds decode-0; decode-b's two slots are draining
        ["decode-9"],  # its node is not among the alive ones
        {"prefill": 1, "decode": 1},
    )
    assert started == [("prefill", "prefill-a")]  # the next round finds every slot filled


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_the_image_runs_the_cli_and_its_default_command_is_one_the_cli_has():
    instructions = _dockerfile_instructions()
    [entrypoint] = [json.loads(args) for kind, args in instructions if kind == "ENTRYPOINT"]
    [command] = [json.loads(args) for kind, args in instructions if kind == "CMD"]
    assert entrypoint == ["splitserve"]
    assert 'splitserve = "cli.main:main"' in (REPO / "pyproject.toml").read_text()
    args = cli.build_parser().parse_args(command)  # exits (fails the test) on an unknown subcommand or option
    assert args.command == command[0] == "up"


def test_the_image_installs_pinned_torch_first_then_the_package_under_the_constraints():
    instructions = _dockerfile_instructions()
    runs = [args for kind, args in instructions if kind == "RUN"]
    [torch_pin] = [line for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("torch==")]
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in [f"{k} {a}" for k, a in instructions]
    torch_run = next(i for i, run in enumerate(runs) if '"torch==${TORCH_VERSION}"' in run)
    package_run = next(i for i, run in enumerate(runs) if re.search(r"pip install -c constraints\.txt \.(\s|$)", run))
    assert torch_run < package_run
    assert all("-c constraints.txt" in part for part in runs[package_run].split("&&") if "pip install" in part and "--no-deps" not in part)
    assert [args for kind, args in instructions if kind == "FROM"][-1] == "base-${VARIANT}"


def test_the_image_builds_every_extension_and_checks_it_imports():
    """Each extension setup.py lists must import from the installed package, or the image would
    silently run the Python fallbacks (the routers' key chain, the engine's CPU kernels)."""
    extensions = re.findall(r'Extension\(\s*"([\w.]+)"', (REPO / "setup.py").read_text())
    assert "kv_store._chain" in extensions
    instructions = _dockerfile_instructions()
    copies = [args.split()[:-1] for kind, args in instructions if kind == "COPY"]
    assert any("setup.py" in sources for sources in copies)
    assert all([name.split(".")[0] + "/"] in copies for name in extensions)
    [package_run] = [args for kind, args in instructions if kind == "RUN" and re.search(r"pip install -c constraints\.txt \.(\s|$)", args)]
    steps = [step.strip() for step in package_run.split("&&")]
    install = next(i for i, step in enumerate(steps) if "apt-get install" in step)
    build = next(i for i, step in enumerate(steps) if re.match(r"pip install -c constraints\.txt \.$", step))
    [check] = [i for i, step in enumerate(steps) if 'python -c "import torch' in step]
    assert steps[check - 1] == "(cd /"  # the installed package, not the source tree
    assert install < build < check  # a build that silently fell back to Python fails the image
    imported = re.search(r'python -c "import ([\w., ]+)"', steps[check]).group(1).replace(" ", "").split(",")
    assert imported[0] == "torch" and sorted(imported[1:]) == sorted(extensions)  # torch first: its libgomp serves the kernels' OpenMP
    assert all(dep in package_run for dep in ("gcc", "libxxhash-dev"))


def test_every_docker_run_in_the_image_readme_names_a_subcommand_the_cli_has():
    text = re.sub(r"\\\n\s*", " ", (DOCKER / "README.md").read_text())
    runs = [line.split("splitserve:cpu", 1)[1] for line in text.splitlines() if line.strip().startswith("docker run") and "splitserve:cpu" in line]
    assert len(runs) == 4
    for args in runs:
        words = shlex.split(args)
        if words:
            assert cli.build_parser().parse_args(words).command in ("head", "worker")


def test_every_subcommand_prints_its_help_whatever_its_options_docs_say(capsys):
    """argparse %-formats each option's help: a field doc such as "about 1% more" must be escaped
    by cli_args, or ``--help`` dies with a traceback."""
    parser = cli.build_parser()
    [subparsers] = [a for a in parser._actions if a.dest == "command"]
    for command, subparser in subparsers.choices.items():
        assert subparser.format_help(), command
    assert "about 1% more perplexity" in " ".join(subparsers.choices["up"].format_help().split())
