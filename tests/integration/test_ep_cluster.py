"""A mixture-of-experts model served disaggregated: prefill TP 1, decode EP 2, FP8 KV hand-off.

The decode replica's two ranks each hold half of the experts and their own requests; every
prompt is prefilled remotely and its KV written into the pool of the rank that admitted it. The
replicas run with both KV tiers (a CPU tier per rank, the cluster's Redis): the decode replica's
per-rank stores report as one (kv_store/data_parallel.py).
"""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import ray
from ray.exceptions import RayTaskError

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from prefill_worker.config import PrefillWorkerConfig
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.controller import CONTROLLER_NAME, NAMESPACE
from router.control.launch import Cluster, ClusterConfig
from tests.integration.conftest import running_cluster
from tests.unit.engine.helpers import random_prompts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


def _engine(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), kv_dtype="fp8_e4m3", num_kv_blocks=64, max_model_len=512)


def _cluster_config(engine: EngineConfig, decode_ep: int) -> ClusterConfig:
    return ClusterConfig(
        engine=engine,
        worker=WorkerConfig(num_threads=1, tp_rank_cpus=0.25, max_local_prefill_tokens=0),
        prefill=PrefillWorkerConfig(num_threads=1),
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25),
        num_prefill=1,
        decode_ep_size=decode_ep,
    )


def test_moe_served_with_expert_parallel_decode_equals_one_engine(ray_session, tiny_checkpoint, redis_server):
    model_dir = tiny_checkpoint("mixtral")
    prompts = random_prompts()
    engine = LLMEngine(_engine(model_dir))
    expected = [c.output_token_ids for c in engine.generate(prompts, SamplingParams(**GREEDY))]
    engine.close()

    tiered = replace(_engine(model_dir), cpu_kv_cache_bytes=1 << 20, redis_url=redis_server.url)
    with running_cluster(_cluster_config(tiered, decode_ep=2)) as cluster:
        with SplitServeClient(cluster.router_status.grpc_address) as client:

            def stream(prompt):
                return tuple(t for r in client.generate(prompt, **GREEDY) for t in r.token_ids)

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(stream, prompts))
            status = client.cluster_status()
        assert got == expected

        controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        [decode] = [h for s, _, h in ray.get(controller.replicas.remote()) if s.pool == "decode"]
        received = ray.get(decode.transfer_stats.remote())
        assert received.num_remote_prefills == len(prompts) and received.num_failed == 0 and received.num_open_leases == 0

        [replica] = [r for r in status.replicas if r.pool == "decode"]
        assert replica.ep_size == 2 and len(replica.tp_ranks) == 2 and all(r.alive for r in replica.tp_ranks)
        assert replica.hottest_experts and replica.ep_load_max_over_mean >= 1.0
        metrics = urllib.request.urlopen(replica.metrics_url, timeout=10).read().decode()
        samples = [line for line in metrics.splitlines() if line.startswith("splitserve_moe_expert_tokens_total{")]
        assert len(samples) == 2 * 4  # 2 layers x 4 experts, both ranks' halves
        assert 'tier="cpu"' in metrics and "splitserve_redis_tier_" in metrics  # the ranks' stores, reported as the replica's
        hottest = replica.hottest_experts[0]
        assert f'expert="{hottest.expert}",layer="{hottest.layer}"' in metrics or f'layer="{hottest.layer}",expert="{hottest.expert}"' in metrics


def test_expert_parallelism_on_a_dense_model_is_refused_by_name(ray_session, tiny_llama_dir):
    config = _cluster_config(_engine(tiny_llama_dir), decode_ep=2)
    cluster = Cluster(config)
    try:
        with pytest.raises(RayTaskError, match="has no experts: expert parallelism needs a mixture-of-experts model"):
            cluster.start()
    finally:
        cluster.stop()
