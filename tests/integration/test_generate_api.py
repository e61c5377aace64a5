"""The gRPC API on a real local cluster: real Ray actors, real gRPC on loopback, a real model."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer
from proto import splitserve_pb2 as pb
from router.client import SplitServeClient, build_generate_request
from router.config import RouterConfig
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster, wait_until
from tests.unit.engine.helpers import random_prompts

pytestmark = pytest.mark.integration

NUM_BLOCKS = 128
MAX_PROMPT_CHARS = 5000


@pytest.fixture(scope="module")
def engine_config(tiny_llama_dir):
    return EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=NUM_BLOCKS, max_num_seqs=8, max_model_len=512)


@pytest.fixture(scope="module")
def cluster(ray_session, engine_config):
    config = ClusterConfig(
        engine=engine_config,
        worker=WorkerConfig(max_waiting_requests=8),
        router=RouterConfig(port=0, max_prompt_chars=MAX_PROMPT_CHARS, worker_refresh_interval_s=0.25),
    )
    with running_cluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with SplitServeClient(cluster.router_status.grpc_address) as c:
        yield c


def decode_handle(cluster):
    [(_, _, handle)] = ray.get(cluster.controller.replicas.remote())
    return handle


def replica_status(client) -> pb.ReplicaStatus:
    [replica] = client.cluster_status().replicas
    return replica


def pool_is_idle(client) -> bool:
    r = replica_status(client)
    return r.num_running == 0 and r.num_waiting == 0 and r.num_free_kv_blocks == r.num_kv_blocks


def aborted_and_idle(client, num_aborted_before: int):
    """The request was aborted (not finished) and the pool holds no block."""
    return pool_is_idle(client) and replica_status(client).num_aborted_requests == num_aborted_before + 1


def collect(responses) -> tuple[list[int], str, pb.GenerateResponse]:
    ids, text, last = [], [], None
    for r in responses:
        ids += r.token_ids
        text.append(r.text)
        last = r
    return ids, "".join(text), last


def test_sixteen_concurrent_streams_match_the_engine(client, cluster, engine_config):
    prompts = random_prompts([3 + 7 * i for i in range(16)], seed=21)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine = LLMEngine(engine_config)
    expected = engine.generate(prompts, params)

    def call(prompt):
        return collect(client.generate(prompt, max_tokens=20, temperature=0, ignore_eos=True))

    worker = decode_handle(cluster)
    # The router opens its channel when it learns of the worker (this is the module's first call).
    wait_until(lambda: ray.get(worker.request_plane_stats.remote()).num_open_channels == 1)
    before, plane_before = ray.get(cluster.router.channel_stats.remote()), ray.get(worker.request_plane_stats.remote())
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(call, prompts))
    after, plane_after = ray.get(cluster.router.channel_stats.remote()), ray.get(worker.request_plane_stats.remote())
    num_events, num_batches = after.num_events - before.num_events, after.num_batches - before.num_batches
    assert num_events >= 16 * 20 // 2  # at least one event per step and request (often one per token)
    assert num_batches * 2 < num_events  # one channel frame carries a step's events of many requests
    assert plane_after.num_submitted - plane_before.num_submitted == 16  # submitted on the request plane, not over Ray
    assert plane_after.num_open_channels == 1  # one router, one connection
    for (ids, text, last), want in zip(got, expected):
        assert ids == list(want.output_token_ids)
        assert text == want.text
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(want.prompt_token_ids), 20)
    wait_until(lambda: pool_is_idle(client))


def test_usage_reports_cached_prompt_tokens(client):
    [prompt] = random_prompts([40], seed=22)
    _, _, first = collect(client.generate(prompt, max_tokens=4, temperature=0))
    _, _, second = collect(client.generate(prompt + [7, 8], max_tokens=4, temperature=0))
    assert (first.usage.cached_prompt_tokens, second.usage.cached_prompt_tokens) == (0, 32)


def test_last_response_carries_the_worker_timings(client):
    start = time.perf_counter()
    responses = list(client.generate(random_prompts([30], seed=24)[0], max_tokens=6, temperature=0, ignore_eos=True))
    client_ttft = time.perf_counter() - start  # an upper bound: taken after the whole stream
    assert [r.HasField("timings") for r in responses] == [False] * (len(responses) - 1) + [True]
    t = responses[-1].timings
    assert 0 < t.queue_s < t.worker_first_token_s < t.worker_total_s < client_ttft
    assert t.kv_handoff_s == 0  # aggregated: prefilled on the decode worker
    # The first token's way through the worker, in order: taken in, scheduled, sampled, handed back.
    assert 0 < t.admitted_s <= t.queue_s < t.first_step_end_s <= t.worker_first_token_s
    assert 0 < t.request_plane_s < t.worker_first_token_s  # the Submit frame read to the request starting
    assert t.prefill_steps == 1 and t.prefill_step_tokens >= 30  # its 30-token prompt in one step, maybe beside others


def test_chat_messages_and_stop_strings(client):
    ids, text, last = collect(client.generate(messages=[{"role": "user", "content": "Paris is the capital"}], max_tokens=8, temperature=0))
    assert len(ids) >= 1 and last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    full_ids, full_text, _ = collect(client.generate("The quick brown fox", max_tokens=12, temperature=0, ignore_eos=True))
    stop = full_text[4:7]
    _, cut_text, cut_last = collect(client.generate("The quick brown fox", max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))
    assert cut_text == full_text[: full_text.index(stop)]
    assert (cut_last.finish_reason, cut_last.stop_reason) == (pb.FINISH_REASON_STOP, stop)


LONG = dict(max_tokens=450, ignore_eos=True)  # runs for seconds: long enough to be cut short


def test_cancel_frees_the_blocks(client):
    before = replica_status(client).num_aborted_requests
    stream = client.generate(random_prompts([50], seed=23)[0], **LONG)
    next(stream)
    stream.cancel()
    wait_until(lambda: aborted_and_idle(client, before))


def test_deadline_is_honoured_and_frees_the_blocks(client):
    before = replica_status(client).num_aborted_requests
    with pytest.raises(grpc.RpcError) as e:
        collect(client.generate(random_prompts([50], seed=24)[0], **LONG, timeout_s=0.3))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: aborted_and_idle(client, before))


def test_client_that_disappears_frees_the_blocks(client, cluster):
    before = replica_status(client).num_aborted_requests
    code = (
        "import sys; from router.client import SplitServeClient;"
        f"c = SplitServeClient({cluster.router_status.grpc_address!r});"
        "s = c.generate(list(range(3, 60)), max_tokens=450, ignore_eos=True); next(s);"
        "print('streaming', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    wait_until(lambda: aborted_and_idle(client, before))


BAD_REQUESTS = [
    (dict(prompt="hi", messages=[{"role": "user", "content": "hi"}]), "prompt: give exactly one of prompt, prompt_token_ids and messages (got prompt, messages)"),
    (dict(prompt=[5, 6], messages=[{"role": "user", "content": "hi"}]), "prompt_token_ids: give exactly one of"),
    (dict(), "prompt: give one of prompt, prompt_token_ids and messages"),
    (dict(prompt=""), "prompt: must not be empty"),
    (dict(prompt="x" * (MAX_PROMPT_CHARS + 1)), f"prompt: {MAX_PROMPT_CHARS + 1} characters exceed the limit of {MAX_PROMPT_CHARS}"),
    (dict(prompt=[5] * 597), "prompt: 597 tokens do not fit the context of 512 tokens"),
    (dict(prompt=[5, 99999]), "prompt_token_ids: token id 99999 is outside the vocabulary [0, 512)"),
    (dict(prompt=[5, -4]), "prompt_token_ids: token id -4 is outside the vocabulary"),
    (dict(prompt="hi", max_tokens=0), "max_tokens: must be an integer >= 1, got 0"),
    (dict(prompt="hi", temperature=-1.0), "temperature: must be >= 0, got -1.0"),
    (dict(prompt="hi", top_p=0.0), "top_p: must be in (0, 1], got 0.0"),
    (dict(prompt="hi", top_p=1.5), "top_p: must be in (0, 1], got 1.5"),
    (dict(prompt="hi", top_k=-1), "top_k: must be an integer >= 0 (0 disables it), got -1"),
    (dict(prompt="hi", stop=[""]), "stop: stop strings must be non-empty strings"),
    (dict(prompt="hi", model="no-such-model"), "model: 'no-such-model' is not served here"),
    (dict(messages=[{"role": "", "content": "hi"}]), "messages[0].role: must not be empty"),
    (dict(prompt="hi", stop_token_ids=[-1]), "stop_token_ids: stop token ids must be integers >= 0"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_REQUESTS, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD_REQUESTS)])
def test_bad_request_is_invalid_argument_naming_the_field(client, kwargs, message):
    with pytest.raises(grpc.RpcError) as e:
        collect(client.generate(**kwargs))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(message)


def test_server_keeps_serving_after_bad_requests(client):
    for kwargs, _ in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError):
            collect(client.generate(**kwargs))
    ids, _, last = collect(client.generate("hello", max_tokens=3, temperature=0, ignore_eos=True))
    assert len(ids) == 3 and last.finish_reason == pb.FINISH_REASON_LENGTH
    wait_until(lambda: pool_is_idle(client))


def test_full_admission_queue_is_resource_exhausted(client):
    prompts = random_prompts([30] * 24, seed=25)

    def call(prompt):
        try:
            collect(client.generate(prompt, max_tokens=400, ignore_eos=True))  # all 24 overlap
            return "OK"
        except grpc.RpcError as e:
            assert "requests already waiting" in e.details()
            return e.code().name

    with ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(call, prompts))
    assert outcomes.count("RESOURCE_EXHAUSTED") > 0
    assert outcomes.count("OK") >= 8 + 8  # the running batch and the waiting queue are served
    wait_until(lambda: pool_is_idle(client))


def test_tokenize_and_list_models(client, engine_config, tiny_llama_dir):
    engine = LLMEngine(engine_config)
    assert client.tokenize("The quick brown fox") == engine.tokenizer.encode("The quick brown fox")
    [model] = client.list_models()
    assert (model.id, model.max_model_len, model.vocab_size, model.kv_dtype, model.block_size) == (tiny_llama_dir.name, 512, 512, "fp32", 16)


def test_text_and_chat_prompts_tokenized_by_the_router_generate_as_their_ids_do(client, tiny_llama_dir):
    """The router tokenizes (files fetched from the decode worker); the engine gets ids only, and
    the stream is the one the same ids sent by the client give."""
    tokenizer = Tokenizer.from_dir(tiny_llama_dir)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The quick brown fox"}]
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True), add_special_tokens=False)
    for request, ids in (({"prompt": "The quick brown fox"}, tokenizer.encode("The quick brown fox")), ({"messages": chat}, chat_ids)):
        as_text = collect(client.generate(**request, max_tokens=8, temperature=0, ignore_eos=True))
        as_ids = collect(client.generate(ids, max_tokens=8, temperature=0, ignore_eos=True))
        assert as_text[:2] == as_ids[:2] and len(as_text[0]) == 8
        assert as_text[2].usage.prompt_tokens == len(ids)
    assert client.tokenize("The quick brown fox") == tokenizer.encode("The quick brown fox")


def test_health_and_reflection(cluster):
    channel = grpc.insecure_channel(cluster.router_status.grpc_address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "splitserve.v1.Generation"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    [answer] = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in answer.list_services_response.service}
    assert {"splitserve.v1.Generation", "splitserve.v1.Admin", "grpc.health.v1.Health"} <= names


def test_prometheus_metrics_from_router_and_worker(client, cluster):
    collect(client.generate("hello", max_tokens=2, temperature=0))
    with pytest.raises(grpc.RpcError):
        collect(client.generate("hello", max_tokens=0))
    status = client.cluster_status()
    router_text = urllib.request.urlopen(status.routers[0].metrics_url).read().decode()
    assert 'splitserve_requests_total{router="router-0",status="OK"}' in router_text
    assert "splitserve_time_to_first_token_seconds_bucket" in router_text
    assert "splitserve_inter_token_latency_seconds_count" in router_text
    assert "splitserve_e2e_latency_seconds_count" in router_text
    assert _sample(router_text, "splitserve_request_inter_token_latency_seconds_count") >= 1  # the 2-token answer's mean
    assert _sample(router_text, "splitserve_serving_path_first_token_seconds_count") >= 1
    assert 'splitserve_requests_total{router="router-0",status="INVALID_ARGUMENT"}' in router_text
    controller_text = urllib.request.urlopen(ray.get(cluster.controller.metrics_address.remote())).read().decode()
    assert 'splitserve_replicas{healthy="true",pool="decode"} 1.0' in controller_text
    worker_text = urllib.request.urlopen(status.replicas[0].metrics_url).read().decode()
    assert f'splitserve_kv_blocks_total{{pool="decode",replica="decode-0"}} {float(NUM_BLOCKS)}' in worker_text
    assert "splitserve_worker_requests_running" in worker_text and "splitserve_kv_blocks_used" in worker_text
    assert 'splitserve_kv_tier_hits_total{pool="decode",replica="decode-0",tier="pool"}' in worker_text
    assert 'splitserve_kv_handoff_remote_prefills_total{pool="decode",replica="decode-0"} 0.0' in worker_text
    assert _sample(worker_text, "splitserve_worker_queue_seconds_count") >= 1
    assert _sample(worker_text, "splitserve_worker_admit_seconds_count") == _sample(worker_text, "splitserve_worker_queue_seconds_count")
    assert _sample(worker_text, "splitserve_worker_first_token_seconds_count") >= 1
    assert _sample(worker_text, "splitserve_worker_kv_handoff_seconds_count") == 0  # no remote prefill here
    assert _sample(worker_text, "splitserve_request_plane_open_channels") == 1
    assert _sample(worker_text, "splitserve_request_plane_submitted_total") >= 1
    assert _sample(worker_text, "splitserve_engine_steps_total") >= 2  # a prefill and a decode step at least
    assert _sample(worker_text, "splitserve_engine_step_tokens_total") >= _sample(worker_text, "splitserve_engine_steps_total")
    assert 0 < _sample(worker_text, "splitserve_engine_step_cpu_seconds_total") <= 1.05 * _sample(worker_text, "splitserve_engine_step_seconds_total")


def _sample(text: str, name: str) -> float:
    """The value of the one sample called ``name`` (any labels) in a Prometheus exposition."""
    [value] = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return value


def test_no_live_worker_is_unavailable(client, cluster, engine_config):
    from router.control.controller import ReplicaSpec
    from router.control.launch import DECODE_WORKER_CLASS

    [replica] = client.cluster_status().replicas
    assert ray.get(cluster.controller.remove_replica.remote(replica.replica_id))
    wait_until(lambda: not client.cluster_status().replicas)
    wait_until(lambda: not client.list_models())  # the router's view has caught up: no replica to migrate to either

    def unavailable():
        try:
            collect(client.generate("hi", max_tokens=2))
        except grpc.RpcError as e:
            return e.code() == grpc.StatusCode.UNAVAILABLE and e.details() == "no live decode worker"
        return False

    wait_until(unavailable)
    spec = ReplicaSpec("decode", DECODE_WORKER_CLASS, (engine_config, WorkerConfig(max_waiting_requests=8)))
    ray.get(cluster.controller.add_replica.remote(spec))
    wait_until(lambda: client.list_models())
    ids, _, _ = collect(client.generate("hi", max_tokens=2, ignore_eos=True))
    assert len(ids) == 2


def test_a_request_id_already_in_flight_is_invalid_argument(client):
    first = client.generate("hi", request_id="same-id", **LONG)
    next(first)
    with pytest.raises(grpc.RpcError) as e:
        collect(client.generate("hi", request_id="same-id", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("request_id: 'same-id' is already in flight")
    first.cancel()
    wait_until(lambda: pool_is_idle(client))
    ids, _, last = collect(client.generate("hi", request_id="same-id", max_tokens=2, ignore_eos=True))
    assert len(ids) == 2 and last.request_id == "same-id"


def test_the_only_decode_replica_killed_mid_stream_is_replaced_and_the_stream_resumes_on_it(client, cluster):
    greedy = dict(temperature=0, **LONG)
    expected, expected_text, _ = collect(client.generate("hi", **greedy))
    [replica] = client.cluster_status().replicas
    stream = client.generate("hi", **greedy)
    first = next(stream)
    ray.kill(decode_handle(cluster))
    ids, text, last = collect(stream)  # waits for the controller's replacement, then goes on there
    assert list(first.token_ids) + ids == expected and first.text + text == expected_text
    assert last.usage.completion_tokens == len(expected)
    [replacement] = client.cluster_status().replicas
    assert replacement.replica_id != replica.replica_id
    [pool] = [p for p in client.cluster_status().pools if p.pool == "decode"]
    assert (pool.target_replicas, pool.num_replicas, pool.num_restarts) == (1, 1, 1)


def test_a_decode_replica_that_cannot_listen_fails_to_start_and_is_not_left_running(client, cluster, engine_config):
    from router.control.controller import ReplicaSpec
    from router.control.launch import DECODE_WORKER_CLASS

    [replica] = client.cluster_status().replicas
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        worker = WorkerConfig(request_plane_host="127.0.0.1", request_plane_port=taken.getsockname()[1])
        spec = ReplicaSpec("decode", DECODE_WORKER_CLASS, (engine_config, worker))
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(cluster.controller.add_replica.remote(spec))
    assert "address already in use" in str(e.value)
    assert [r.replica_id for r in client.cluster_status().replicas] == [replica.replica_id]

    def decode_actors():
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("splitserve-decode"))

    wait_until(lambda: decode_actors() == [f"splitserve-{replica.replica_id}"])


def test_build_request_leaves_unset_fields_to_server_defaults():
    request = build_generate_request("hi")
    assert not request.sampling.HasField("temperature") and not request.stop.HasField("max_tokens")


def test_the_controller_sends_the_replicas_a_router_knows_without_their_handles(cluster):
    [(status, _, handle)] = ray.get(cluster.controller.replicas.remote())
    [(again, model, none)] = ray.get(cluster.controller.replicas.remote(known=[status.replica_id, "decode-99"]))
    assert handle is not None and none is None and again.replica_id == status.replica_id and model.id
