"""Router pieces that need no Ray: replica choice, request checks, generated CLI options."""

import argparse

import grpc
import pytest

from cli.args import add_dataclass_args, dataclass_from_args, field_docs
from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from proto import splitserve_pb2 as pb
from proto import worker_pb2 as wpb
from router.config import RouterConfig
from router.errors import CallRejected, from_worker
from router.frontend.validation import check_generate
from router.routing.workers import WorkerDirectory


def _entry(replica_id, *, pool="decode", model="m", healthy=True, running=0, waiting=0, free=100):
    status = pb.ReplicaStatus(
        replica_id=replica_id, pool=pool, model=model, healthy=healthy, num_running=running,
        num_waiting=waiting, num_kv_blocks=100, num_free_kv_blocks=free,
    )
    return status, pb.ModelInfo(id=model), object()


def test_a_replica_with_another_key_namespace_is_refused():
    from kv_store.keys import KeyNamespace

    d = WorkerDirectory()
    d.update([_entry("a"), _entry("b"), _entry("c", pool="prefill")])
    namespace = KeyNamespace("m", "abc", "fp8_e4m3", 16)
    d.replicas["a"].namespace = namespace
    d.replicas["b"].namespace = KeyNamespace("m", "abc", "fp32", 16)
    d.replicas["c"].namespace = KeyNamespace("m", "abc", "fp8_e4m3", 16, tp_size=2, tp_rank=1)  # a TP shard: fine
    [message] = d.refuse_mismatched_namespaces()
    assert message == "replica b refused: KV key namespace differs (kv_dtype: 'fp8_e4m3' on a vs 'fp32')"
    assert [r.replica_id for r in d.healthy("decode", "m")] == ["a"]
    assert [r.replica_id for r in d.healthy("prefill", "m")] == ["c"]


def test_pick_prefers_the_least_loaded_healthy_replica_of_the_model():
    d = WorkerDirectory()
    d.update([
        _entry("a", running=3),
        _entry("b", running=1),
        _entry("c", running=0, healthy=False),
        _entry("d", running=0, model="other"),
        _entry("e", running=0, pool="prefill"),
    ])
    assert d.pick("decode", "m").replica_id == "b"
    assert d.pick("decode", "").replica_id == "d"
    assert d.pick("decode", "missing") is None
    assert d.served_models() == ["m", "other"]


def test_a_draining_replica_gets_no_new_request_but_stays_known():
    d = WorkerDirectory()
    idle_but_draining, busy = _entry("a", running=0), _entry("b", running=5)
    idle_but_draining[0].draining = True
    d.update([idle_but_draining, busy])
    assert d.pick("decode", "m").replica_id == "b"  # the idlest replica is draining: not picked
    assert set(d.replicas) == {"a", "b"}  # still in the view: its running streams keep their channel
    assert d.served_models() == ["m"]


def test_a_refresh_without_a_handle_keeps_the_one_held_and_skips_a_replica_never_seen():
    d = WorkerDirectory()
    d.update([_entry("a"), _entry("b")])
    held = d.replicas["a"].handle
    d.pick("decode", "m")  # one request in flight on the replica picked
    inflight = {r: d.replicas[r].num_inflight for r in "ab"}
    status, model, _ = _entry("a", running=4)
    d.update([(status, model, None), _entry("b")[:2] + (None,), _entry("c")[:2] + (None,)])
    assert d.replicas["a"].handle is held and d.replicas["a"].status.num_running == 4
    assert {r: d.replicas[r].num_inflight for r in "ab"} == inflight
    assert set(d.replicas) == {"a", "b"}  # "c" comes with its handle at the next refresh


def test_pick_counts_this_routers_own_inflight_requests_between_refreshes():
    d = WorkerDirectory()
    d.update([_entry("a"), _entry("b")])
    first = d.pick("decode", "m")
    first.num_inflight += 3
    assert d.pick("decode", "m").replica_id != first.replica_id
    d.update([_entry("a"), _entry("b")])  # a refresh keeps the in-flight counts
    assert d.replicas[first.replica_id].num_inflight == 3


def test_pick_breaks_load_ties_on_kv_use():
    d = WorkerDirectory()
    d.update([_entry("a", free=10), _entry("b", free=90)])
    assert d.pick("decode", "m").replica_id == "b"


def _rejected(request: pb.GenerateRequest, config=RouterConfig(max_prompt_chars=10)) -> CallRejected:
    with pytest.raises(CallRejected) as e:
        check_generate(request, config, ["m"])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return e.value


def test_request_checks_name_the_field():
    assert _rejected(pb.GenerateRequest(model="x", prompt="hi")).message.startswith("model: 'x' is not served here (served: m)")
    assert _rejected(pb.GenerateRequest()).message == "prompt: give one of prompt, prompt_token_ids and messages"
    assert _rejected(pb.GenerateRequest(prompt="0123456789A")).message == "prompt: 11 characters exceed the limit of 10"
    both = pb.GenerateRequest(prompt_token_ids=[1], messages=[pb.ChatMessage(role="user", content="x")])
    assert _rejected(both).message.startswith("prompt_token_ids: give exactly one of")
    check_generate(pb.GenerateRequest(model="m", prompt="ok"), RouterConfig(), ["m"])


