"""Property-based fuzzing of the public gRPC API on a real local cluster (tiny random Llama).

Hypothesis builds Generate and Tokenize requests field by field, huge payloads, concurrent
requests that share ids and cancel, and raw bytes sent as the serialized request
(fuzz_requests.py). Every answer is judged by the oracle there: OK with a well-formed stream,
INVALID_ARGUMENT whose message starts with a field the request got wrong, or RESOURCE_EXHAUSTED
for a message past grpc's size limit (bytes that decode to no request: INVALID_ARGUMENT naming
``request``); never INTERNAL, UNKNOWN, UNAVAILABLE or a hang. After each test the server still
serves and every KV block is free. Examples are derandomized, so a run is reproducible.

Run with ``-s`` to see each test's examples and the distinct statuses it saw.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.tokenizer import Tokenizer
from proto import splitserve_pb2 as pb
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster, wait_until
from tests.integration.fuzz_requests import (
    MAX_MODEL_LEN,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    NUM_KV_BLOCKS,
    Oracle,
    Outcome,
    generate_requests,
    huge_generate_requests,
    raw_requests,
    raw_tokenize_requests,
    tokenize_requests,
    valid_generate_requests,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CALL_TIMEOUT_S = 30.0
"""Far above any call here (an OK one makes at most 95 tokens of a tiny model): past it is a hang."""


def fuzz_settings(max_examples: int):
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    config = ClusterConfig(
        engine=engine,
        worker=WorkerConfig(max_waiting_requests=8),
        router=RouterConfig(port=0, max_prompt_chars=MAX_PROMPT_CHARS, max_prompt_token_ids=MAX_PROMPT_TOKEN_IDS, worker_refresh_interval_s=0.25),
    )
    with running_cluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with SplitServeClient(cluster.router_status.grpc_address) as c:
        wait_until(c.list_models)
        yield c


@pytest.fixture(scope="module")
def oracle(client, tiny_llama_dir):
    [model] = client.list_models()
    return Oracle(Tokenizer.from_dir(tiny_llama_dir), model.id)


class FuzzStats:
    """Outcomes per test and the fields INVALID_ARGUMENT named, for the module's closing summary."""

    def __init__(self) -> None:
        self.statuses: dict[str, Counter] = defaultdict(Counter)
        self.fields_named: dict[str, Counter] = defaultdict(Counter)
        self.slowest_s: Counter = Counter()

    def count(self, test: str, outcome: Outcome, label: str | None = None) -> None:
        self.statuses[test][label or outcome.label] += 1
        self.slowest_s[test] = max(self.slowest_s[test], outcome.duration_s)
        if label is None and outcome.code == grpc.StatusCode.INVALID_ARGUMENT:
            self.fields_named[test][re.sub(r"\[\d+\]", "[i]", outcome.field)] += 1

    def print_test(self, test: str) -> None:
        seen = self.statuses[test]
        print(f"\nfuzz {test}: {sum(seen.values())} calls, statuses {dict(seen)}, slowest call {self.slowest_s[test]:.2f} s")
        print(f"  INVALID_ARGUMENT named: {dict(self.fields_named[test].most_common())}")

    def print_summary(self) -> None:
        total = sum(self.statuses.values(), Counter())
        print(f"\nfuzz summary: {sum(total.values())} calls; distinct statuses: {sorted(total)}")
        fields = sum(self.fields_named.values(), Counter())
        print(f"fuzz INVALID_ARGUMENT named: {dict(fields.most_common())}")


@pytest.fixture(scope="module")
def stats():
    s = FuzzStats()
    yield s
    s.print_summary()


def call_generate(client: SplitServeClient, request: pb.GenerateRequest, cancel_after: int | None = None) -> Outcome:
    """Send ``request`` and read its stream; with ``cancel_after``, cancel it once more responses than that came."""
    return drain(client.generation.Generate(request, timeout=CALL_TIMEOUT_S), cancel_after)


