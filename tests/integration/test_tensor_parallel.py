"""Tensor-parallel engines give TP 1's tokens: real follower ranks as Ray actors, joined to this
process (the leader, rank 0) by real gloo process groups, loading shards of real checkpoints.

float32 greedy decoding is compared token for token: a tiny random llama with 3 KV heads at TP 3
(one KV head per rank, as SmolLM2-135M, which test_tp_cluster serves at TP 3) through chunked
prefill, a prefix-cache hit, preemption and FP8 KV; the tiny random llama at TP 2 and TP 4 (two
ranks per KV head) against TP 1 and transformers. Seeded sampling gives the same
tokens at every size, and each rank holds its 1/N share of the parameters, no more than the
replicated parts add.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.layers.norm import RMSNorm
from engine.params import SamplingParams
from engine.parallel.sharding import parameter_bytes
from tests.integration.parallel_engines import parallel_engines
from tests.unit.engine.helpers import GREEDY, random_prompts, run_staggered, transformers_greedy

pytestmark = pytest.mark.integration

GREEDY_16 = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.8, seed=1234, ignore_eos=True)
FOLLOWER_CPUS = 0.5

PASSAGE = (
    "The lighthouse stood at the end of a narrow spit of rock, and for eighty years its keepers had "
    "climbed the same one hundred and twelve steps every evening to light the lamp. The last keeper, a "
    "quiet woman named Ada, kept a logbook in which she wrote the weather, the ships that passed, and "
    "the birds that rested on the gallery rail. When the lamp was automated, she was asked to leave, "
    "but she stayed in the cottage below and went on writing, because the sea did not know that "
    "anything had changed. Researchers later found her books in a cupboard: forty years of wind "
    "speeds, tides and the arrival dates of migrating terns, more complete than any official record. "
    "From them a team of climate scientists reconstructed how the storms of the northern coast had "
    "grown stronger and more frequent, and how the birds had begun to arrive eleven days earlier than "
    "they did when the first entry was made. Ada never learned what became of her notes. She had "
    "simply believed that someone, one day, would want to know what the weather had been like."
)


@pytest.fixture(scope="module")
def engines(follower_hosts):
    with parallel_engines(FOLLOWER_CPUS, "test-tp", follower_hosts) as e:
        yield e


def expected_rank_bytes(tp1_model, size: int) -> int:
    """Bytes of parameters every rank of a TP ``size`` engine holds, from the TP 1 model: a 1/size
    share of the split weights, with the vocabulary's rows (embedding, and LM head unless tied)
    padded up to a multiple of ``size``; the whole of the replicated RMSNorms; and, when there are
    fewer KV heads than ranks, one whole KV head's K and V projections in place of a share of them."""
    config = tp1_model.config
    assert not config.qkv_bias, "this formula has no QKV bias term"
    element_bytes = tp1_model.embed_tokens.weight.element_size()
    norm_bytes = sum(parameter_bytes(m) for m in tp1_model.modules() if isinstance(m, RMSNorm))
    row_bytes = config.hidden_size * element_bytes * (1 if config.tie_word_embeddings else 2)
    vocab_bytes = config.vocab_size * row_bytes
    split_bytes = parameter_bytes(tp1_model) - norm_bytes - vocab_bytes
    assert split_bytes % size == 0
    kv_bytes = 2 * config.num_kv_heads * config.head_dim * config.hidden_size * config.num_layers * element_bytes
    replicated_kv_bytes = kv_bytes // config.num_kv_heads - kv_bytes // size if size > config.num_kv_heads else 0
    return split_bytes // size + -(-config.vocab_size // size) * row_bytes + norm_bytes + replicated_kv_bytes


# --- a tiny random llama with 3 KV heads at TP 3 (one KV head per rank, as SmolLM2's) -----------


@pytest.fixture(scope="module")
def kv3(tiny_checkpoint):
    """``kv3(**overrides)``: a small-pool, small-batch config (chunked prefill, preemption) of the
    tiny llama shaped like SmolLM2 at TP 3: 3 KV heads, one per rank, a vocabulary padded to 513."""
    base = EngineConfig(model=str(tiny_checkpoint("llama-kv3")), kv_dtype="fp32", num_kv_blocks=24, max_num_batched_tokens=48)
    return lambda **overrides: replace(base, **overrides)


@pytest.fixture(scope="module")
def passage_ids(engines, kv3) -> list[int]:
    ids = engines.get(kv3(tp_size=1)).tokenizer.encode(PASSAGE)
    assert len(ids) > 200
    return ids


def run_both(engines, config: EngineConfig, prompts, params=GREEDY_16, reset_cache: bool = True) -> tuple[list, list]:
    """``run_staggered`` on the TP 1 and TP ``config.tp_size`` engines of ``config``."""
    outputs = []
    for size in (1, config.tp_size):
        engine = engines.get(replace(config, tp_size=size))
        if reset_cache:
            engine.reset_prefix_cache()
        outputs.append(run_staggered(engine, prompts, params, every=1))
    return outputs[0], outputs[1]


@pytest.mark.slow
def test_tp3_chunked_prefill_matches_tp1(engines, kv3, passage_ids):
    config = kv3(tp_size=3)
    prompts = [passage_ids[:130], passage_ids[130:137], passage_ids[40:100]]
    assert max(map(len, prompts)) > 2 * config.max_num_batched_tokens  # prefilled in three chunks
    expected, got = run_both(engines, config, prompts)
    assert got == expected
    assert all(len(tokens) == GREEDY_16.max_tokens for tokens in got)


