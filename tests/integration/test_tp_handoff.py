"""KV hand-off between prefill and decode replicas of different tensor-parallel sizes.

Each pair runs a real cluster (Ray, gloo between the ranks of a replica, NIXL over UCX between
the ranks of the two replicas) and must answer token for token as one aggregated TP 1 engine
does. Every request is prefilled remotely (``max_local_prefill_tokens=0``); the workers'
counters prove it, and the prefill side's TransferResults say which rank wrote what.

The tiny model has 2 KV heads, so two clusters cover every way the heads can map:
- P1 -> D4: one prefill rank's heads are cut up among decode ranks, and decode ranks hold
  replicated heads (two ranks per head, each written);
- P4 -> D1: prefill ranks hold replicated heads (only the first holder of each head writes),
  several prefill ranks write into one decode rank, and a writer's rank (2) is past the number
  of writers into that rank (2), which once broke the decode side's count of notifications.
Equal sizes map rank to rank; P1 -> D1 is test_disaggregation's. SmolLM2 at TP 3 is
test_tp_cluster's and test_tensor_parallel's: the hand-off only sees head ranges.
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


def _engine(model: str) -> EngineConfig:
    return EngineConfig(model=model, weights="fp32", kv_dtype="fp32", num_kv_blocks=128, max_model_len=512)


def _actors(pool: str) -> list:
    controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    return [handle for status, _, handle in ray.get(controller.replicas.remote()) if status.pool == pool]


def _serve_disaggregated(engine: EngineConfig, prefill_tp: int, decode_tp: int, prompts) -> list[tuple[int, ...]]:
    config = ClusterConfig(
        engine=engine,
        worker=WorkerConfig(num_threads=1, tp_rank_cpus=0.25, max_local_prefill_tokens=0),
        prefill=PrefillWorkerConfig(num_threads=1, tp_rank_cpus=0.25),
        router=RouterConfig(port=0, worker_refresh_interval_s=0.25),
        num_prefill=1,
        prefill_tp_size=prefill_tp,
        decode_tp_size=decode_tp,
    )
    with running_cluster(config) as cluster, SplitServeClient(cluster.router_status.grpc_address) as client:
        outputs = []
        for prompt in prompts:
            tokens = [t for r in client.generate(prompt, **GREEDY) for t in r.token_ids]
            outputs.append(tuple(tokens))
        [decode] = _actors("decode")
        [prefill] = _actors("prefill")
        received, sent = ray.get(decode.transfer_stats.remote()), ray.get(prefill.transfer_stats.remote())
        assert received.num_remote_prefills == len(prompts) and received.num_failed == 0
        assert sent.num_done == len(prompts) and sent.num_open_leases == 0
        endpoints = ray.get(decode.kv_endpoints.remote())
        assert [(e.head_start, e.head_end) for e in endpoints] == _heads(engine, decode_tp)
        written = ray.get(prefill.rank_bytes_sent.remote())
        assert set(written) == _expected_pairs(_heads(engine, prefill_tp), _heads(engine, decode_tp))
    return outputs


def _expected_pairs(prefill: list[tuple[int, int]], decode: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """(prefill rank, decode rank) pairs that must have written: the first prefill rank holding each head a decode rank needs."""
    pairs = set()
    for d, (start, stop) in enumerate(decode):
        for head in range(start, stop):
            pairs.add((next(p for p, (a, b) in enumerate(prefill) if a <= head < b), d))
    return pairs


def _heads(engine: EngineConfig, tp: int) -> list[tuple[int, int]]:
    from engine.bundled import resolve_model
    from engine.model_config import ModelConfig
    from engine.parallel.sharding import TPShard

    config = ModelConfig.from_dir(resolve_model(engine.model, engine.cache_dir))
    return [(TPShard(config, r, tp).kv_heads.start, TPShard(config, r, tp).kv_heads.stop) for r in range(tp)]


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 4), (4, 1)])
def test_hand_off_between_tp_sizes_is_token_identical(ray_session, tiny_llama_dir, prefill_tp, decode_tp):
    prompts = [[5, 17, 200, 33, 41, 90, 7, 301, 12, 64, 22, 19, 150, 8, 77, 3, 99, 250, 11], [42, 7, 7, 120]]
    engine = LLMEngine(_engine(str(tiny_llama_dir)))
    expected = [c.output_token_ids for c in engine.generate(prompts, SamplingParams(**GREEDY))]
    engine.close()
    assert _serve_disaggregated(_engine(str(tiny_llama_dir)), prefill_tp, decode_tp, prompts) == expected
