"""The bundled real model, SmolLM2-135M-Instruct, through the engine."""

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams
from tests.unit.engine.helpers import run_staggered, transformers_greedy

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engines(smollm2_dir, smollm2_cache_dir):
    return {
        kv: LLMEngine(EngineConfig(model="smollm2-135m", weights="fp32", kv_dtype=kv, kv_cache_bytes=64 << 20, cache_dir=smollm2_cache_dir))
        for kv in ("fp32", "fp8_e4m3")
    }


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8_e4m3"])
def test_answers_paris(engines, kv_dtype):
    engine = engines[kv_dtype]
    engine.add_request("q", messages=QUESTION, params=SamplingParams(max_tokens=32, temperature=0))
    [out] = engine.run_to_completion(["q"])
    assert "Paris" in out.text
    assert out.finish_reason.value == "stop"
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


def test_greedy_tokens_identical_to_transformers(engines, smollm2_dir):
    engine = engines["fp32"]
    texts = [
        "The three primary colors are",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    ]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expected = transformers_greedy(smollm2_dir, prompts, params.max_tokens)
    assert run_staggered(engine, prompts, params, every=1) == expected
