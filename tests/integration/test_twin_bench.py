"""bench.twin on a real cluster: a decode worker subclass started through ClusterConfig, twins
through both doors, the busy streams stopped with nothing left in the pool."""

from __future__ import annotations

import pytest
import ray

from bench import twin
from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from router.client import SplitServeClient
from router.config import RouterConfig
from router.launch import ClusterConfig
from tests.integration.conftest import running_cluster, wait_until

pytestmark = pytest.mark.integration


def test_twins_run_through_both_doors_of_one_worker(ray_session, tiny_llama_dir):
    engine = EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=128, max_num_seqs=8, max_model_len=512)
    config = ClusterConfig(engine=engine, worker=WorkerConfig(), router=RouterConfig(port=0), decode_worker_class=twin.TWIN_WORKER_CLASS)
    with running_cluster(config) as cluster, SplitServeClient(cluster.router_status.grpc_address) as client:
        [(status, _, handle)] = ray.get(cluster.controller.replicas.remote())
        vocab_size = client.list_models()[0].vocab_size
        stop, busy = twin.keep_busy(client, 1, (8, 16), (8, 8), vocab_size, seed=1)
        try:
            plan = twin.schedule(3, 4.0, (8, 24), (3, 5), vocab_size, seed=2)
            pairs = twin.run(client, handle, plan, "t", chunk=2, lead_s=0.5)
        finally:
            stop.set()
            for thread in busy:
                thread.join()
        assert sorted(p.index for p in pairs) == [0, 1, 2]
        for p in pairs:
            for side in (p.grpc, p.direct):
                assert side.sent_s <= side.trace.arrival_s <= side.trace.admitted_s <= side.trace.first_scheduled_s < side.trace.first_token_s
                assert side.trace.first_token_s <= side.resumed_s <= side.first_token_s + 1e-3
                assert side.trace.prefill_steps >= 1
            assert p.grpc.trace.arrival_s > p.grpc.sent_s  # it crossed the router and the request plane
            assert abs(p.grpc.sent_s - p.direct.sent_s) < 0.05  # one moment for both doors
        # The worker kept no trace past the run, and the pool is empty again.
        assert ray.get(handle.traces.remote([f"grpc-t-{i}" for i in range(3)])) == {}
        assert status.replica_id.startswith("decode-")
        wait_until(lambda: (r := client.cluster_status().replicas[0]).num_running == 0 and r.num_free_kv_blocks == r.num_kv_blocks)