@pytest.mark.slow
def test_tp3_prefix_cache_hit_matches_tp1(engines, kv3, passage_ids):
    prefix = passage_ids[:64]  # four full blocks
    prompts = [prefix + passage_ids[150:170], prefix + passage_ids[180:195]]
    outputs = {}
    for size in (1, 3):
        engine = engines.get(kv3(tp_size=size))
        engine.reset_prefix_cache()
        first = engine.generate([prompts[0]], replace(GREEDY_16, max_tokens=4))[0]
        second = engine.generate([prompts[1]], GREEDY_16)[0]
        assert (first.num_cached_tokens, second.num_cached_tokens) == (0, len(prefix))
        outputs[size] = (first.output_token_ids, second.output_token_ids)
    assert outputs[3] == outputs[1]


@pytest.mark.slow
def test_tp3_preemption_matches_tp1(engines, kv3, passage_ids):
    config = kv3(tp_size=3)
    prompts = [passage_ids[start : start + n] for start, n in [(0, 90), (20, 85), (60, 80), (100, 75)]]
    num_blocks_needed = sum(-(-(len(p) + GREEDY_16.max_tokens) // config.block_size) for p in prompts)
    assert num_blocks_needed > config.num_kv_blocks
    before = {size: engines.get(replace(config, tp_size=size)).stats().num_preemptions for size in (1, 3)}
    expected, got = run_both(engines, config, prompts)
    assert got == expected
    stats = engines.get(config).stats()
    assert stats.num_preemptions > before[3]
    assert engines.get(kv3(tp_size=1)).stats().num_preemptions > before[1]
    assert (stats.num_free_kv_blocks, stats.num_running, stats.num_waiting) == (config.num_kv_blocks, 0, 0)


def test_tp3_ranks_hold_a_third_of_the_parameters_and_one_kv_head_each(engines, kv3):
    tp1_model = engines.get(kv3(tp_size=1)).runner.model
    leader = engines.get(kv3(tp_size=3))
    infos = engines.follower_infos()
    expected = expected_rank_bytes(tp1_model, 3)  # its 512-token vocabulary padded to 513 rows
    assert parameter_bytes(leader.runner.model) == expected
    assert [info["param_bytes"] for info in infos] == [expected, expected]
    assert [info["rank"] for info in infos] == [1, 2]
    assert leader.runner.model.shard.kv_heads == range(0, 1)
    assert [(info["kv_head_start"], info["kv_head_end"]) for info in infos] == [(1, 2), (2, 3)]
    assert all(info["alive"] and info["failure"] == "" for info in infos)


@pytest.mark.slow
def test_tp3_fp8_kv_matches_tp1_fp8(engines, kv3, passage_ids):
    config = kv3(tp_size=3, kv_dtype="fp8_e4m3", num_kv_blocks=64)
    prompts = [passage_ids[:90], passage_ids[120:160]]
    expected, got = run_both(engines, config, prompts)
    assert got == expected
    # the pool really is fp8: each rank's layout holds its one KV head in e4m3 with scales
    layout = engines.get(config).kv_cache.layout
    assert (layout.kv_dtype, layout.num_kv_heads, layout.has_scales) == ("fp8_e4m3", 1, True)


# --- the tiny random llama at TP 2 and TP 4 ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    base = EngineConfig(model=str(tiny_llama_dir), kv_dtype="fp32", num_kv_blocks=256, max_num_batched_tokens=64)
    return lambda **overrides: replace(base, **overrides)


@pytest.fixture(scope="module")
def tiny_prompts():
    return random_prompts()


@pytest.fixture(scope="module")
def tiny_tp1(engines, tiny, tiny_prompts):
    """The TP 1 engine and its greedy and seeded outputs."""
    engine = engines.get(tiny(tp_size=1))
    return engine, run_staggered(engine, tiny_prompts, GREEDY), run_staggered(engine, tiny_prompts, SEEDED)


@pytest.fixture(scope="module")
def tiny_transformers(tiny_llama_dir, tiny_prompts):
    return transformers_greedy(tiny_llama_dir, tiny_prompts, GREEDY.max_tokens)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def tiny_tp_size(request) -> int:
    """Tests taking this run once per size, grouped by size (one engine build each)."""
    return request.param


def test_tiny_llama_greedy_matches_tp1_and_transformers(engines, tiny, tiny_prompts, tiny_tp1, tiny_transformers, tiny_tp_size):
    _, expected, _ = tiny_tp1
    assert expected == tiny_transformers
    engine = engines.get(tiny(tp_size=tiny_tp_size))
    assert run_staggered(engine, tiny_prompts, GREEDY) == expected


def test_tiny_llama_seeded_sampling_gives_tp1_tokens(engines, tiny, tiny_prompts, tiny_tp1, tiny_tp_size):
    _, greedy, expected = tiny_tp1
    assert expected != greedy  # it samples
    engine = engines.get(tiny(tp_size=tiny_tp_size))
    assert run_staggered(engine, tiny_prompts, SEEDED) == expected


def test_tiny_llama_ranks_hold_their_share_and_replicate_kv_heads_past_two_ranks(engines, tiny, tiny_tp1, tiny_tp_size):
    tp1_model = tiny_tp1[0].runner.model
    leader = engines.get(tiny(tp_size=tiny_tp_size))
    infos = engines.follower_infos()
    expected = expected_rank_bytes(tp1_model, tiny_tp_size)
    assert parameter_bytes(leader.runner.model) == expected
    assert [info["param_bytes"] for info in infos] == [expected] * (tiny_tp_size - 1)
    heads = [(leader.runner.model.shard.kv_heads.start, leader.runner.model.shard.kv_heads.stop)]
    heads += [(info["kv_head_start"], info["kv_head_end"]) for info in infos]
    assert heads == ([(0, 1), (1, 2)] if tiny_tp_size == 2 else [(0, 1), (0, 1), (1, 2), (1, 2)])
