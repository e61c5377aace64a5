"""The device path's launch budget: what one decode layer launches besides its matrix products.

Before the fused kernels a decode layer on a GPU dispatched 53-58 torch ops (bench/README's H100
rows); the budget now is the five Triton kernels below, six when attention splits its context.
Any op that creeps back into the layer fails these tests by name.
"""

import pytest
import torch

from engine.device_path import count_decode_layer_launches
from engine.graphs import DecodeGraphs
from tests.unit.engine.helpers import make_engine

FUSED = {"add_rms_norm": 2, "rope_write_kv": 1, "paged_decode_attention": 1, "silu_and_mul": 1}


ON_CUDA = dict(device="cuda", weights="fp32") if torch.cuda.is_available() else {}
"""On a GPU host the engine runs there; here its pool is on CPU, in Triton's interpreter."""


def _graphs(model_dir, **overrides) -> DecodeGraphs:
    engine = make_engine(model_dir, **ON_CUDA, **overrides)
    engine.kv_cache.triton_decode = True
    return DecodeGraphs(engine.runner.model, engine.kv_cache, 8, 4)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8_e4m3"])
def test_a_decode_layer_launches_five_kernels_besides_its_four_matmuls(tiny_llama_dir, kv_dtype):
    launches = count_decode_layer_launches(_graphs(tiny_llama_dir, kv_dtype=kv_dtype), num_decodes=3, num_splits=1)
    assert launches.triton == FUSED
    assert launches.torch_ops == {}
    assert sum(launches.gemms.values()) == 4  # qkv, o, gate_up, down (aten.linear on CPU, aten.mm on CUDA)
    assert launches.num_launches == 5


def test_a_split_context_adds_one_combine_launch(tiny_llama_dir):
    launches = count_decode_layer_launches(_graphs(tiny_llama_dir), num_decodes=1, num_splits=2)
    assert launches.triton == {**FUSED, "paged_decode_combine": 1}
    assert launches.num_launches == 6


def test_the_count_sees_torch_ops_in_the_layer(tiny_llama_dir, monkeypatch):
    """The counter is not blind: an extra torch op in the MLP shows up by name."""
    from engine.layers import mlp

    forward = mlp.GatedMLP.forward
    monkeypatch.setattr(mlp.GatedMLP, "forward", lambda self, x, fused=False: forward(self, x, fused) * 1.0)
    launches = count_decode_layer_launches(_graphs(tiny_llama_dir), num_decodes=1, num_splits=1)
    assert launches.torch_ops == {"aten.mul": 1}
    assert launches.num_launches == 6
    assert torch.is_inference_mode_enabled() is False
