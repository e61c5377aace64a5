"""The splitserve policy's time estimate, the router's once-per-prefix block hashing, and the
context refusal before routing."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kv_store.events import EventKind, KVEvent, KVEventBatch, Tier
from kv_store.keys import KeyNamespace, block_keys
from proto import splitserve_pb2 as pb
from router.config import RouterConfig
from router.errors import CallRejected
from router.frontend.metrics import RouterMetrics
from router.frontend.service import GenerationService, check_fits_context
from router.routing.block_hashing import BlockHasher
from router.routing.policy import PolicyConfig, RouteRequest, WorkerLoad, make_policy
from router.routing.prefix_index import CachedRun, PrefixIndex
from router.routing.workers import Replica, WorkerDirectory

KEYS = list(range(1, 65))  # 64 blocks of 16 tokens


def _stored(index: PrefixIndex, worker: str, tier: Tier, keys) -> None:
    seq = index.seq(worker) + 1 if worker in index.workers else 1
    index.apply(KVEventBatch(worker, seq, (KVEvent(EventKind.STORED, tier, tuple(keys)),)))


def _request(keys=KEYS, tokens=64 * 16 + 5):
    return RouteRequest("r", keys, tokens, 16)


def test_a_prefix_in_the_pool_beats_the_same_prefix_in_redis_at_equal_load():
    index = PrefixIndex()
    _stored(index, "gpu", Tier.POOL, KEYS)
    _stored(index, "far", Tier.REDIS, KEYS)  # Redis is everyone's: both can serve it from there
    policy = make_policy("splitserve", index, PolicyConfig(memory_s=0))
    loads = [WorkerLoad("far", 1000, 1), WorkerLoad("gpu", 1000, 1)]
    decision = policy.choose(_request(), loads)
    assert (decision.prefill, decision.cached) == ("gpu", CachedRun(pool=64))


def test_tier_costs_follow_load_speeds():
    policy = make_policy("splitserve", PrefixIndex(), PolicyConfig(prefill_tokens_per_s=10_000, cpu_load_tokens_per_s=100_000, redis_load_tokens_per_s=20_000))
    request = _request(tokens=64 * 16)
    assert policy.work_tokens(request, CachedRun(pool=64)) == 0
    assert policy.work_tokens(request, CachedRun(cpu=64)) == pytest.approx(64 * 16 * 0.1)
    assert policy.work_tokens(request, CachedRun(redis=64)) == pytest.approx(64 * 16 * 0.5)
    assert policy.work_tokens(request, CachedRun(pool=32)) == 32 * 16


def test_a_much_busier_worker_loses_despite_its_cache():
    index = PrefixIndex()
    _stored(index, "holder", Tier.POOL, KEYS)
    policy = make_policy("splitserve", index, PolicyConfig(memory_s=0))
    assert policy.choose(_request(), [WorkerLoad("holder", 300, 1), WorkerLoad("idle", 0, 0)]).prefill == "holder"
    assert policy.choose(_request(), [WorkerLoad("holder", 50_000, 8), WorkerLoad("idle", 0, 0)]).prefill == "idle"


def test_remembered_decisions_count_as_pool_blocks_until_they_expire():
    now = [0.0]
    index = PrefixIndex()
    policy = make_policy("splitserve", index, PolicyConfig(memory_s=2.0), clock=lambda: now[0])
    first = policy.choose(_request(), [WorkerLoad("a"), WorkerLoad("b")]).prefill
    assert index.match(KEYS)[first] == CachedRun(pool=64)
    now[0] = 2.5
    policy.report(WorkerLoad(first))
    assert index.match(KEYS)[first] == CachedRun()
    assert index.oldest_remembered_s() is None


def test_a_decision_returns_before_its_memory_is_placed_and_nothing_reads_the_index_without_it():
    index = PrefixIndex()
    policy = make_policy("splitserve", index, PolicyConfig(memory_s=2.0), clock=lambda: 0.0)
    first = policy.choose(_request(), [WorkerLoad("a"), WorkerLoad("b")]).prefill
    assert index.num_unsettled == 1
    assert index.oldest_remembered_s() == 2.0 and index.num_unsettled == 0  # a reader settles first
    second = policy.choose(_request(), [WorkerLoad("a"), WorkerLoad("b")])
    assert (second.prefill, second.cached) == (first, CachedRun(pool=64))
    _stored(index, "b", Tier.POOL, KEYS)  # so does a writer: the memory goes in before the event
    assert index.num_unsettled == 0 and index.match(KEYS) == {"a": CachedRun(pool=64), "b": CachedRun(pool=64)}


def test_the_router_settles_its_decision_once_the_call_goes_on():
    namespace = KeyNamespace("m", "0", "fp8_e4m3", 16)
    directory = WorkerDirectory()
    for replica_id, pool in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        status = pb.ReplicaStatus(replica_id=replica_id, pool=pool, healthy=True, num_kv_blocks=64, num_free_kv_blocks=64)
        directory.replicas[replica_id] = Replica(None, pb.ModelInfo(id="m", max_model_len=4096, block_size=16), status, namespace=namespace)
    index = PrefixIndex()
    service = GenerationService(RouterConfig(), directory, RouterMetrics("test-settle"), make_policy("splitserve", index), channels=None)
    request = pb.GenerateRequest(model="m", prompt_token_ids=list(range(1000)), request_id="r")

    async def route_then_yield() -> tuple[int, int]:
        chosen = await service._choose_prefill(request, directory.replicas["d0"])
        unsettled = index.num_unsettled
        await asyncio.sleep(0)  # the call's first wait: the loop runs the settle it scheduled
        assert index.match(block_keys(request.prompt_token_ids[:992], 16, namespace.root_key()))[chosen.replica_id] == CachedRun(pool=62)
        return unsettled, index.num_unsettled

    assert asyncio.run(route_then_yield()) == (1, 0)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def test_incremental_hashing_equals_hashing_from_scratch_and_hashes_only_new_blocks():
    rng = random.Random(3)
    hasher = BlockHasher(16, reuse=True)  # the Python chain's way (the default where the C one is missing)
    prompt = _prompt(rng, 1000)
    assert hasher.keys(prompt, 7).tolist() == block_keys(prompt, 16, 7)
    assert hasher.num_hashed_blocks == 62
    for _ in range(5):  # a session's turns: the previous prompt, an answer, a message
        num_known = len(prompt) // 16
        prompt += _prompt(rng, rng.randrange(1, 300))
        before = hasher.num_hashed_blocks
        assert hasher.keys(pb.GenerateRequest(prompt_token_ids=prompt).prompt_token_ids, 7).tolist() == block_keys(prompt, 16, 7)
        assert hasher.num_hashed_blocks - before == len(prompt) // 16 - num_known  # only the new blocks
    assert hasher.keys(prompt, 8).tolist() == block_keys(prompt, 16, 8)  # another tenant: its own chain
    branch = prompt[:500] + [1] * 100
    assert hasher.keys(branch, 7, num_tokens=590).tolist() == block_keys(branch[:590], 16, 7)


def test_hashing_survives_generations_and_refuses_bad_ids():
    rng = random.Random(4)
    hasher = BlockHasher(4, max_blocks=40, reuse=True)  # two prompts' worth: generations turn over
    prompts = [_prompt(rng, 100) for _ in range(6)]
    for prompt in prompts * 2:
        assert hasher.keys(prompt, 1).tolist() == block_keys(prompt, 4, 1)
    assert hasher.keys([1, 2, 3], 1).tolist() == []
    with pytest.raises(ValueError, match="token_ids"):
        hasher.keys([1, -2, 3, 4], 1)
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)


def _replica(replica_id: str, max_model_len: int) -> Replica:
    return Replica(None, pb.ModelInfo(id="m", max_model_len=max_model_len), pb.ReplicaStatus(replica_id=replica_id))


def test_a_prompt_longer_than_every_context_is_refused_naming_both_lengths():
    replicas = [_replica("p0", 4096), _replica("d0", 8192)]
    check_fits_context(8191, replicas)
    with pytest.raises(CallRejected) as refused:
        check_fits_context(9000, replicas)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "9000 tokens" in refused.value.message and "8192" in refused.value.message


def test_the_index_widens_its_lanes_when_more_workers_join():
    index = PrefixIndex()
    index.remember("w0", KEYS[:10], until_s=5.0)
    for i in range(20):  # 8 bits a lane at first: workers 8 and 16 widen it
        _stored(index, f"w{i}", Tier.POOL, KEYS[: i + 1])
        _stored(index, f"w{i}", Tier.CPU, KEYS[i + 1 : i + 3])
    runs = index.match(KEYS)
    assert runs["w0"] == CachedRun(pool=10)  # remembered blocks survived the re-encoding
    assert all(runs[f"w{i}"] == CachedRun(pool=i + 1, cpu=2) for i in range(10, 20))
    index.forget_expired(5.0)
    assert index.match(KEYS)["w0"] == CachedRun(pool=1, cpu=2)


def test_tokenized_ids_reach_the_request_as_they_were():
    from router.frontend.service import _set_prompt_token_ids

    ids = [0, 1, 127, 128, 50_000, 2**31 - 1]
    request = pb.GenerateRequest(model="m", tenant_salt="t")
    _set_prompt_token_ids(request, pb.TokenizeResponse(token_ids=ids))
    assert list(request.prompt_token_ids) == ids and (request.model, request.tenant_salt) == ("m", "t")
    _set_prompt_token_ids(empty := pb.GenerateRequest(), pb.TokenizeResponse())
    assert list(empty.prompt_token_ids) == []
