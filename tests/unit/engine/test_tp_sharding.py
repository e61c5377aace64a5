"""Which slice of a model each tensor-parallel rank holds, and which TP sizes a model allows
(engine/parallel/sharding.py): pure arithmetic on real model configs, no process group."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from engine.errors import UnsupportedModelError
from engine.model_config import ModelConfig
from engine.parallel.sharding import TPShard, check_tp_size, valid_tp_sizes


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> ModelConfig:
    return ModelConfig.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir) -> ModelConfig:
    return ModelConfig.from_dir(tiny_llama_dir)


def shards(config: ModelConfig, size: int) -> list[TPShard]:
    return [TPShard(config, rank, size) for rank in range(size)]


def test_smollm2_allows_tp_1_and_3_and_refuses_2_with_a_sentence(smollm2):
    assert (smollm2.num_heads, smollm2.num_kv_heads) == (9, 3)
    assert valid_tp_sizes(smollm2) == [1, 3]
    check_tp_size("smollm2-135m", smollm2, 1)
    check_tp_size("smollm2-135m", smollm2, 3)
    with pytest.raises(UnsupportedModelError) as refused:
        check_tp_size("smollm2-135m", smollm2, 2)
    message = str(refused.value)
    assert message.startswith("model 'smollm2-135m' (9 attention heads, 3 KV heads) cannot run with tensor parallel size 2: ")
    assert "9 attention heads do not divide by 2" in message
    assert message.endswith("Sizes that work: 1, 3")


@pytest.mark.parametrize("size", [4, 9])
def test_smollm2_sizes_that_split_heads_but_not_the_rest_are_refused(smollm2, size):
    with pytest.raises(UnsupportedModelError, match=re.escape("Sizes that work: 1, 3")) as refused:
        check_tp_size("smollm2-135m", smollm2, size)
    reason = "9 attention heads do not divide by 4" if size == 4 else "intermediate size 1536 does not divide by 9"
    assert reason in str(refused.value)


def test_tiny_llama_allows_1_2_4(tiny_llama):
    assert (tiny_llama.num_heads, tiny_llama.num_kv_heads, tiny_llama.intermediate_size) == (4, 2, 128)
    assert valid_tp_sizes(tiny_llama) == [1, 2, 4]
    with pytest.raises(UnsupportedModelError, match=re.escape("(4 attention heads, 2 KV heads) cannot run with tensor parallel size 3")):
        check_tp_size("tiny", tiny_llama, 3)


def test_kv_heads_that_neither_divide_nor_are_divided_by_the_size_are_refused(tiny_llama):
    config = replace(tiny_llama, num_heads=12, num_kv_heads=4, intermediate_size=120)
    assert valid_tp_sizes(config) == [1, 2, 4, 12]
    with pytest.raises(UnsupportedModelError, match="4 KV heads neither divide by 6 nor divide it"):
        check_tp_size("m", config, 6)


def test_moe_models_run_with_tp_1_only(tiny_checkpoint):
    mixtral = ModelConfig.from_dir(tiny_checkpoint("mixtral"))
    assert valid_tp_sizes(mixtral) == [1]
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts models run with TP 1"):
        check_tp_size("tiny-mixtral", mixtral, 2)


def test_a_size_below_one_is_refused(tiny_llama):
    with pytest.raises(UnsupportedModelError, match="tp_size: must be >= 1, got 0"):
        check_tp_size("tiny", tiny_llama, 0)


def test_tp_1_holds_everything(smollm2):
    shard = TPShard(smollm2)
    assert (shard.heads, shard.kv_heads, shard.intermediate, shard.vocab) == (range(9), range(3), range(1536), range(49152))
    assert (shard.kv_replicas, shard.owns_kv_heads, shard.padded_vocab_size) == (1, True, 49152)


def test_smollm2_tp_3_splits_every_dimension_into_disjoint_runs(smollm2):
    ranks = shards(smollm2, 3)
    assert [s.heads for s in ranks] == [range(0, 3), range(3, 6), range(6, 9)]
    assert [s.kv_heads for s in ranks] == [range(0, 1), range(1, 2), range(2, 3)]
    assert [s.intermediate for s in ranks] == [range(0, 512), range(512, 1024), range(1024, 1536)]
    assert [s.vocab for s in ranks] == [range(0, 16384), range(16384, 32768), range(32768, 49152)]
    assert all(s.kv_replicas == 1 and s.owns_kv_heads for s in ranks)
    # every query head reads the KV head its own rank holds (GQA groups of 3 stay on one rank)
    for s in ranks:
        assert {h // smollm2.num_queries_per_kv for h in s.heads} == set(s.kv_heads)


def test_tiny_llama_tp_2_gives_each_rank_one_kv_head(tiny_llama):
    ranks = shards(tiny_llama, 2)
    assert [s.heads for s in ranks] == [range(0, 2), range(2, 4)]
    assert [s.kv_heads for s in ranks] == [range(0, 1), range(1, 2)]
    assert [s.intermediate for s in ranks] == [range(0, 64), range(64, 128)]
    assert [s.vocab for s in ranks] == [range(0, 256), range(256, 512)]
    assert [s.owns_kv_heads for s in ranks] == [True, True]


def test_tiny_llama_tp_4_replicates_each_kv_head_on_two_ranks(tiny_llama):
    ranks = shards(tiny_llama, 4)
    assert [s.heads for s in ranks] == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert all(s.kv_replicas == 2 for s in ranks)
    assert [s.kv_heads for s in ranks] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [s.owns_kv_heads for s in ranks] == [True, False, True, False]
    for s in ranks:
        assert {h // tiny_llama.num_queries_per_kv for h in s.heads} == set(s.kv_heads)
    assert [s.intermediate for s in ranks] == [range(0, 32), range(32, 64), range(64, 96), range(96, 128)]


def test_a_vocabulary_that_does_not_divide_is_padded_up_and_split_evenly(smollm2):
    config = replace(smollm2, vocab_size=49153)
    ranks = shards(config, 3)
    assert [s.padded_vocab_size for s in ranks] == [49155] * 3
    assert [s.vocab for s in ranks] == [range(0, 16385), range(16385, 32770), range(32770, 49155)]
    assert ranks[-1].vocab.stop - config.vocab_size == 2  # two padding rows, on the last rank only


def test_a_rank_outside_the_group_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="rank: 2 is not a rank of size 2"):
        TPShard(tiny_llama, 2, 2)
    with pytest.raises(ValueError, match="rank: -1 is not a rank of size 2"):
        TPShard(tiny_llama, -1, 2)