def drain(stream, cancel_after: int | None = None) -> Outcome:
    start, responses = time.perf_counter(), []
    try:
        for response in stream:
            responses.append(response)
            if cancel_after is not None and len(responses) > cancel_after:
                stream.cancel()
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", tuple(responses), time.perf_counter() - start)
    return Outcome(grpc.StatusCode.OK, "", tuple(responses), time.perf_counter() - start)


def judged_call(client, oracle, stats, test: str, request: pb.GenerateRequest) -> None:
    outcome = call_generate(client, request)
    stats.count(test, outcome)
    oracle.judge_generate(request, outcome)


def all_idle(client: SplitServeClient) -> bool:
    status = client.cluster_status()
    replicas_idle = all(r.num_running == 0 and r.num_waiting == 0 and r.num_free_kv_blocks == r.num_kv_blocks for r in status.replicas)
    return bool(status.replicas) and replicas_idle and all(r.num_inflight == 0 for r in status.routers)


def assert_still_serving_and_no_block_leaked(client: SplitServeClient) -> None:
    outcome = call_generate(client, pb.GenerateRequest(prompt="hello", stop=pb.StopConditions(max_tokens=3, ignore_eos=True)))
    assert outcome.code == grpc.StatusCode.OK and outcome.responses[-1].usage.completion_tokens == 3
    wait_until(lambda: all_idle(client))


def test_fuzzed_generate_requests_are_served_or_refused_naming_the_field(client, oracle, stats):
    @fuzz_settings(max_examples=300)
    @given(request=generate_requests())
    def check(request):
        oracle.fix_model(request)
        judged_call(client, oracle, stats, "generate", request)

    check()
    stats.print_test("generate")
    assert_still_serving_and_no_block_leaked(client)


def test_fuzzed_huge_payloads_are_served_or_refused_by_size(client, oracle, stats):
    @fuzz_settings(max_examples=40)
    @given(request=huge_generate_requests())
    def check(request):
        oracle.fix_model(request)
        judged_call(client, oracle, stats, "huge", request)

    check()
    stats.print_test("huge")
    assert_still_serving_and_no_block_leaked(client)


def test_fuzzed_raw_bytes_are_refused_or_served_like_the_message_they_decode_to(cluster, client, oracle, stats):
    channel = grpc.insecure_channel(cluster.router_status.grpc_address)
    raw_call = channel.unary_stream("/splitserve.v1.Generation/Generate", request_serializer=None, response_deserializer=pb.GenerateResponse.FromString)

    @fuzz_settings(max_examples=200)
    @given(data=raw_requests())
    def check(data):
        outcome = drain(raw_call(data, timeout=CALL_TIMEOUT_S))
        try:
            request = pb.GenerateRequest.FromString(data)
        except DecodeError:
            assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
            assert outcome.details.startswith("request: not a valid splitserve.v1.GenerateRequest"), outcome
            stats.count("raw bytes", outcome, "INVALID_ARGUMENT(request: undecodable)")
            return
        stats.count("raw bytes", outcome)
        oracle.judge_generate(request, outcome)

    try:
        check()
    finally:
        channel.close()
    stats.print_test("raw bytes")
    assert_still_serving_and_no_block_leaked(client)


def test_fuzzed_concurrent_requests_with_shared_ids_and_cancels_leave_no_block_behind(client, oracle, stats):
    groups = itertools.count()
    cancel_after = st.one_of(st.none(), st.none(), st.integers(0, 2))  # responses to read before cancelling
    request = st.one_of(valid_generate_requests(), valid_generate_requests(), generate_requests(cheap=True))
    one = st.tuples(request, st.sampled_from(["", "a", "b"]), cancel_after)

    @fuzz_settings(max_examples=40)
    @given(group=st.lists(one, min_size=2, max_size=4))
    def check(group):
        number = next(groups)  # an id is shared within its group only: groups never race each other's ids
        requests = []
        for request, request_id, _ in group:
            oracle.fix_model(request)
            request.request_id = f"{request_id}-{number}" if request_id else ""
            requests.append(request)
        barrier = threading.Barrier(len(group))

        def call(i):
            barrier.wait()
            return call_generate(client, requests[i], cancel_after=group[i][2])

        with ThreadPoolExecutor(len(group)) as pool:
            outcomes = list(pool.map(call, range(len(group))))
        ids = Counter(r.request_id for r in requests)
        for request, outcome, (_, _, cancel) in zip(requests, outcomes, group):
            stats.count("concurrent", outcome)
            if outcome.code == grpc.StatusCode.CANCELLED and cancel is not None:
                continue
            if outcome.code == grpc.StatusCode.INVALID_ARGUMENT and outcome.field == "request_id" and ids[request.request_id] > 1:
                continue
            oracle.judge_generate(request, outcome)
        wait_until(lambda: all_idle(client))  # cancelled requests' blocks come back

    check()
    stats.print_test("concurrent")
    assert_still_serving_and_no_block_leaked(client)


