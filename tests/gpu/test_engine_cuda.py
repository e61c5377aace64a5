"""The whole engine on CUDA: weights and the KV pool in GPU memory, decode attention in the Triton
kernel, continuous batching of staggered requests (chunked prefills beside decodes).

Each token the engine decodes is checked against transformers on the same GPU, teacher-forced
over the engine's own output: the engine's token must be transformers' argmax, or within a hair
of it where two logits tie to rounding. A wrong block, scale or position makes the tokens
unrelated to the model's, far outside these bounds: the tiny model's logits spread about 0.16
(one standard deviation), so a token picked at random falls ~0.3 short of the best, while the
Triton path on CPU (tests/unit/engine/test_device_path.py's) fell at most 0.004 short with FP8 KV.
"""

import pytest
import torch

from engine.params import SamplingParams
from tests.unit.engine.helpers import GREEDY, make_engine, random_prompts, run_staggered

pytestmark = pytest.mark.gpu

PROMPTS = random_prompts(lengths=(1, 5, 16, 17, 33, 70, 100))


def logit_deficits(model_dir, dtype: torch.dtype, prompts: list[list[int]], outputs: list[tuple[int, ...]]) -> torch.Tensor:
    """Per output token: transformers' best logit minus the logit of the token the engine chose."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    deficits = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt + list(out)], device="cuda")
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            chosen = logits.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
            deficits.append(logits.max(dim=1).values - chosen)
    return torch.cat(deficits).cpu()


@pytest.mark.parametrize(
    "dtype, weights, kv_dtype, tie, typical",
    [
        (torch.float32, "fp32", "fp32", 1e-3, 1e-4),
        (torch.float32, "fp32", "fp8_e4m3", 0.02, 0.003),
        (torch.bfloat16, "bf16", "bf16", 0.02, 0.003),
        (torch.bfloat16, "bf16", "fp8_e4m3", 0.02, 0.003),
    ],
)
def test_the_engine_on_cuda_decodes_transformers_tokens(tiny_llama_dir, dtype, weights, kv_dtype, tie, typical):
    engine = make_engine(tiny_llama_dir, device="cuda", dtype=str(dtype).removeprefix("torch."), weights=weights, kv_dtype=kv_dtype)
    assert engine.kv_cache.buffer.is_cuda and engine.kv_cache.triton_decode
    assert next(engine.runner.model.parameters()).is_cuda
    outputs = run_staggered(engine, PROMPTS, GREEDY)
    assert [len(o) for o in outputs] == [GREEDY.max_tokens] * len(PROMPTS)
    assert engine.pool.num_free_blocks == engine.kv_cache.num_blocks  # every block back
    deficits = logit_deficits(tiny_llama_dir, dtype, PROMPTS, outputs)
    assert deficits.max() <= tie, f"a token {deficits.max():.4f} below transformers' best"
    assert deficits.mean() <= typical


def test_sampled_tokens_on_cuda_are_the_cpu_engines(tiny_llama_dir):
    """Seeded sampling draws on the CPU from the same probabilities: the GPU engine's sampled
    tokens are the CPU engine's (fp32, where the two devices' logits agree to ~1e-5)."""
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
    prompts = PROMPTS[:3]
    on_cpu = run_staggered(make_engine(tiny_llama_dir), prompts, params)
    on_cuda = run_staggered(make_engine(tiny_llama_dir, device="cuda", weights="fp32"), prompts, params)
    assert on_cuda == on_cpu
