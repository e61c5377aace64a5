"""The Triton paged prefill kernel, run by Triton's interpreter on CPU: against its torch reference and SDPA.

Each sequence's whole context (cached prefix and the chunk's own tokens) is written through the
engine's ``PagedKVCache.write`` first, as the GPU path does before attending; a chunk then
attends over it causally from its start position.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.launches import LaunchCounter
from engine.kernels.paged_prefill import paged_prefill_attention, reference_paged_prefill_attention
from engine.kv_cache import PagedKVCache
from kv_store.layout import KVBlockLayout
from tests.triton_compile import empty_pool, hopper_resources

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
HEAD_DIM = 32
NUM_LAYERS = 2
NUM_BLOCKS = 24
CHUNKS = ((0, 20), (37, 11), (100, 30))
"""(start, query tokens): a whole prompt from 0; a chunk starting mid-block after a cached
prefix of 37; one whose 130 keys take three 64-key tiles, behind a 100-token prefix."""
TOLERANCE = 1e-5 if DEVICE == "cpu" else 1e-4


def filled_cache(kv_dtype: str, num_kv_heads: int, chunks=CHUNKS, seed: int = 0) -> tuple[PagedKVCache, torch.Tensor]:
    """One sequence per chunk, its ``start + n`` tokens of random K/V written in 9-token steps; returns (cache, block_tables)."""
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(KVBlockLayout(NUM_LAYERS, num_kv_heads, HEAD_DIM, BLOCK_SIZE, kv_dtype), NUM_BLOCKS, torch.float32)
    lengths = [start + n for start, n in chunks]
    width = -(-max(lengths) // BLOCK_SIZE)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = torch.zeros(len(chunks), width, dtype=torch.int32)
    for row, length in enumerate(lengths):
        own = [free.pop() for _ in range(-(-length // BLOCK_SIZE))]
        tables[row] = torch.tensor(own + own[:1] * (width - len(own)))
        for pos in torch.arange(length).split(9):
            k = torch.randn(len(pos), NUM_LAYERS, num_kv_heads, HEAD_DIM, generator=g) * 2
            v = torch.randn(len(pos), NUM_LAYERS, num_kv_heads, HEAD_DIM, generator=g)
            cache.write(k, v, torch.tensor([own[p // BLOCK_SIZE] for p in pos.tolist()], dtype=torch.long), pos % BLOCK_SIZE)
    return cache, tables


def chunk_args(chunks=CHUNKS) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(starts, query_starts, max_query_len) of ``chunks``."""
    lens = [n for _, n in chunks]
    query_starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return torch.tensor([s for s, _ in chunks], dtype=torch.int32), query_starts, max(lens)


def random_queries(num_tokens: int, num_heads: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_tokens, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def kernel(q, cache: PagedKVCache, layer: int, tables, chunks=CHUNKS, **kwargs) -> torch.Tensor:
    starts, query_starts, max_len = chunk_args(chunks)
    q, pool, tables, starts, query_starts = (t.to(DEVICE) for t in (q, cache.buffer, tables, starts, query_starts))
    return paged_prefill_attention(q, pool, cache.layout, layer, tables, starts, query_starts, max_len, **kwargs).cpu()


def sdpa_over_gathered(q, cache: PagedKVCache, layer: int, tables, chunks=CHUNKS) -> torch.Tensor:
    """The engine's own gather (``PagedKVCache.gather``) and SDPA with GQA, chunk by chunk."""
    keys, values = cache.gather(layer, tables.long())  # [chunks, kv_heads, width * block_size, head_dim]
    outs, first = [], 0
    for row, (start, n) in enumerate(chunks):
        mask = torch.arange(keys.shape[2])[None, :] <= torch.arange(start, start + n)[:, None]
        query = q[first : first + n].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(query, keys[row : row + 1], values[row : row + 1], attn_mask=mask, enable_gqa=True)
        outs.append(out.squeeze(0).transpose(0, 1))
        first += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    ("kv_dtype", "num_kv_heads", "group", "native_fp8"),
    [
        ("fp8_e4m3", 2, 4, True),
        ("fp8_e4m3", 1, 3, False),  # a group that is not a power of two; e4m3 widened by moving bits
        ("bf16", 2, 1, True),
        ("fp32", 1, 8, True),
    ],
)
def test_kernel_equals_reference_and_sdpa_over_gathered_blocks(kv_dtype, num_kv_heads, group, native_fp8):
    cache, tables = filled_cache(kv_dtype, num_kv_heads)
    q = random_queries(sum(n for _, n in CHUNKS), num_kv_heads * group)
    starts, query_starts, _ = chunk_args()
    for layer in range(NUM_LAYERS):
        got = kernel(q, cache, layer, tables, native_fp8=native_fp8)
        expected = reference_paged_prefill_attention(q, cache.buffer, cache.layout, layer, tables, starts, query_starts)
        torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)
        torch.testing.assert_close(got, sdpa_over_gathered(q, cache, layer, tables), rtol=TOLERANCE, atol=TOLERANCE)


