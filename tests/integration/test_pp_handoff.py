"""KV hand-off between prefill and decode replicas split in pipeline stages.

Each pair runs a real cluster (Ray, gloo between the ranks of a replica, NIXL over UCX between
the ranks of the two replicas) and must answer token for token as one aggregated engine does.
Every request is prefilled remotely (``max_local_prefill_tokens=0``); the workers' counters
prove it, and the prefill side says which of its ranks wrote into which decode rank.

The tiny llama has 2 layers and 3 KV heads:
- P(PP 2) -> D(PP 1): each prefill stage writes its layer into the one decode rank;
- P(TP 3) -> D(PP 2): each prefill rank writes its KV head of layer 0 into decode stage 0 and of
  layer 1 into decode stage 1, six writes of one head by one layer.
"""

from __future__ import annotations

import pytest
import ray

from decode_worker.config import WorkerConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from prefill_worker.config import PrefillWorkerConfig
from router.client import SplitServeClient
from router.config import RouterConfig
from router.control.controller import CONTROLLER_NAME, NAMESPACE
from router.control.launch import ClusterConfig
from tests.integration.conftest import running_cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GREEDY = dict(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 200, 33, 41, 90, 7, 301, 12, 64, 22, 19, 150, 8, 77, 3, 99, 250, 11, 40, 41, 42], [42, 7, 7, 120]]


def _engine(model: str) -> EngineConfig:
    return EngineConfig(model=model, weights="fp32", kv_dtype="fp32", num_kv_blocks=128, max_model_len=512)


def _actors(pool: str) -> list:
    controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    return [handle for status, _, handle in ray.get(controller.replicas.remote()) if status.pool == pool]


@pytest.mark.parametrize(
    "prefill_shape, decode_shape, decode_layers, pairs",
    [
        ((2, 1), (1, 1), [(0, 2)], {(0, 0), (1, 0)}),
        ((1, 3), (2, 1), [(0, 1), (1, 2)], {(p, d) for p in range(3) for d in range(2)}),
    ],
    ids=["p-pp2-to-d-pp1", "p-tp3-to-d-pp2"],
)
def test_hand_off_across_pipeline_stages_is_token_identical(ray_session, tiny_checkpoint, prefill_shape, decode_shape, decode_layers, pairs):
    model = str(tiny_checkpoint("llama-kv3"))
    engine = LLMEngine(_engine(model))
    expected = [c.output_token_ids for c in engine.generate(PROMPTS, SamplingParams(**GREEDY))]
    engine.close()
    config = ClusterConfig(
        engine=_engine(model),
        worker=WorkerConfig(num_threads=1, tp_rank_cpus=0.25, max_local_prefill_tokens=0),
        prefill=PrefillWorkerConfig(num_threads=1, tp_rank_cpus=0.25),
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25),
        num_prefill=1,
        prefill_pp_size=prefill_shape[0],
        prefill_tp_size=prefill_shape[1],
        decode_pp_size=decode_shape[0],
        decode_tp_size=decode_shape[1],
    )
    with running_cluster(config) as cluster, SplitServeClient(cluster.router_status.grpc_address) as client:
        outputs = [tuple(t for r in client.generate(prompt, **GREEDY) for t in r.token_ids) for prompt in PROMPTS]
        [decode], [prefill] = _actors("decode"), _actors("prefill")
        received, sent = ray.get(decode.transfer_stats.remote()), ray.get(prefill.transfer_stats.remote())
        assert received.num_remote_prefills == len(PROMPTS) and received.num_failed == 0
        assert sent.num_done == len(PROMPTS) and sent.num_open_leases == 0
        endpoints = ray.get(decode.kv_endpoints.remote())
        assert [(e.layer_start, e.layer_end) for e in endpoints] == decode_layers
        assert set(ray.get(prefill.rank_bytes_sent.remote())) == pairs
    assert outputs == expected