def test_fuzzed_tokenize_requests(client, oracle, stats):
    @fuzz_settings(max_examples=100)
    @given(request=tokenize_requests())
    def check(request):
        oracle.fix_model(request)
        start = time.perf_counter()
        try:
            token_ids = list(client.generation.Tokenize(request, timeout=CALL_TIMEOUT_S).token_ids)
            outcome = Outcome(grpc.StatusCode.OK, duration_s=time.perf_counter() - start)
        except grpc.RpcError as e:
            token_ids, outcome = [], Outcome(e.code(), e.details() or "", duration_s=time.perf_counter() - start)
        stats.count("tokenize", outcome)
        oracle.judge_tokenize(request, outcome, token_ids)

    check()
    stats.print_test("tokenize")


def test_fuzzed_raw_bytes_to_tokenize_list_models_and_cluster_status(cluster, client, oracle, stats):
    channel = grpc.insecure_channel(cluster.router_status.grpc_address)
    methods = {
        "Tokenize": (pb.TokenizeRequest, pb.TokenizeResponse, "/splitserve.v1.Generation/Tokenize"),
        "ListModels": (pb.ListModelsRequest, pb.ListModelsResponse, "/splitserve.v1.Generation/ListModels"),
        "GetClusterStatus": (pb.GetClusterStatusRequest, pb.ClusterStatus, "/splitserve.v1.Admin/GetClusterStatus"),
    }

    @fuzz_settings(max_examples=80)
    @given(method=st.sampled_from(sorted(methods)), data=st.one_of(st.binary(max_size=48), raw_tokenize_requests()))
    def check(method, data):
        request_type, response_type, path = methods[method]
        start = time.perf_counter()
        try:
            response = channel.unary_unary(path, request_serializer=None, response_deserializer=response_type.FromString)(data, timeout=CALL_TIMEOUT_S)
            outcome = Outcome(grpc.StatusCode.OK, duration_s=time.perf_counter() - start)
        except grpc.RpcError as e:
            response, outcome = None, Outcome(e.code(), e.details() or "", duration_s=time.perf_counter() - start)
        try:
            request = request_type.FromString(data)
        except DecodeError:
            assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT and outcome.details.startswith("request: not a valid splitserve.v1."), outcome
            stats.count("raw bytes, other methods", outcome, "INVALID_ARGUMENT(request: undecodable)")
            return
        stats.count("raw bytes, other methods", outcome)
        if method == "Tokenize":
            oracle.judge_tokenize(request, outcome, list(response.token_ids) if response else [])
        else:
            assert outcome.code == grpc.StatusCode.OK, outcome  # unknown fields are ignored

    try:
        check()
    finally:
        channel.close()
    stats.print_test("raw bytes, other methods")


def test_a_request_id_refused_by_the_worker_can_be_reused_at_once(client):
    # A worker's refusal must free the id on the router's channel at once (not when GC finalizes the call).
    for _ in range(5):
        outcome = call_generate(client, pb.GenerateRequest(prompt="hi", request_id="reused", stop=pb.StopConditions(max_tokens=10**6)))
        assert (outcome.code, outcome.field) == (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens")
