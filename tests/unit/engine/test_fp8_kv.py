"""FP8 KV: the pool round-trips within e4m3 error and greedy decoding agrees with fp32 KV."""

import pytest
import torch

from engine.kv_cache import PagedKVCache
from engine.params import SamplingParams
from kv_store.layout import KVBlockLayout
from tests.unit.engine.helpers import make_engine, random_prompts, run_staggered

NUM_TOKENS = 32


def test_pool_write_then_gather_round_trips_and_grows_scales():
    layout = KVBlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype="fp8_e4m3")
    cache = PagedKVCache(layout, num_blocks=3, compute_dtype=torch.float32)
    torch.manual_seed(0)
    k, v = torch.randn(6, 2, 2, 8), torch.randn(6, 2, 2, 8)  # [tokens, layers, heads, dim]
    k[3] *= 100  # a later token with a larger amax must grow its block's scale, not saturate
    block_ids, offsets = torch.tensor([2, 2, 2, 2, 0, 0]), torch.tensor([0, 1, 2, 3, 0, 1])
    cache.write(k[:3], v[:3], block_ids[:3], offsets[:3])
    first_scale = cache.scales[2].clone()
    cache.write(k[3:], v[3:], block_ids[3:], offsets[3:])
    assert torch.all(cache.scales[2, :, :, 0] > first_scale[:, :, 0])
    for layer in (0, 1):
        gk, gv = cache.gather(layer, torch.tensor([[2, 0]]))  # [1, heads, 8 slots, dim]
        got_k = gk[0, :, [0, 1, 2, 3, 4, 5]].transpose(0, 1)
        got_v = gv[0, :, [0, 1, 2, 3, 4, 5]].transpose(0, 1)
        assert torch.allclose(got_k[3], k[3, layer], rtol=2**-4, atol=0)
        # re-rounded earlier tokens keep e4m3 error relative to the block's new amax
        assert (got_k[:3] - k[:3, layer]).abs().max() <= k[3, layer].abs().max() * 2**-4
        assert torch.allclose(got_v[4:], v[4:, layer], rtol=2**-4, atol=2**-9)
        assert torch.count_nonzero(gk[0, :, 6:]) == 0  # never-written slots stay zero
    assert cache.buffer.shape == (3, layout.block_bytes)


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_greedy_agreement_with_fp32_kv(tiny_checkpoint, name):
    """Teacher-forced: at each of 32 positions the fp8 engine, given the fp32 engine's tokens so
    far, picks the same next token (a free-running comparison would count one early flip 32 times)."""
    model_dir = tiny_checkpoint(name)
    prompts = random_prompts()
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    reference = run_staggered(make_engine(model_dir), prompts, params)

    fp8 = make_engine(model_dir, kv_dtype="fp8_e4m3")
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    agree = total = 0
    for prompt, ref in zip(prompts, reference):
        for i in range(NUM_TOKENS):
            fp8.add_request("q", prompt + list(ref[:i]), one)
            [out] = fp8.run_to_completion(["q"])
            agree += out.output_token_ids[0] == ref[i]
            total += 1
    assert agree / total >= 0.95
    assert fp8.stats().num_free_kv_blocks == fp8.stats().num_kv_blocks
