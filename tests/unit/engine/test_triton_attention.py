"""The Triton paged-attention decode kernel, run by Triton's interpreter on CPU, against the torch reference.

Pools are filled through the engine's own ``PagedKVCache.write`` (real byte layout, real FP8
requantization of growing blocks), and the reference is also checked against the engine's
attention path, so the three agree on the same bytes.
"""

from collections import Counter

import pytest
import torch

from engine.kernels.launches import LaunchCounter
from engine.kernels.paged_attention import paged_decode_attention, reference_paged_decode_attention
from engine.kv_cache import PagedKVCache
from engine.layers.attention import DecodeGroup, PagedAttention
from engine.parallel.group import TPGroup
from engine.parallel.sharding import TPShard
from kv_store.layout import KVBlockLayout
from tests.triton_compile import empty_pool, hopper_resources
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
NUM_BLOCKS = 20
CONTEXT_LENS = (1, 16, 37, 150)
"""One token; exactly one full block; two full blocks and a partial one; ten blocks, so a tile
of 16 or 32 tokens takes many iterations and ends in a partial tail."""
TOLERANCE = 1e-5 if DEVICE == "cpu" else 1e-4  # GPU exp is an approximation


def filled_cache(kv_dtype: str, num_kv_heads: int, context_lens=CONTEXT_LENS, seed: int = 0) -> tuple[PagedKVCache, torch.Tensor]:
    """A pool holding random K/V for each sequence, written in 7-token steps; returns (cache, block_tables).

    A row of length 0 gets a table of one block no sequence uses.
    """
    g = torch.Generator().manual_seed(seed)
    layout = KVBlockLayout(NUM_LAYERS, num_kv_heads, HEAD_DIM, BLOCK_SIZE, kv_dtype)
    cache = PagedKVCache(layout, NUM_BLOCKS, torch.float32)
    width = max(1, -(-max(context_lens) // BLOCK_SIZE))
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()  # scattered, out-of-order block ids
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    for row, length in enumerate(context_lens):
        own = [free.pop() for _ in range(max(1, -(-length // BLOCK_SIZE)))]
        tables[row] = torch.tensor(own + own[:1] * (width - len(own)))
        for pos in torch.arange(length).split(7):  # blocks grow across writes: FP8 blocks are requantized as in decode
            k = torch.randn(len(pos), NUM_LAYERS, num_kv_heads, HEAD_DIM, generator=g) * 2
            v = torch.randn(len(pos), NUM_LAYERS, num_kv_heads, HEAD_DIM, generator=g)
            cache.write(k, v, torch.tensor([own[p // BLOCK_SIZE] for p in pos.tolist()], dtype=torch.long), pos % BLOCK_SIZE)
    return cache, tables


def random_queries(batch: int, num_heads: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("kv_dtype", "num_kv_heads", "group", "num_splits", "native_fp8", "tile_tokens"),
    [
        ("fp8_e4m3", 2, 1, 1, True, None),
        ("fp8_e4m3", 2, 2, 2, False, 16),  # e4m3 widened by moving bits, as on GPUs before sm_89
        ("fp8_e4m3", 1, 3, 1, True, 16),  # a group that is not a power of two
        ("fp8_e4m3", 2, 4, 3, True, 32),
        ("fp8_e4m3", 1, 8, 1, False, None),
        ("bf16", 2, 3, 2, True, 16),
        ("bf16", 1, 4, 1, True, None),
        ("fp32", 1, 3, 3, True, 16),
        ("fp32", 2, 8, 1, True, 32),
    ],
)
def test_kernel_equals_reference(kv_dtype, num_kv_heads, group, num_splits, native_fp8, tile_tokens):
    cache, tables = filled_cache(kv_dtype, num_kv_heads)
    q = random_queries(len(CONTEXT_LENS), num_kv_heads * group)
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    for layer in range(NUM_LAYERS):
        got = kernel(q, cache, layer, tables, lens, num_splits=num_splits, native_fp8=native_fp8, tile_tokens=tile_tokens)
        expected = reference_paged_decode_attention(q, cache.buffer, cache.layout, layer, tables, lens)
        # Both widen the same codes exactly; only the order of float32 sums differs.
        torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize(("kv_dtype", "num_splits"), [("fp8_e4m3", 1), ("bf16", 3)])
def test_bfloat16_queries_give_bfloat16_output_near_the_reference(kv_dtype, num_splits):
    """The engine's GPU dtype: dots in bf16 on a GPU (in float32 under the interpreter), output in bf16."""
    cache, tables = filled_cache(kv_dtype, 2)
    q = random_queries(len(CONTEXT_LENS), 8).bfloat16()
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    got = kernel(q, cache, 1, tables, lens, num_splits=num_splits, tile_tokens=32)
    expected = reference_paged_decode_attention(q, cache.buffer, cache.layout, 1, tables, lens)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 2, 10])
def test_zero_length_rows_give_zeros_and_leave_the_others_alone(num_splits):
    """Padding rows of a graphed batch: context 0, their table on a block of NaNs that they must not read."""
    lens = (0, 37, 0, 150)
    cache, tables = filled_cache("fp32", 2, context_lens=lens)
    for row in (0, 2):
        cache.payload[tables[row, 0]] = float("nan")
    q = random_queries(len(lens), 4)
    lens = torch.tensor(lens, dtype=torch.int32)
    got = kernel(q, cache, 0, tables, lens, num_splits=num_splits, tile_tokens=16)
    assert torch.equal(got[[0, 2]], torch.zeros(2, 4, HEAD_DIM))
    expected = reference_paged_decode_attention(q, cache.buffer, cache.layout, 0, tables, lens)
    torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_batch_of_only_padding_rows_gives_zeros():
    cache, tables = filled_cache("fp8_e4m3", 1, context_lens=(0, 0))
    got = kernel(random_queries(2, 3), cache, 0, tables, torch.zeros(2, dtype=torch.int32), num_splits=1)
    assert torch.equal(got, torch.zeros(2, 3, HEAD_DIM))


def test_more_splits_than_tiles_leave_the_empty_splits_out():
    """37 tokens are one 64-token tile; splits 2 and 3 see nothing and weigh nothing in the combine."""
    cache, tables = filled_cache("fp8_e4m3", 2, context_lens=(37, 20, 5))
    q = random_queries(3, 4)
    lens = torch.tensor((37, 20, 5), dtype=torch.int32)
    got = kernel(q, cache, 1, tables, lens, num_splits=3, tile_tokens=64)
    expected = reference_paged_decode_attention(q, cache.buffer, cache.layout, 1, tables, lens)
    torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)


def test_the_combine_merges_more_splits_than_it_loads_at_once():
    """19 splits of 16 tokens: the combine kernel walks them 16 at a time, with a padding row beside."""
    lens = (300, 0)
    cache, tables = filled_cache("bf16", 1, context_lens=lens)
    q = random_queries(2, 2)
    lens = torch.tensor(lens, dtype=torch.int32)
    got = kernel(q, cache, 1, tables, lens, num_splits=19, tile_tokens=16)
    expected = reference_paged_decode_attention(q, cache.buffer, cache.layout, 1, tables, lens)
    torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize(("num_splits", "launches"), [(1, {"paged_decode_attention": 1}), (2, {"paged_decode_attention": 1, "paged_decode_combine": 1})])
def test_a_call_launches_one_kernel_and_one_combine_when_split(num_splits, launches):
    cache, tables = filled_cache("fp8_e4m3", 1, context_lens=(20,))
    with LaunchCounter() as counted:
        kernel(random_queries(1, 2), cache, 0, tables, torch.tensor([20], dtype=torch.int32), num_splits=num_splits)
    assert counted == Counter(launches)


def test_queries_are_read_in_place_from_a_strided_view():
    """q as the engine has it: the query heads of the QKV projection's output, a view with the K/V
    heads between its rows. The kernel reads it with its strides and writes a contiguous output."""
    cache, tables = filled_cache("fp8_e4m3", 2)
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    qkv = torch.randn(len(CONTEXT_LENS), 4 + 2 * 2, HEAD_DIM)
    q = qkv[:, :4]
    assert not q.is_contiguous()
    got = kernel(q, cache, 0, tables, lens, num_splits=2)
    assert got.is_contiguous()
    torch.testing.assert_close(got, kernel(q.contiguous(), cache, 0, tables, lens, num_splits=2), rtol=0, atol=0)


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
    before = kernel(q, cache, 0, tables, lens, tile_tokens=32)
    last_block = tables[2, 2]
    cache.payload[last_block, :, :, :, 5:] = cache.payload[last_block, :, :, :, :1].expand_as(cache.payload[last_block, :, :, :, 5:])
    after = kernel(q, cache, 0, tables, lens, tile_tokens=32)
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
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="context_lens: every length must be in \\[0, 32\\]"):
        paged_decode_attention(q, cache.buffer, cache.layout, 0, tables, torch.tensor([33], dtype=torch.int32))
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, cache.buffer, cache.layout, 0, tables, torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(ValueError, match="query heads"):
        paged_decode_attention(random_queries(1, 3), cache.buffer, cache.layout, 0, tables, lens)
    with pytest.raises(ValueError, match="layer"):
        paged_decode_attention(q, cache.buffer, cache.layout, 2, tables, lens)
    with pytest.raises(ValueError, match="num_splits: must be in \\[1, 2\\]"):
        paged_decode_attention(q, cache.buffer, cache.layout, 0, tables, lens, num_splits=3)
    for tile in (8, 24):
        with pytest.raises(ValueError, match=f"tile_tokens: must be a power of two >= 16, got {tile}"):
            paged_decode_attention(q, cache.buffer, cache.layout, 0, tables, lens, tile_tokens=tile)
    with pytest.raises(ValueError, match="block_tables: block ids"):
        paged_decode_attention(q, cache.buffer, cache.layout, 0, tables + NUM_BLOCKS, lens)


# --- Compiled for sm_90 without a GPU -------------------------------------------------------
# The interpreter runs the kernels' arithmetic, not Triton's compiler: each launch the wrapper
# would make on a Hopper GPU is captured and compiled for sm_90a (tests/triton_compile.py).


@pytest.mark.slow
def test_the_decode_launches_compile_for_hopper_without_spilling(monkeypatch):
    """The engine's launches (bf16 queries) and float32 on float32. Float32 queries on FP8 or bf16
    pools (GPU tests only) do spill: the widened tile in the FMA dot's layout takes 255 registers."""
    (fp8, fp8_layout), (bf16, bf16_layout), (fp32, fp32_layout) = (empty_pool(kv) for kv in ("fp8_e4m3", "bf16", "fp32"))
    tables, lens = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([60, 20], dtype=torch.int32)
    q = torch.randn(2, 32, 128)

    def calls():
        paged_decode_attention(q.bfloat16(), fp8, fp8_layout, 1, tables, lens, num_splits=2)  # decode and combine
        paged_decode_attention(q.bfloat16(), fp8, fp8_layout, 1, tables, lens, num_splits=1, native_fp8=False)
        paged_decode_attention(q.bfloat16(), bf16, bf16_layout, 1, tables, lens, num_splits=1)
        paged_decode_attention(q, fp32, fp32_layout, 1, tables, lens, num_splits=1)  # float32: IEEE dots

    resources = hopper_resources(monkeypatch, calls)
    assert [r.kernel for r in resources] == ["_paged_decode_kernel", "_combine_kernel"] + ["_paged_decode_kernel"] * 3
    assert all(r.spill_bytes == 0 for r in resources), resources


@pytest.mark.parametrize("num_splits", [2, 5])
def test_splits_share_each_rows_own_context_in_a_table_wider_than_it(num_splits):
    """A CUDA graph's tables are as wide as the longest sequence allowed: here 20 blocks for
    contexts of 1 to 150 tokens. Every split takes a share of its row's context, so the output
    is the reference's however few of the table's blocks a row fills."""
    cache, tables = filled_cache("fp8_e4m3", 2)
    wide = torch.cat([tables, tables[:, :1].expand(-1, NUM_BLOCKS - tables.shape[1])], dim=1)
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    q = random_queries(len(CONTEXT_LENS), 4)
    want = reference_paged_decode_attention(q, cache.buffer, cache.layout, 1, wide, lens)
    got = kernel(q, cache, 1, wide, lens, num_splits=num_splits, tile_tokens=16)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
