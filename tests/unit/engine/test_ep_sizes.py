"""Which expert-parallel sizes a model allows (engine/parallel/sharding.py) and which engine
configs may ask for one (engine/config.py): real tiny model configs, no process group."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import UnsupportedModelError
from engine.model_config import ModelConfig
from engine.parallel.sharding import check_ep_size

MOE_MODELS = ("mixtral", "qwen2-moe", "qwen3-moe")


@pytest.fixture(scope="module")
def configs(tiny_checkpoint):
    return lambda name: ModelConfig.from_dir(tiny_checkpoint(name))


@pytest.mark.parametrize("name", MOE_MODELS)
def test_four_experts_split_over_1_2_and_4_ranks(configs, name):
    config = configs(name)
    assert config.moe.num_experts == 4
    for size in (1, 2, 4):
        check_ep_size(name, config, size)


@pytest.mark.parametrize("name", MOE_MODELS)
@pytest.mark.parametrize("size", [3, 8])
def test_a_size_that_does_not_divide_the_experts_is_one_sentence_naming_the_sizes_that_work(configs, name, size):
    with pytest.raises(UnsupportedModelError) as refused:
        check_ep_size("tiny-moe", configs(name), size)
    assert str(refused.value) == f"model 'tiny-moe' has 4 experts, which do not divide by expert parallel size {size}. Sizes that work: 1, 2, 4"


def test_a_dense_model_is_refused_by_name_and_architecture(configs):
    llama = configs("llama")
    assert llama.moe is None
    check_ep_size("tiny-llama", llama, 1)
    with pytest.raises(UnsupportedModelError) as refused:
        check_ep_size("tiny-llama", llama, 2)
    message = str(refused.value)
    assert message.startswith("model 'tiny-llama' (LlamaForCausalLM) has no experts: ")
    assert message.endswith("run it with ep_size 1")


def test_num_ranks_is_the_tp_or_the_ep_size():
    assert EngineConfig().num_ranks == 1
    assert EngineConfig(ep_size=4).num_ranks == 4
    assert EngineConfig(tp_size=3).num_ranks == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"ep_size": 0}, "ep_size: must be >= 1, got 0"),
        ({"tp_size": 2, "ep_size": 2}, "ep_size: a replica is tensor-parallel or expert-parallel, not both (tp_size 2, ep_size 2)"),
    ],
)
def test_engine_config_refuses_ep_with_tp(overrides, message):
    with pytest.raises(ValueError) as refused:
        EngineConfig(**overrides)
    assert str(refused.value).startswith(message)


def test_ep_alone_and_tp_alone_with_ep_1_are_accepted_with_the_kv_tiers():
    assert EngineConfig(ep_size=2, tp_size=1).ep_size == 2
    assert EngineConfig(tp_size=2, ep_size=1).tp_size == 2
    tiered = EngineConfig(ep_size=2, cpu_kv_cache_bytes=1 << 20, redis_url="redis://localhost:6379/0")  # each rank spills its own blocks
    assert (tiered.cpu_kv_cache_bytes, tiered.redis_url) == (1 << 20, "redis://localhost:6379/0")
