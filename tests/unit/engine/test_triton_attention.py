"""The Triton paged-attention decode kernel, run by Triton's interpreter on CPU, against the torch reference.

Pools are filled through the engine's own ``PagedKVCache.write`` (real byte layout, real FP8
requantization of growing blocks), and the reference is also checked against the engine's
attention path, so the three agree on the same bytes.
"""

import pytest
import torch

from engine.kernels.paged_attention import paged_decode_attention, reference_paged_decode_attention
from engine.kv_cache import PagedKVCache
from engine.layers.attention import DecodeGroup, PagedAttention
from engine.parallel.group import TPGroup
from engine.parallel.sharding import TPShard
from kv_store.layout import KVBlockLayout
from tests.unit.engine.helpers import attention_model_config

# On CPU the kernels run in Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1
# before anything imports Triton (it is read once, at that import). On a CUDA host they
# compile and run on the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel(q, cache: PagedKVCache, layer: int, tables, lens, **kwargs) -> torch.Tensor:
    """The kernel on DEVICE, its output back on CPU."""
    q, pool, tables, lens = (t.to(DEVICE) for t in (q, cache.buffer, tables, lens))
    return paged_decode_attention(q, pool, cache.layout, layer, tables, lens, **kwargs).cpu()


BLOCK_SIZE = 16
HEAD_DIM = 64
NUM_LAYERS = 2
NUM_BLOCKS = 12
CONTEXT_LENS = (1, 16, 37)  # one token; exactly one full block; two full blocks and a partial one
TOLERANCE = 1e-5 if DEVICE == "cpu" else 1e-4  # GPU exp is an approximation


def filled_cache(kv_dtype: str, num_kv_heads: int, context_lens=CONTEXT_LENS, seed: int = 0) -> tuple[PagedKVCache, torch.Tensor]:
    """A pool holding random K/V for each sequence, written in 7-token steps; returns (cache, block_tables)."""
    g = torch.Generator().manual_seed(seed)
    layout = KVBlockLayout(NUM_LAYERS, num_kv_heads, HEAD_DIM, BLOCK_SIZE, kv_dtype)
    cache = PagedKVCache(layout, NUM_BLOCKS, torch.float32)
    width = -(-max(context_lens) // BLOCK_SIZE)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()  # scattered, out-of-order block ids
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    for row, length in enumerate(context_lens):
        own = [free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        tables[row] = torch.tensor(own + own[:1] * (width - len(own)))
        positions = torch.arange(length)
        for pos in positions.split(7):  # blocks grow across writes: FP8 blocks are requantized as in decode
            k = torch.randn(len(pos), NUM_LAYERS, num_kv_heads, HEAD_DIM, generator=g) * 2
            v = torch.randn(len(pos), NUM_LAYERS, num_kv_heads, HEAD_DIM, generator=g)
            cache.write(k, v, torch.tensor([own[p // BLOCK_SIZE] for p in pos.tolist()]), pos % BLOCK_SIZE)
    return cache, tables


def random_queries(batch: int, num_heads: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("kv_dtype", "num_kv_heads", "group", "num_splits", "native_fp8"),
    [
        ("fp8_e4m3", 2, 3, 1, True),
        ("fp8_e4m3", 2, 1, 2, False),  # e4m3 widened by moving bits, as on GPUs before sm_89
        ("bf16", 2, 3, 1, True),
        ("fp32", 1, 3, 3, True),
    ],
)
def test_kernel_equals_reference(kv_dtype, num_kv_heads, group, num_splits, native_fp8):
    cache, tables = filled_cache(kv_dtype, num_kv_heads)
    q = random_queries(len(CONTEXT_LENS), num_kv_heads * group)
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    for layer in range(NUM_LAYERS):
        got = kernel(q, cache, layer, tables, lens, num_splits=num_splits, native_fp8=native_fp8)
        expected = reference_paged_decode_attention(q, cache.buffer, cache.layout, layer, tables, lens)
        # Both widen the same codes exactly; only the order of float32 sums differs.
        torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_one_token_context_returns_its_value():
    """With a single key the softmax weight is 1: the output is that token's (dequantized) V, per head."""
    cache, tables = filled_cache("fp8_e4m3", 2, context_lens=(1,))
    q = random_queries(1, 6)
    got = kernel(q, cache, 1, tables, torch.tensor([1], dtype=torch.int32))
    _, values = cache.gather(1, tables.long())
    torch.testing.assert_close(got[0], values[0, :, 0].repeat_interleave(3, dim=0), rtol=1e-6, atol=1e-6)


def test_stale_bytes_past_the_context_are_ignored():
    """Slots after a sequence's last token (and padding blocks in its table) must not leak into its output."""
    cache, tables = filled_cache("fp8_e4m3", 2)
    q = random_queries(len(CONTEXT_LENS), 4)
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    before = kernel(q, cache, 0, tables, lens)
    last_block = tables[2, 2]
    cache.payload[last_block, :, :, :, 5:] = cache.payload[last_block, :, :, :, :1].expand_as(cache.payload[last_block, :, :, :, 5:])
    after = kernel(q, cache, 0, tables, lens)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp32"])
def test_reference_equals_engine_attention(kv_dtype):
    """The engine's decode attention over the same pool gives the reference's output."""
    num_kv_heads, num_heads, layer = 2, 6, 1
    cache, tables = filled_cache(kv_dtype, num_kv_heads)
    config = attention_model_config(num_heads, num_kv_heads, HEAD_DIM, NUM_LAYERS)
    attention = PagedAttention(config, layer, TPShard(config, 0, 1), TPGroup.single())
    lens = torch.tensor(CONTEXT_LENS)
    rows, positions = torch.arange(len(lens)), lens - 1
    keys, values = cache.gather(layer, tables.long())
    # The step's own K/V are what the pool holds at its position, so the engine's patch-in is exact.
    k, v = keys[rows, :, positions], values[rows, :, positions]
    key_positions = torch.arange(tables.shape[1] * BLOCK_SIZE)
    mask = (key_positions[None, :] <= positions[:, None])[:, None, None, :]
    group = DecodeGroup(tokens=slice(0, len(lens)), rows=rows, positions=positions, block_tables=tables.long(), mask=mask)
    q = random_queries(len(lens), num_heads)
    got = attention._decode(q, k, v, group, cache)
    expected = reference_paged_decode_attention(q, cache.buffer, cache.layout, layer, tables, lens.to(torch.int32))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_by_name():
    cache, tables = filled_cache("fp8_e4m3", 2, context_lens=(20,))
    q = random_queries(1, 4)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, cache.buffer, cache.layout, 0, tables, torch.tensor([33], dtype=torch.int32))
    with pytest.raises(ValueError, match="query heads"):
        paged_decode_attention(random_queries(1, 3), cache.buffer, cache.layout, 0, tables, torch.tensor([20]))
    with pytest.raises(ValueError, match="layer"):
        paged_decode_attention(q, cache.buffer, cache.layout, 2, tables, torch.tensor([20]))
