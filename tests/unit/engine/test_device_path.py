"""The engine's GPU path run here: layers write their K/V into the pool before attending and
decode attention reads the pool through the Triton kernel (Triton's interpreter on CPU, which
tests/conftest.py switches on). tests/gpu/test_engine_cuda.py runs the same engine on CUDA.

Also the device settings' bad input: each refused by name.
"""

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from tests.unit.engine.helpers import make_engine, random_prompts, run_staggered

PROMPTS = random_prompts(lengths=(1, 17, 40))
on_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU pool in Triton's interpreter; tests/gpu/test_engine_cuda.py runs this path on the GPU")
FEW = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _triton_engine(model_dir, **overrides) -> LLMEngine:
    engine = make_engine(model_dir, **overrides)
    engine.kv_cache.triton_decode = True
    return engine


@on_cpu_only
def test_the_triton_path_decodes_the_tokens_of_the_default_path(tiny_llama_dir):
    """fp32 KV: the pool holds exactly what the C/torch path patches in, so every token agrees;
    the prompts are prefilled in 32-token chunks, so a later chunk reads earlier ones back."""
    expected = run_staggered(make_engine(tiny_llama_dir), PROMPTS, FEW)
    engine = _triton_engine(tiny_llama_dir)
    assert run_staggered(engine, PROMPTS, FEW) == expected
    assert engine.pool.num_free_blocks == engine.kv_cache.num_blocks  # every block back


@on_cpu_only
def test_layer_by_layer_fp8_writes_store_the_bytes_of_one_write_per_step(tiny_llama_dir):
    """After the same chunked prefills, each layer writing its own slice leaves the FP8 pool,
    scales included, byte for byte as the runner's single write of every layer does. Chunks
    start at block boundaries here: a chunk that starts mid-block requantizes that block before
    attending on this path (after, on the default one), so earlier tokens may round differently."""
    settings = dict(kv_dtype="fp8_e4m3", max_num_batched_tokens=16)
    engines = [make_engine(tiny_llama_dir, **settings), _triton_engine(tiny_llama_dir, **settings)]
    for engine in engines:
        for i, prompt in enumerate(random_prompts(lengths=(16, 40, 64))):  # one at a time: chunks of 16 from position 0, none of 1 (a decode)
            engine.add_request(f"r{i}", prompt, FIRST)
            while engine.has_unfinished_requests():
                engine.step()
    default, layered = (e.kv_cache.buffer for e in engines)
    assert default.any()
    assert torch.equal(layered, default)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(device="tpu"), "device: 'tpu' is not cpu, cuda or cuda:N"),
        (dict(device="cuda", weights="native"), "weights: 'native' with dtype 'float32' does not run on cuda (supported there: dtype float32: weights fp32; dtype bfloat16: weights bf16)"),
        (dict(device="cuda:1", weights="int4"), "does not run on cuda:1"),
        (dict(device="cuda", weights="fp32", cpu_kv_cache_bytes=1 << 20), "device: cuda serves one rank without CPU/Redis KV tiers"),
    ],
)
def test_device_settings_that_cannot_run_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(**overrides)
    assert message in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_at_start_up(tiny_llama_dir):
    with pytest.raises(ValueError, match="device: 'cuda', but torch .* sees no CUDA GPU on this machine"):
        make_engine(tiny_llama_dir, device="cuda", weights="fp32")
