"""Prefill/decode disaggregation on real Ray, real gRPC and real NIXL over UCX on loopback.

The cluster module runs 1 prefill + 1 decode replica behind a router (policy ``recompute``);
the hand-wired tests start prefill and decode actors directly, to aim a hand-off at a chosen
prefill worker (a mismatched one, an unlinked one, a killed one) without a router in between;
those with the ``fail`` policy share one decode actor.
"""

from __future__ import annotations

import asyncio
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from prefill_worker.config import PrefillWorkerConfig
from proto import worker_pb2 as wpb
from proto.framing import frame, read_frame
from router.client import SplitServeClient, build_generate_request
from router.config import RouterConfig
from router.control.controller import CONTROLLER_NAME, NAMESPACE
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster, wait_until
from tests.unit.engine.helpers import PROMPT_LENGTHS, random_prompts

pytestmark = pytest.mark.integration

NUM_BLOCKS = 96
TIMEOUT_S = 2.0
GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)


def _engine_config(model_dir, kv_dtype="fp32") -> EngineConfig:
    return EngineConfig(model=str(model_dir), kv_dtype=kv_dtype, num_kv_blocks=NUM_BLOCKS, max_num_seqs=16, max_model_len=512)


def _expected(engine_config: EngineConfig, prompts, **params) -> list[tuple[int, ...]]:
    engine = LLMEngine(engine_config)
    return [c.output_token_ids for c in engine.generate(prompts, SamplingParams(**params))]


@pytest.fixture(scope="module")
def engine_config(tiny_llama_dir):
    return _engine_config(tiny_llama_dir)


@pytest.fixture(scope="module")
def cluster(ray_session, engine_config):
    config = ClusterConfig(
        engine=engine_config,
        worker=WorkerConfig(kv_transfer_timeout_s=TIMEOUT_S),
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25),
        num_prefill=1,
    )
    with running_cluster(config) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with SplitServeClient(cluster.router_status.grpc_address) as c:
        yield c


