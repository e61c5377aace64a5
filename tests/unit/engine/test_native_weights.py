"""The bundled SmolLM2 GGUF run at its shipped precision (``weights="native"``, the default):
its Q4_1 projections on the int4 kernel, its Q8_0 (tied) LM head as per-row int8, and greedy
output that agrees with the float32 dequantization of the same file."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from engine.quant.apply import linear_layers

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def engine(smollm2_cache_dir, weights: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model="smollm2-135m", weights=weights, kv_cache_bytes=16 << 20, cache_dir=smollm2_cache_dir))


def test_native_weights_run_the_gguf_blocks_and_agree_with_fp32(smollm2_dir, smollm2_cache_dir):
    native = engine(smollm2_cache_dir, "native")
    kinds = {name: module.quantized.kind for name, module in linear_layers(native.runner.model)}
    assert kinds.pop("lm_head") == "int8"
    assert set(kinds.values()) == {"int4"} and len(kinds) == 4 * 30
    [got] = native.generate([PROMPT], GREEDY)
    del native
    [expected] = engine(smollm2_cache_dir, "fp32").generate([PROMPT], GREEDY)
    assert "Paris" in got.text
    agree = next((i for i, (a, b) in enumerate(zip(got.output_token_ids, expected.output_token_ids)) if a != b), GREEDY.max_tokens)
    assert agree >= 8, (got.text, expected.text)
