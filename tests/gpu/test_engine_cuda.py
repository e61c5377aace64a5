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


def test_graphed_decode_steps_give_the_eager_steps_tokens_on_cuda(tiny_llama_dir):
    """CUDA graphs captured per bucket (1, 2, 4, 8) against the same engine with enforce_eager:
    greedy and seeded sampled requests give the same tokens (the device sampler runs in both)."""
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
    graphed = make_engine(tiny_llama_dir, device="cuda", weights="fp32", graph_max_batch=8)
    eager = make_engine(tiny_llama_dir, device="cuda", weights="fp32", enforce_eager=True)
    assert sorted(graphed.runner.graphs.graphs) == [1, 2, 4, 8] and eager.runner.graphs is None
    for params in (GREEDY, sampled):
        assert run_staggered(graphed, PROMPTS, params) == run_staggered(eager, PROMPTS, params)
    assert graphed.runner.num_graph_steps > 0
    assert graphed.pool.num_free_blocks == graphed.kv_cache.num_blocks


def test_the_device_samplers_hash_is_the_cpus(tiny_llama_dir):
    from engine.device_sampler import row_keys, uniforms

    seeds, positions = torch.tensor([0, 1, 2**40 + 3]), torch.tensor([0, 5, 7])
    on_cpu = uniforms(row_keys(seeds, positions), 4096)
    on_cuda = uniforms(row_keys(seeds.cuda(), positions.cuda()), 4096).cpu()
    assert torch.equal(on_cuda, on_cpu)


def test_a_pool_larger_than_the_gpu_is_refused_at_start_up(tiny_llama_dir):
    free, total = torch.cuda.mem_get_info()
    with pytest.raises(ValueError, match=r"kv_cache_bytes: a KV pool of \d+ blocks .* was asked for on cuda, which has .* GiB free of"):
        make_engine(tiny_llama_dir, device="cuda", weights="fp32", num_kv_blocks=None, kv_cache_bytes=2 * total)