def _actor(pool: str):
    """The cluster's only replica of ``pool``, from the controller's map."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    [handle] = [handle for status, _, handle in ray.get(controller.replicas.remote()) if status.pool == pool]
    return handle


def _generate(client, prompt, **params):
    responses = list(client.generate(prompt, **{**GREEDY, **params}))
    tokens = tuple(t for r in responses for t in r.token_ids)
    return tokens, responses[-1].usage


def _stats():
    return ray.get(_actor("decode").transfer_stats.remote()), ray.get(_actor("prefill").transfer_stats.remote())


def _assert_quiet(client, timeout_s=30.0):
    """Every block back in both pools, no lease and no NIXL handle left open."""

    def quiet():
        replicas = client.cluster_status().replicas
        pools_full = all(r.num_free_kv_blocks == r.num_kv_blocks and r.num_running == 0 for r in replicas)
        decode, prefill = _stats()
        return pools_full and (decode.num_open_leases, decode.num_open_handles, prefill.num_open_leases, prefill.num_open_handles) == (0, 0, 0, 0)

    wait_until(quiet, timeout_s)


def test_disaggregated_tokens_equal_aggregated_fp32(client, engine_config):
    prompts = random_prompts(PROMPT_LENGTHS, seed=41)
    before_decode, before_prefill = _stats()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: _generate(client, p), prompts))
    assert [tokens for tokens, _ in results] == _expected(engine_config, prompts, **GREEDY)
    decode, prefill = _stats()
    assert decode.num_remote_prefills - before_decode.num_remote_prefills == len(prompts)
    assert prefill.num_done - before_prefill.num_done == len(prompts)
    assert decode.num_failed == before_decode.num_failed
    _assert_quiet(client)


def test_only_blocks_the_decode_worker_lacks_cross_the_wire(client, engine_config):
    [shared, tail] = random_prompts([64, 30], seed=42)
    _generate(client, shared + tail[:5])  # 69 tokens: 4 full blocks cached on both sides after
    decode0, prefill0 = _stats()
    tokens, usage = _generate(client, shared + tail)  # 94 tokens = 6 blocks, 4 cached on the decode worker
    decode1, prefill1 = _stats()
    assert decode1.num_blocks_received - decode0.num_blocks_received == 2
    assert prefill1.num_blocks_sent - prefill0.num_blocks_sent == 2
    layout_block_bytes = ray.get(_actor("decode").kv_endpoint.remote()).layout.block_bytes
    assert decode1.num_bytes_received - decode0.num_bytes_received == 2 * layout_block_bytes
    assert usage.cached_prompt_tokens == 64
    assert tokens == _expected(engine_config, [shared + tail], **GREEDY)[0]
    _assert_quiet(client)


def test_last_response_times_the_kv_hand_off(client):
    responses = list(client.generate(random_prompts([50], seed=43)[0], **{**GREEDY, "max_tokens": 3}))
    t = responses[-1].timings
    assert 0 < t.kv_handoff_s < t.worker_first_token_s <= t.worker_total_s


def test_failed_transfer_is_recomputed_with_correct_tokens(client, engine_config):
    prompts = random_prompts([20, 45], seed=43)
    before, _ = _stats()
    ray.get(_actor("prefill").inject_faults.remote(fail_next=2))
    results = [_generate(client, p)[0] for p in prompts]
    assert results == _expected(engine_config, prompts, **GREEDY)
    after, _ = _stats()
    assert (after.num_failed - before.num_failed, after.num_recomputed - before.num_recomputed) == (2, 2)
    _assert_quiet(client)


def test_timed_out_transfer_is_recomputed_and_the_prefill_side_is_cancelled(client, engine_config):
    [prompt] = random_prompts([50], seed=44)
    prefill = _actor("prefill")
    ray.get(prefill.inject_faults.remote(delay_s=TIMEOUT_S + 30))
    decode0, prefill0 = _stats()
    try:
        tokens, _ = _generate(client, prompt)
        assert tokens == _expected(engine_config, [prompt], **GREEDY)[0]
        # the decode worker gave up after TIMEOUT_S, recomputed, and called the write off
        wait_until(lambda: _stats()[1].num_cancelled == prefill0.num_cancelled + 1, 10)
        decode1, _ = _stats()
        assert (decode1.num_failed - decode0.num_failed, decode1.num_recomputed - decode0.num_recomputed) == (1, 1)
    finally:
        ray.get(prefill.inject_faults.remote())
    _assert_quiet(client)


def test_workers_publish_kv_events_that_replay_to_their_snapshots(client):
    from kv_store.events import KeySets, Tier

    replicas = {pool: _actor(pool) for pool in ("decode", "prefill")}
    followers = {pool: KeySets.from_snapshot(ray.get(a.kv_snapshot.remote())) for pool, a in replicas.items()}
    _generate(client, random_prompts([80], seed=51)[0])
    for pool, actor in replicas.items():
        follower = followers[pool]
        before = set(follower.keys[Tier.POOL])
        for batch in ray.get(actor.kv_events.remote(follower.seq)):
            follower.apply(batch)
        snapshot = ray.get(actor.kv_snapshot.remote())
        assert follower.keys[Tier.POOL] == set(snapshot.keys[Tier.POOL])
        assert len(follower.keys[Tier.POOL] - before) >= 5  # the prompt's 5 full blocks arrived in both pools


def test_the_controller_created_both_pools_without_importing_torch(cluster):
    """It imports the worker classes by path to create their actors; the engine loads only in theirs."""
    assert {pool for pool in ("decode", "prefill") if _actor(pool)} == {"decode", "prefill"}
    assert ray.get(cluster.controller.__ray_call__.remote(lambda _: "torch" in sys.modules)) is False


def test_random_cancellations_leave_both_pools_full_and_no_handles_open(client):
    rng = random.Random(45)
    prompts = random_prompts([rng.randint(1, 120) for _ in range(200)], seed=45)
    cancelled = 0
    lock = threading.Lock()

    def one(i):
        nonlocal cancelled
        call = client.generation.Generate(build_generate_request(prompts[i], max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True))
        stop_after = rng.choice([0, 0, 1, 2, None])  # responses to read before cancelling; None reads all
        try:
            for n, _ in enumerate(call):
                if stop_after is not None and n >= stop_after:
                    break
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED
        if stop_after is not None:
            call.cancel()
            with lock:
                cancelled += 1

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(len(prompts))))
    assert cancelled > 50
    _assert_quiet(client, timeout_s=60)


def test_prefill_worker_killed_mid_request_is_recomputed(client, engine_config):
    """Last in the module: it kills the cluster's prefill worker."""
    [prompt] = random_prompts([70], seed=46)
    prefill = _actor("prefill")
    ray.get(prefill.inject_faults.remote(delay_s=30))
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_generate, client, prompt)
        wait_until(lambda: _stats()[1].num_prefills > 0 and ray.get(prefill.status.remote()).num_running == 0, 30)
        ray.kill(prefill)
        tokens, _ = answer.result(timeout=60)
    assert tokens == _expected(engine_config, [prompt], **GREEDY)[0]
    decode = ray.get(_actor("decode").transfer_stats.remote())
    assert decode.num_recomputed >= 1
    wait_until(lambda: ray.get(_actor("decode").transfer_stats.remote()).num_open_leases == 0)


