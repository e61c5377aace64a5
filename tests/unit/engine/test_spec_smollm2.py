"""Speculative decoding on the bundled real model: n-gram drafts on an answer that copies its
prompt give the same greedy tokens as plain decoding, with most drafts accepted."""

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.params import SamplingParams

pytestmark = pytest.mark.slow

EDIT = [
    {
        "role": "user",
        "content": "Rewrite this text exactly, correcting any typos:\n\nThe old lighthouse stood at the edge of the cliff for "
        "more then two hundred years. Every night its keeper climbed the narow stairs and lit the lamp.",
    }
]


def test_ngram_greedy_equals_plain_decoding_on_a_copying_answer(smollm2_dir, smollm2_cache_dir):
    params = SamplingParams(max_tokens=32, temperature=0)
    engine = LLMEngine(EngineConfig(model="smollm2-135m", weights="fp32", kv_dtype="fp32", kv_cache_bytes=32 << 20, cache_dir=smollm2_cache_dir, speculative="ngram"))
    speculator, outputs = engine.scheduler.speculator, {}
    for spec in ("off", "ngram"):
        engine.scheduler.speculator = speculator if spec == "ngram" else None  # one model load for both runs
        engine.reset_prefix_cache()
        engine.add_request(spec, messages=EDIT, params=params)
        [outputs[spec]] = engine.run_to_completion([spec])
        stats = engine.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert outputs["ngram"].output_token_ids == outputs["off"].output_token_ids
    assert "lighthouse stood at the edge of the cliff" in outputs["ngram"].text
    assert stats.num_accepted_draft_tokens >= 0.6 * stats.num_draft_tokens > 0
