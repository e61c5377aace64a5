"""Which layers each pipeline stage holds, and the pipeline sizes a model and a config allow."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.errors import UnsupportedModelError
from engine.model_config import ModelConfig
from engine.parallel.pipeline import check_pp_size, layer_param_counts, stage_layers


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> ModelConfig:
    return ModelConfig.from_dir(tiny_checkpoint("llama"))


def _stage_costs(config: ModelConfig, bounds: list[range]) -> list[int]:
    layers = layer_param_counts(config)
    vocab = config.vocab_size * config.hidden_size
    costs = [sum(layers[i] for i in r) for r in bounds]
    costs[0] += vocab
    costs[-1] += vocab + config.hidden_size
    return costs


@settings(max_examples=40, deadline=None)
@given(num_layers=st.integers(1, 9), pp=st.integers(1, 4), vocab=st.sampled_from([64, 512, 4096, 30000]))
def test_stages_are_contiguous_non_empty_and_their_largest_is_as_small_as_any_split(llama, num_layers, pp, vocab):
    config = replace(llama, num_layers=num_layers, vocab_size=vocab)
    if pp > num_layers:
        with pytest.raises(UnsupportedModelError):
            stage_layers(config, pp)
        return
    bounds = stage_layers(config, pp)
    assert len(bounds) == pp and all(len(r) > 0 for r in bounds)
    assert [i for r in bounds for i in r] == list(range(num_layers))
    best = min(
        max(_stage_costs(config, [range(a, b) for a, b in zip((0, *cuts), (*cuts, num_layers))]))
        for cuts in itertools.combinations(range(1, num_layers), pp - 1)
    )
    assert max(_stage_costs(config, bounds)) == best


def test_a_big_vocabulary_leaves_the_end_stages_fewer_layers(llama):
    config = replace(llama, num_layers=12, vocab_size=40 * 512)  # the embedding weighs several layers
    bounds = stage_layers(config, 3)
    assert len(bounds[0]) < len(bounds[1]) and len(bounds[2]) < len(bounds[1])
    even = replace(config, vocab_size=16)
    assert [len(r) for r in stage_layers(even, 3)] == [4, 4, 4]


def test_more_stages_than_layers_is_refused_naming_the_layers(llama):
    check_pp_size("tiny-llama", llama, llama.num_layers)
    with pytest.raises(UnsupportedModelError) as refused:
        check_pp_size("tiny-llama", llama, llama.num_layers + 1)
    assert str(refused.value) == (
        f"model 'tiny-llama' has {llama.num_layers} layers, fewer than pipeline parallel size {llama.num_layers + 1}: "
        f"each stage holds at least one layer. Sizes that work: 1 to {llama.num_layers}"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pp_size": 0}, "pp_size: must be >= 1, got 0"),
        ({"pp_size": 2, "ep_size": 2}, "pp_size: pipeline stages hold dense or tensor-parallel layers so far"),
        ({"pp_size": 2, "cpu_kv_cache_bytes": 1 << 20}, "pp_size: the CPU and Redis KV tiers serve replicas of one stage so far"),
        ({"pp_size": 2, "speculative": "ngram"}, "speculative: 'ngram' runs on replicas of one rank only"),
    ],
)
def test_engine_config_refuses_what_stages_do_not_do(overrides, message):
    with pytest.raises(ValueError) as refused:
        EngineConfig(**overrides)
    assert str(refused.value).startswith(message)


def test_a_replica_is_pp_times_tp_ranks():
    assert EngineConfig(pp_size=2, tp_size=3).num_ranks == 6
    assert EngineConfig(pp_size=3).num_ranks == 3