# --- prefill and decode actors wired by hand ------------------------------------------------------


def _decode(config: EngineConfig, **worker):
    from decode_worker.actor import DecodeWorker

    decode = ray.remote(DecodeWorker).options(num_cpus=0, max_concurrency=1000).remote("decode-t", config, WorkerConfig(**worker))
    ray.get(decode.status.remote())
    return decode


def _prefill(config: EngineConfig, decode, replica_id: str = "prefill-t", connect: bool = True):
    from prefill_worker.actor import PrefillWorker

    prefill = ray.remote(PrefillWorker).options(num_cpus=0, max_concurrency=1000).remote(replica_id, config, PrefillWorkerConfig())
    ray.get(prefill.status.remote())
    if connect:  # what the controller does when replicas join
        ray.get(prefill.add_kv_peers.remote([ray.get(decode.kv_endpoint.remote())]))
    return prefill


def _pair(decode_config: EngineConfig, prefill_config: EngineConfig, **worker):
    decode = _decode(decode_config, **worker)
    return decode, _prefill(prefill_config, decode)


@pytest.fixture(scope="module")
def fail_decode(ray_session, tiny_llama_dir):
    """A decode worker with the ``fail`` policy, shared by the tests below: each brings its own
    prefill worker (or uses ``fail_prefill``) and leaves the decode worker quiet, as they check."""
    decode = _decode(_engine_config(tiny_llama_dir), remote_prefill_failure="fail", kv_transfer_timeout_s=TIMEOUT_S)
    yield decode
    _shutdown(decode)


@pytest.fixture(scope="module")
def fail_prefill(fail_decode, tiny_llama_dir):
    prefill = _prefill(_engine_config(tiny_llama_dir), fail_decode)
    yield prefill
    _shutdown(prefill)


@pytest.fixture(scope="module")
def unlinked_prefill(fail_decode, tiny_llama_dir):
    """A prefill worker that ``fail_decode``'s endpoint never reached. The test of that refusal
    runs first; the test that kills a prefill worker mid-request then connects it and kills it
    (one actor start for the two)."""
    prefill = _prefill(_engine_config(tiny_llama_dir), fail_decode, "prefill-unlinked", connect=False)
    yield prefill
    ray.kill(prefill)  # killed already where the second test ran


@pytest.fixture(scope="module")
def fp8_prefill(fail_decode, tiny_llama_dir):
    """A prefill worker of the tiny llama with FP8 KV: refused by ``fail_decode`` (fp32 KV) in
    one test, paired with an FP8 decode worker in another (one actor start for the two)."""
    prefill = _prefill(_engine_config(tiny_llama_dir, "fp8_e4m3"), fail_decode, "prefill-fp8")
    yield prefill
    _shutdown(prefill)


def _stream(decode, prefill, prompt, prefill_id: str = "prefill-t", **params):
    request = build_generate_request(prompt, **{**GREEDY, **params}, request_id=f"r{random.random()}")
    events = [ray.get(ref) for ref in decode.generate.options(num_returns="streaming").remote(request, prefill, prefill_id)]
    return events


def _on_request_plane(decode, request, prefill_replica_id: str) -> list[wpb.WorkerEvent]:
    """``request``'s events, submitted as a router does: on the decode worker's request plane,
    naming the prefill worker by replica id."""
    endpoint = ray.get(decode.request_plane.remote())

    async def run():
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        writer.write(frame(wpb.RouterMessage(open=wpb.OpenChannel(channel_id="test", token=endpoint.token))))
        writer.write(frame(wpb.RouterMessage(submit=wpb.Submit(request=request, prefill_replica_id=prefill_replica_id))))
        events = []
        while not events or not (events[-1].HasField("error") or events[-1].response.finish_reason):
            events += wpb.WorkerEventBatch.FromString(await read_frame(reader)).events
        writer.close()
        return events

    return asyncio.run(asyncio.wait_for(run(), 60))


def _shutdown(*actors):
    for actor in actors:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)


def _assert_pair_quiet(decode, prefill):
    def quiet():
        d, p = ray.get([decode.transfer_stats.remote(), prefill.transfer_stats.remote()])
        statuses = ray.get([decode.status.remote(), prefill.status.remote()])
        full = all(s.num_free_kv_blocks == s.num_kv_blocks for s in statuses)
        return full and (d.num_open_leases, p.num_open_leases, d.num_open_handles, p.num_open_handles) == (0, 0, 0, 0)

    wait_until(quiet, 30)


