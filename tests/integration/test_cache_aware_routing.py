"""Cache-aware routing live: two prefill workers, their real KV events, two routers' indexes."""

from __future__ import annotations

import pytest
import ray

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.controller import CONTROLLER_NAME, NAMESPACE
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster, wait_until
from tests.unit.engine.helpers import random_prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir):
    config = ClusterConfig(
        engine=EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=96, max_model_len=512),
        worker=WorkerConfig(),
        # no memory of its own decisions: only the workers' KV events can tell where a prefix is
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25, kv_event_poll_interval_s=0.05, routing_memory_s=0),
        num_prefill=2,
        num_routers=2,
    )
    with running_cluster(config) as c:
        yield c


def _prefill_workers():
    return _replicas("prefill")


def _replicas(*pools: str):
    controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    return {status.replica_id: handle for status, _, handle in ray.get(controller.replicas.remote()) if not pools or status.pool in pools}


def _num_prefills(workers):
    return {w: ray.get(h.transfer_stats.remote()).num_prefills for w, h in workers.items()}


def _wait_for_index(cluster, workers):
    """Until every router has applied every KV event batch the prefill workers have sealed."""
    for worker_id, handle in workers.items():
        target = ray.get(handle.kv_snapshot.remote()).seq
        for router in cluster.routers:
            wait_until(lambda: ray.get(router.prefix_index_seq.remote(worker_id)) >= target, 15)


def test_a_shared_prefix_lands_on_the_prefill_worker_that_holds_it(cluster):
    workers = _prefill_workers()
    assert len(workers) == 2
    families = random_prompts([64, 64, 64], seed=61)
    tails = random_prompts([7] * 6, seed=62)
    with SplitServeClient(cluster.router_status.grpc_address) as client:
        for i, prefix in enumerate(families):
            before = _num_prefills(workers)
            list(client.generate(prefix + tails[2 * i], max_tokens=4, temperature=0))
            [holder] = [w for w, n in _num_prefills(workers).items() if n > before[w]]
            _wait_for_index(cluster, workers)
            before = _num_prefills(workers)
            responses = list(client.generate(prefix + tails[2 * i + 1], max_tokens=4, temperature=0))
            after = _num_prefills(workers)
            assert {w: after[w] - before[w] for w in workers} == {w: int(w == holder) for w in workers}, (i, holder)
            assert responses[-1].usage.cached_prompt_tokens == 64


def test_two_routers_hold_the_same_index_and_send_a_prefix_to_the_same_worker(cluster):
    """Each router follows the workers' KV events itself: after a prefill through router-0, both
    report the same blocks per worker and tier, and a follow-up through either lands on the holder."""
    workers = _prefill_workers()
    [prefix] = random_prompts([64], seed=71)
    tails = random_prompts([7] * 3, seed=72)
    addresses = [status.grpc_address for status in cluster.router_statuses]
    assert len(set(addresses)) == 2
    before = _num_prefills(workers)
    with SplitServeClient(addresses[0]) as client:
        list(client.generate(prefix + tails[0], max_tokens=2, temperature=0))
    [holder] = [w for w, n in _num_prefills(workers).items() if n > before[w]]
    _wait_for_index(cluster, _replicas())  # the decode replica's events too: the views hold its blocks
    views = ray.get([router.prefix_index_view.remote() for router in cluster.routers])
    assert views[0] == views[1] and set(workers) <= set(views[0])
    assert views[0][holder][1] >= 64 // 16  # the prefix's blocks, in the holder's pool
    for address, tail in zip(reversed(addresses), tails[1:]):
        before = _num_prefills(workers)
        with SplitServeClient(address) as client:
            responses = list(client.generate(prefix + tail, max_tokens=2, temperature=0))
        after = _num_prefills(workers)
        assert {w: after[w] - before[w] for w in workers} == {w: int(w == holder) for w in workers}, address
        assert responses[-1].usage.cached_prompt_tokens == 64
