"""The engine's logits equal transformers' on every mixture-of-experts architecture (fp32, 1e-4)."""

import pytest
import torch

from engine.step_plan import PlannedChunk, StepPlan
from tests.unit.engine.helpers import make_engine, random_prompts


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "qwen3-moe"])
def test_every_position_logits_within_1e_4_of_transformers(tiny_checkpoint, name):
    import transformers

    model_dir = tiny_checkpoint(name)
    [prompt] = random_prompts([40])
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]

    engine = make_engine(model_dir)
    block_size = engine.config.block_size
    blocks = engine.pool.allocate(-(-len(prompt) // block_size))
    chunk = PlannedChunk(start=0, num_tokens=len(prompt), token_ids=tuple(prompt), block_ids=tuple(blocks))
    got = engine.runner.run(StepPlan(decodes=(), prefills=(chunk,), sample_rows=tuple(range(len(prompt)))))

    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert int(engine.runner.model.expert_tokens().sum()) == len(prompt) * engine.model_config.num_layers * engine.model_config.moe.num_experts_per_tok