def test_mismatched_kv_dtype_is_refused_at_hand_off(fail_decode, fp8_prefill):
    prefill = fp8_prefill
    [event] = _stream(fail_decode, prefill, random_prompts([30], seed=47)[0], "prefill-fp8")
    assert event.error.code == wpb.RequestError.FAILED_PRECONDITION
    message = event.error.message
    assert "kv_dtype: local='fp8_e4m3' vs remote='fp32'" in message, message
    assert ray.get(prefill.transfer_stats.remote()).num_refused == 1
    _assert_pair_quiet(fail_decode, prefill)


def test_a_decode_agent_never_published_is_refused(fail_decode, unlinked_prefill):
    [event] = _stream(fail_decode, unlinked_prefill, random_prompts([30], seed=52)[0], "prefill-unlinked")
    assert "is unknown here: its endpoint never reached this worker" in event.error.message
    _assert_pair_quiet(fail_decode, unlinked_prefill)


def test_fail_policy_ends_the_request_with_a_clear_error(fail_decode, fail_prefill, engine_config):
    decode, prefill = fail_decode, fail_prefill
    [prompt] = random_prompts([40], seed=48)
    try:
        ray.get(prefill.inject_faults.remote(fail_next=1))
        [event] = _stream(decode, prefill, prompt)
        assert event.error.code == wpb.RequestError.UNAVAILABLE
        assert "injected failure" in event.error.message and "decode-t" in event.error.message

        ray.get(prefill.inject_faults.remote(delay_s=TIMEOUT_S + 1))
        [event] = _stream(decode, prefill, prompt)
        assert f"timed out after {TIMEOUT_S} s" in event.error.message
    finally:
        ray.get(prefill.inject_faults.remote())
    events = _stream(decode, prefill, prompt)  # the pair still works afterwards
    assert tuple(t for e in events for t in e.response.token_ids) == _expected(engine_config, [prompt], **GREEDY)[0]
    _assert_pair_quiet(decode, prefill)


def test_fail_policy_with_the_prefill_worker_killed(fail_decode, unlinked_prefill):
    decode, prefill = fail_decode, unlinked_prefill
    try:
        ray.get(prefill.add_kv_peers.remote([ray.get(decode.kv_endpoint.remote())]))  # what the controller does when replicas join
        num_prefills = ray.get(prefill.transfer_stats.remote()).num_prefills
        ray.get(prefill.inject_faults.remote(delay_s=30))
        request = build_generate_request(random_prompts([40], seed=49)[0], **GREEDY, request_id="killed")
        stream = decode.generate.options(num_returns="streaming").remote(request, prefill, "prefill-killed")
        wait_until(lambda: ray.get(prefill.transfer_stats.remote()).num_prefills == num_prefills + 1)
    finally:
        ray.kill(prefill)  # the fault under test; and no actor outlives a test that failed before it
    [event] = [ray.get(ref) for ref in stream]
    assert event.error.code == wpb.RequestError.UNAVAILABLE
    assert "prefill worker prefill-killed died" in event.error.message
    wait_until(lambda: ray.get(decode.status.remote()).num_free_kv_blocks == NUM_BLOCKS)
    assert ray.get(decode.transfer_stats.remote()).num_open_leases == 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_prefill_worker_is_named_by_id_and_an_unknown_one_gets_the_failure_policy(request, tiny_llama_dir, policy):
    config = _engine_config(tiny_llama_dir)
    prefill = request.getfixturevalue("fail_prefill")  # the shared prefill worker
    if policy == "fail":  # the shared pair
        decode, owned = request.getfixturevalue("fail_decode"), ()
    else:  # a decode worker of its own, which the shared prefill worker connects to as well
        decode = _decode(config, remote_prefill_failure=policy)
        owned = (decode,)
        ray.get(prefill.add_kv_peers.remote([ray.get(decode.kv_endpoint.remote())]))
    try:
        prompts = random_prompts([40, 41, 42], seed=53)
        expected = _expected(config, prompts, **GREEDY)
        stats_before = ray.get(decode.transfer_stats.remote())
        prefills_before = ray.get(prefill.transfer_stats.remote())

        def run(i: int) -> list[wpb.WorkerEvent]:
            return _on_request_plane(decode, build_generate_request(prompts[i], **GREEDY, request_id=f"{policy}-{i}"), "prefill-t")

        def unknown_prefill_handled(events, i: int) -> None:
            if policy == "fail":
                [event] = events
                assert event.error.code == wpb.RequestError.UNAVAILABLE
                assert event.error.message == "replica decode-t: prefill worker prefill-t is unknown here"
            else:  # prefilled locally, same tokens
                assert tuple(t for e in events for t in e.response.token_ids) == expected[i]

        unknown_prefill_handled(run(0), 0)  # not announced yet
        ray.get(decode.add_prefill_peers.remote({"prefill-t": prefill}))  # what the controller does
        assert tuple(t for e in run(1) for t in e.response.token_ids) == expected[1]
        assert ray.get(prefill.transfer_stats.remote()).num_done == prefills_before.num_done + 1
        ray.get(decode.remove_prefill_peer.remote("prefill-t"))
        unknown_prefill_handled(run(2), 2)
        stats = ray.get(decode.transfer_stats.remote())
        counts = (stats.num_remote_prefills, stats.num_failed, stats.num_recomputed)
        before = (stats_before.num_remote_prefills, stats_before.num_failed, stats_before.num_recomputed)
        assert tuple(a - b for a, b in zip(counts, before)) == (1, 2, 2 if policy == "recompute" else 0)
        assert ray.get(prefill.transfer_stats.remote()).num_prefills == prefills_before.num_prefills + 1
        _assert_pair_quiet(decode, prefill)
    finally:
        if owned:
            ray.get(prefill.remove_kv_peers.remote([ray.get(decode.kv_endpoint.remote()).agent_name]))
        _shutdown(*owned)


