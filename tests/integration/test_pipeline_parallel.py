"""Pipeline-parallel engines give PP 1's tokens: real follower ranks as Ray actors, joined to this
process (the leader: stage 0's TP rank 0) by real gloo process groups, each loading only its
stage's layers of a real checkpoint and holding only those layers' KV.

Greedy decoding is compared token for token: SmolLM2-135M at PP 2 (its native Q4_1 weights) with
several micro-batches in flight, and at PP 2 x TP 3 (float32) through chunked prefill, preemption
and a prefix hit; a tiny random llama with 3 KV heads at PP 2 and at PP 2 x TP 3 (six
ranks: one KV head per rank in each stage) through chunked prefill, a prefix-cache hit and
preemption. Each stage holds its layers' parameters and KV bytes, no more.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.params import SamplingParams
from engine.parallel.pipeline import stage_layers
from engine.parallel.sharding import parameter_bytes
from tests.integration.parallel_engines import parallel_engines
from tests.integration.test_tensor_parallel import PASSAGE
from tests.unit.engine.helpers import random_prompts, run_staggered

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GREEDY_16 = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
FOLLOWER_CPUS = 0.3


@pytest.fixture(scope="module")
def engines(follower_hosts):
    with parallel_engines(FOLLOWER_CPUS, "test-pp", follower_hosts) as e:
        yield e


@pytest.fixture(scope="module")
def kv3(tiny_checkpoint):
    """A small-pool, small-budget config of the tiny llama with 3 KV heads (2 layers: one a stage at PP 2)."""
    base = EngineConfig(model=str(tiny_checkpoint("llama-kv3")), kv_dtype="fp32", weights="fp32", num_kv_blocks=24, max_num_batched_tokens=48)
    return lambda **overrides: replace(base, **overrides)


@pytest.fixture(scope="module")
def passage_ids(engines, kv3) -> list[int]:
    ids = engines.get(kv3()).tokenizer.encode(PASSAGE)
    assert len(ids) > 200
    return ids


def _staggered(engines, config: EngineConfig, prompts) -> list[tuple[int, ...]]:
    engine = engines.get(config)
    engine.reset_prefix_cache()
    return run_staggered(engine, prompts, GREEDY_16, every=1)


def test_smollm2_pp2_matches_pp1_with_micro_batches_in_flight(engines, smollm2_dir):
    """Native Q4_1 weights: each stage builds its own layers' kernels from the GGUF's blocks (and
    runs small steps' layers in C), and the last stage its own copy of the tied LM head."""
    base = EngineConfig(model=str(smollm2_dir), kv_dtype="fp32", num_kv_blocks=96, max_num_batched_tokens=256)
    prompts = random_prompts([9, 40, 23, 70, 5, 31], vocab=49152, seed=81)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [out.output_token_ids for out in engines.get(base).generate(prompts, params)]
    engine = engines.get(replace(base, pp_size=2))
    steps = engine.stats().num_steps
    got = engine.generate(prompts, params)
    assert [out.output_token_ids for out in got] == expected
    # 6 requests in 2 micro-batches of 3, both in flight: each step lands half the batch
    assert engine.stats().num_steps - steps >= 2 * params.max_tokens
    [stage_1] = engines.follower_infos()
    assert (stage_1["stage"], stage_1["layer_start"], stage_1["layer_end"]) == (1, 15, 30)
    assert engine.runner.model.stage.layers == range(0, 15) and engine.runner.model.fused_layers is not None


@pytest.fixture(scope="module", params=[1, 3], ids=["pp2", "pp2-tp3"])
def pp2(request, kv3) -> EngineConfig:
    """PP 2 at TP 1 or 3; tests are grouped by it, so each engine is built once."""
    return kv3(pp_size=2, tp_size=request.param)


def test_chunked_prefill_matches_pp1(engines, kv3, pp2, passage_ids):
    prompts = [passage_ids[:130], passage_ids[130:137], passage_ids[40:100]]
    assert max(map(len, prompts)) > 2 * pp2.max_num_batched_tokens  # prefilled in three chunks
    assert _staggered(engines, pp2, prompts) == _staggered(engines, kv3(), prompts)


def test_prefix_cache_hit_matches_pp1(engines, kv3, pp2, passage_ids):
    prefix = passage_ids[:64]  # four full blocks
    prompts = [prefix + passage_ids[150:170], prefix + passage_ids[180:195]]
    outputs = {}
    for config in (kv3(), pp2):
        engine = engines.get(config)
        engine.reset_prefix_cache()
        first = engine.generate([prompts[0]], replace(GREEDY_16, max_tokens=4))[0]
        second = engine.generate([prompts[1]], GREEDY_16)[0]
        assert (first.num_cached_tokens, second.num_cached_tokens) == (0, len(prefix))
        outputs[config.pp_size] = (first.output_token_ids, second.output_token_ids)
    assert outputs[2] == outputs[1]


def test_preemption_matches_pp1(engines, kv3, pp2, passage_ids):
    prompts = [passage_ids[start : start + n] for start, n in [(0, 90), (20, 85), (60, 80), (100, 75)]]
    assert sum(-(-(len(p) + GREEDY_16.max_tokens) // pp2.block_size) for p in prompts) > pp2.num_kv_blocks
    expected = _staggered(engines, kv3(), prompts)
    before = engines.get(pp2).stats().num_preemptions
    assert _staggered(engines, pp2, prompts) == expected
    stats = engines.get(pp2).stats()
    assert stats.num_preemptions > before
    assert (stats.num_free_kv_blocks, stats.num_running, stats.num_waiting) == (pp2.num_kv_blocks, 0, 0)


def test_each_stage_holds_only_its_layers_weights_and_kv(engines, kv3, pp2, passage_ids):
    pp1 = engines.get(kv3()).runner.model
    engine = engines.get(pp2)
    engine.generate([passage_ids[:20]], GREEDY_16)  # every stage has run steps
    infos = engines.follower_infos()
    tp = pp2.tp_size
    assert [(i["stage"], i["layer_start"], i["layer_end"]) for i in infos] == [(0, 0, 1)] * (tp - 1) + [(1, 1, 2)] * tp
    assert engine.runner.model.stage.layers == range(0, 1) and stage_layers(pp1.config, 2) == [range(0, 1), range(1, 2)]
    layout = engine.kv_cache.layout
    assert (layout.num_layers, layout.num_kv_heads) == (1, 3 // tp)
    assert [i["kv_bytes"] for i in infos] == [engine.kv_cache.buffer.numel()] * len(infos)  # one layer's KV heads of the same blocks
    assert all(i["busy_s"] > 0 and i["num_steps"] > 0 for i in infos)
    if tp == 1:  # each stage holds exactly PP 1's parameters of its part: the last stage its own LM head
        [stage_1] = infos
        lm_head = parameter_bytes(pp1.lm_head) if not pp1.config.tie_word_embeddings else parameter_bytes(pp1.embed_tokens)
        assert parameter_bytes(engine.runner.model) == parameter_bytes(pp1.embed_tokens) + parameter_bytes(pp1.layers[0])
        assert stage_1["param_bytes"] == parameter_bytes(pp1.layers[1]) + parameter_bytes(pp1.norm) + lm_head


def test_smollm2_pp2_tp3_matches_pp1_through_chunks_prefix_hits_and_preemption(engines, smollm2_dir):
    base = EngineConfig(model=str(smollm2_dir), weights="fp32", kv_dtype="fp32", num_kv_blocks=20, max_num_batched_tokens=32)
    passage = engines.get(base).tokenizer.encode(PASSAGE)
    prompts = [passage[:100], passage[:64] + passage[150:170], passage[40:110], passage[120:190]]
    assert sum(-(-(len(p) + GREEDY_16.max_tokens) // 16) for p in prompts) > base.num_kv_blocks and len(prompts[0]) > 2 * 32
    hit = passage[:64] + passage[200:210]
    outputs = {}
    for config in (base, replace(base, pp_size=2, tp_size=3)):
        engine = engines.get(config)
        before = engine.stats().num_preemptions
        outputs[config.num_ranks] = _staggered(engines, config, prompts)
        assert engine.stats().num_preemptions > before
        [first] = engine.generate([hit], replace(GREEDY_16, max_tokens=4))  # fills the cache; the hit is the next call's
        [again] = engine.generate([passage[:64] + passage[210:222]], GREEDY_16)
        assert again.num_cached_tokens == 64
        outputs[config.num_ranks] += [first.output_token_ids, again.output_token_ids]
    assert outputs[6] == outputs[1]


def test_a_long_prompts_chunks_follow_each_other_through_the_stages(engines, kv3, pp2, passage_ids):
    prompt = passage_ids[:130]  # chunks of 48, 48 and 34 tokens
    [expected] = engines.get(kv3()).generate([prompt], GREEDY_16)
    engine = engines.get(pp2)
    engine.reset_prefix_cache()
    engine.add_request("long", prompt, GREEDY_16)
    assert engine.step() == []  # chunk 1 into stage 0
    [request] = engine.scheduler.running
    assert engine.scheduler.in_flight == {request: 48}
    assert engine.step() == []  # chunk 2 in behind it, without waiting for it; chunk 1 lands
    assert engine.scheduler.in_flight == {request: 48} and request.num_computed_tokens == 48
    assert engine.step() == []  # chunk 3, the last, samples: nothing more of the request until it lands
    assert engine.scheduler.in_flight == {request: 34} and engine.scheduler.sampling_in_flight == {request}
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tuple(tokens) == expected.output_token_ids
    assert engine.scheduler.in_flight == {} and engine.scheduler.sampling_in_flight == set()