def test_chat_roles_count_toward_the_prompt_size_limit():
    # A megabyte role used to pass the limit (only contents were counted) and reach the worker's tokenizer.
    long_role = pb.GenerateRequest(messages=[pb.ChatMessage(role="r" * 9, content="xy")])
    assert _rejected(long_role).message == "messages: 11 characters exceed the limit of 10"
    check_generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="r" * 8, content="xy")]), RouterConfig(max_prompt_chars=10), ["m"])


def test_a_huge_model_name_is_cut_short_in_the_message():
    # The whole name used to be echoed: a 400 KB status message passed grpc's 16 KB metadata
    # limit and the client got RESOURCE_EXHAUSTED ("Stream removed") instead of INVALID_ARGUMENT.
    message = _rejected(pb.GenerateRequest(model="x" * 400_000, prompt="hi")).message
    assert message == f"model: {'x' * 64!r}... (400000 characters) is not served here (served: m)"


def test_worker_errors_map_to_status_codes():
    assert from_worker(wpb.RequestError(code=wpb.RequestError.RESOURCE_EXHAUSTED, message="full")).code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert from_worker(wpb.RequestError(code=wpb.RequestError.UNAVAILABLE, message="x")).code == grpc.StatusCode.UNAVAILABLE
    assert from_worker(wpb.RequestError(message="?")).code == grpc.StatusCode.INTERNAL


def test_cli_options_come_from_the_config_dataclasses():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineConfig)
    add_dataclass_args(parser, WorkerConfig, prefix="worker", skip=("cluster_tls",))  # its own options, in splitserve up
    args = parser.parse_args(["--kv-dtype", "fp32", "--num-kv-blocks", "7", "--no-enable-prefix-caching", "--worker-metrics-port", "9100"])
    engine = dataclass_from_args(EngineConfig, args)
    assert (engine.kv_dtype, engine.num_kv_blocks, engine.enable_prefix_caching, engine.block_size) == ("fp32", 7, False, 16)
    assert dataclass_from_args(WorkerConfig, args, prefix="worker").metrics_port == 9100
    assert "Tokens per KV block." in parser.format_help()
    assert field_docs(EngineConfig)["kv_dtype"].startswith("KV pool storage")


def test_a_wildcard_bind_is_advertised_as_the_nodes_address():
    """A router bound to 0.0.0.0 (a pod) reports an address others can dial, not the wildcard."""
    import ray

    from router.replica import _advertised

    assert _advertised("127.0.0.1") == "127.0.0.1"
    for wildcard in ("0.0.0.0", "::"):
        assert _advertised(wildcard) == ray.util.get_node_ip_address() not in ("0.0.0.0", "::", "")


def test_router_i_listens_on_each_fixed_port_plus_i():
    from router.config import RouterConfig
    from router.control.controller_config import ControllerConfig
    from router.control.launch import ClusterConfig

    config = ClusterConfig(router=RouterConfig(port=50051, metrics_port=0, http_port=8000), num_routers=3)
    assert [(c.port, c.metrics_port, c.http_port) for c in map(config.router_config, range(3))] == [(50051, 0, 8000), (50052, 0, 8001), (50053, 0, 8002)]
    assert ClusterConfig(router=RouterConfig(port=0)).router_config(1).port == 0  # 0: a free port each
    with pytest.raises(ValueError, match="num_routers: must be >= 1, got 0 "):
        ClusterConfig(num_routers=0)
    assert ClusterConfig(controller=ControllerConfig(follow_nodes=True), num_decode=0, num_routers=0).num_routers == 0  # routers join as nodes


def test_status_says_how_often_the_controller_restarted():
    from proto import splitserve_pb2 as pb
    from cli.client_commands import controller_line

    assert controller_line(pb.ControllerStatus(generation=1)) == "controller: generation 1, never restarted; 0 routers started again"
    restarted = pb.ControllerStatus(generation=4, num_restarts=2, last_restart_unix_s=1795000000.0, num_router_restarts=1)
    assert controller_line(restarted) == "controller: generation 4, 2 restarts, the last at 2026-11-18 11:06:40 UTC; 1 routers started again"


def test_a_speculative_decode_pool_runs_beside_a_tensor_parallel_prefill_pool():
    from router.control.launch import ClusterConfig

    config = ClusterConfig(engine=EngineConfig(speculative="ngram"), num_prefill=1, prefill_tp_size=2)
    assert (config.pool_engine("prefill").speculative, config.pool_engine("prefill").tp_size) == ("off", 2)
    assert (config.pool_engine("decode").speculative, config.pool_engine("decode").tp_size) == ("ngram", 1)
    with pytest.raises(ValueError, match="speculative: 'ngram' runs on replicas of one rank only"):
        ClusterConfig(engine=EngineConfig(speculative="ngram"), decode_tp_size=2)