@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_mixtral_dir"])
def test_fp8_disaggregated_agrees_with_fp8_aggregated(ray_session, request, model):
    """FP8 blocks shipped by the prefill worker decode like the decode worker's own FP8 blocks.
    (How FP8 KV compares with fp32 KV is the engine's test: tests/unit/engine/test_fp8_kv.py.)
    The tiny llama's prefill worker is the module's ``fp8_prefill``, connected to a new decode worker."""
    model_dir = request.getfixturevalue(model)
    fp8 = _engine_config(model_dir, "fp8_e4m3")
    if model == "tiny_llama_dir":
        prefill, prefill_id = request.getfixturevalue("fp8_prefill"), "prefill-fp8"
        decode = _decode(fp8)
        ray.get(prefill.add_kv_peers.remote([ray.get(decode.kv_endpoint.remote())]))  # what the controller does when replicas join
        owned = (decode,)
    else:
        (decode, prefill), prefill_id = _pair(fp8, fp8), "prefill-t"
        owned = (decode, prefill)
    try:
        prompts = random_prompts(PROMPT_LENGTHS, seed=50)
        got = [tuple(t for e in _stream(decode, prefill, p, prefill_id) for t in e.response.token_ids) for p in prompts]
        reference = _expected(fp8, prompts, **GREEDY)
        same = sum(a == b for g, r in zip(got, reference) for a, b in zip(g, r))
        assert same / sum(len(r) for r in reference) >= 0.95
        assert ray.get(decode.transfer_stats.remote()).num_remote_prefills == len(prompts)
    finally:
        if prefill not in owned:
            ray.get(prefill.remove_kv_peers.remote([ray.get(decode.kv_endpoint.remote()).agent_name]))
        _shutdown(*owned)


def test_n_samples_share_the_prompt_blocks_and_each_draws_its_own_seed_stream(client):
    """Sample 0 is prefilled remotely; samples 1..3 run on its decode replica, whose prefix cache
    then holds the prompt's full blocks: each takes them by reference (cached_prompt_tokens) and
    computes only the last block; each samples with its own seed, the same again for the same seed."""
    [prompt] = random_prompts([70], seed=46)  # 4 full blocks + 6 tokens
    decode0, prefill0 = _stats()

    def answers(seed):
        by_index = {}
        usage = {}
        for r in client.generate(prompt, max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True, n=4):
            by_index.setdefault(r.index, []).extend(r.token_ids)
            if r.HasField("usage"):
                usage[r.index] = r.usage
        return {i: tuple(t) for i, t in by_index.items()}, usage

    first, usage = answers(seed=123)
    assert sorted(first) == [0, 1, 2, 3] and all(len(t) == 10 for t in first.values())
    assert len(set(first.values())) == 4
    assert [usage[i].prompt_tokens for i in range(4)] == [70] * 4
    assert [usage[i].cached_prompt_tokens for i in (1, 2, 3)] == [64] * 3
    decode1, prefill1 = _stats()
    assert decode1.num_remote_prefills - decode0.num_remote_prefills == 1  # the prompt crossed once
    assert prefill1.num_done - prefill0.num_done == 1
    again, _ = answers(seed=123)
    assert again == first
    _assert_quiet(client)


def test_n_above_max_n_is_refused_by_name(client):
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate([1, 2, 3], max_tokens=2, n=17))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("sampling.n")