def test_a_chunk_from_position_0_is_causal_attention_over_its_own_tokens():
    """With no prefix, the chunk's output is SDPA's ``is_causal`` over its own K/V."""
    cache, tables = filled_cache("fp32", 2, chunks=((0, 40),))
    q = random_queries(40, 4)
    keys, values = cache.gather(0, tables.long())
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys[:, :, :40], values[:, :, :40], is_causal=True, enable_gqa=True
    ).squeeze(0).transpose(0, 1)
    torch.testing.assert_close(kernel(q, cache, 0, tables, chunks=((0, 40),)), expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_an_empty_chunk_between_others_changes_nothing():
    chunks = ((37, 11), (5, 0), (100, 30))
    cache, tables = filled_cache("fp8_e4m3", 2, chunks=chunks)
    q = random_queries(41, 4)
    got = kernel(q, cache, 1, tables, chunks=chunks)
    torch.testing.assert_close(got, sdpa_over_gathered(q, cache, 1, tables, chunks=chunks), rtol=TOLERANCE, atol=TOLERANCE)


def test_queries_are_read_in_place_from_a_strided_view():
    cache, tables = filled_cache("bf16", 2)
    qkv = torch.randn(sum(n for _, n in CHUNKS), 4 + 2 * 2, HEAD_DIM)
    q = qkv[:, :4]
    assert not q.is_contiguous()
    torch.testing.assert_close(kernel(q, cache, 1, tables), kernel(q.contiguous(), cache, 1, tables), rtol=0, atol=0)


def test_bfloat16_queries_give_bfloat16_output_near_the_reference():
    cache, tables = filled_cache("fp8_e4m3", 2)
    q = random_queries(sum(n for _, n in CHUNKS), 8).bfloat16()
    starts, query_starts, _ = chunk_args()
    got = kernel(q, cache, 0, tables)
    expected = reference_paged_prefill_attention(q, cache.buffer, cache.layout, 0, tables, starts, query_starts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_keys_after_a_query_are_never_read():
    """Bytes past a query's position must not change its row: positions 41..47 (slots 9.. of the
    third block) are overwritten, and a chunk of the first 4 queries (37..40) gives the rows it gave before."""
    cache, tables = filled_cache("fp8_e4m3", 2, chunks=((37, 11),))
    q = random_queries(11, 4)
    before = kernel(q, cache, 0, tables, chunks=((37, 11),))
    cache.payload[tables[0, 2], :, :, :, 9:] = 7.0
    shorter = kernel(q[:4], cache, 0, tables, chunks=((37, 4),))
    torch.testing.assert_close(shorter, before[:4], rtol=0, atol=0)


def test_one_launch_per_call():
    cache, tables = filled_cache("fp8_e4m3", 1)
    with LaunchCounter() as counted:
        kernel(random_queries(sum(n for _, n in CHUNKS), 2), cache, 0, tables)
    assert counted == Counter({"paged_prefill_attention": 1})


def test_bad_inputs_are_refused_by_name():
    cache, tables = filled_cache("fp8_e4m3", 2)
    layout, pool = cache.layout, cache.buffer
    starts, query_starts, max_len = chunk_args()
    q = random_queries(61, 4)
    with pytest.raises(ValueError, match="query_starts: must rise from 0 to 60"):
        paged_prefill_attention(q[:60], pool, layout, 0, tables, starts, query_starts, max_len)
    with pytest.raises(ValueError, match="query_starts: expected \\[4\\]"):
        paged_prefill_attention(q, pool, layout, 0, tables, starts, query_starts[:-1], max_len)
    with pytest.raises(ValueError, match="max_query_len: 29 is shorter than the longest chunk \\(30 tokens\\)"):
        paged_prefill_attention(q, pool, layout, 0, tables, starts, query_starts, 29)
    with pytest.raises(ValueError, match="starts: every chunk must lie in \\[0, 144\\]"):
        paged_prefill_attention(q, pool, layout, 0, tables, starts + 20, query_starts, max_len)
    with pytest.raises(ValueError, match="query heads"):
        paged_prefill_attention(random_queries(61, 3), pool, layout, 0, tables, starts, query_starts, max_len)
    with pytest.raises(ValueError, match="layer"):
        paged_prefill_attention(q, pool, layout, 2, tables, starts, query_starts, max_len)
    with pytest.raises(ValueError, match="block_tables: expected"):
        paged_prefill_attention(q, pool, layout, 0, tables[:2], starts, query_starts, max_len)


@pytest.mark.slow
def test_the_prefill_launches_compile_for_hopper_without_spilling(monkeypatch):
    """As the decode kernel's test: bf16 queries, and float32 on a float32 pool."""
    chunks = ((0, 100), (300, 60))
    starts, query_starts, max_len = chunk_args(chunks)
    tables = torch.zeros(2, 24, dtype=torch.int32)
    (fp8, fp8_layout), (bf16, bf16_layout), (fp32, fp32_layout) = (empty_pool(kv) for kv in ("fp8_e4m3", "bf16", "fp32"))
    q = torch.randn(160, 32, 128)

    def calls():
        paged_prefill_attention(q.bfloat16(), fp8, fp8_layout, 1, tables, starts, query_starts, max_len)
        paged_prefill_attention(q.bfloat16(), bf16, bf16_layout, 1, tables, starts, query_starts, max_len)
        paged_prefill_attention(q, fp32, fp32_layout, 1, tables, starts, query_starts, max_len)  # float32: IEEE dots

    resources = hopper_resources(monkeypatch, calls)
    assert [r.kernel for r in resources] == ["_paged_prefill_kernel"] * 3
    assert all(r.spill_bytes == 0 for r in resources), resources
