"""The C kernels of engine/kernels/_cpu_attention.c against the engine's torch path.

Attention: pools filled through ``PagedKVCache.write`` (real layout, FP8 blocks requantized as
they grow), compared with gather + patch + SDPA, the torch path of ``engine/layers/attention.py``.
FP8 writes: bit for bit the torch path, because blocks travel byte for byte between workers.
"""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_attention
from engine.kv_cache import PagedKVCache
from engine.layers.attention import NATIVE_MAX_CHUNK_TOKENS, DecodeGroup, PagedAttention, PrefillChunk
from engine.parallel.group import TPGroup
from engine.parallel.sharding import TPShard
from kv_store.layout import KVBlockLayout
from tests.native import built_or_skip
from tests.unit.engine.helpers import attention_model_config

BLOCK_SIZE = 16
HEAD_DIM = 64
NUM_LAYERS = 2
NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def native():
    """The extension (where it is not built attention gathers and runs SDPA in torch)."""
    return built_or_skip(cpu_attention._native, "engine.kernels._cpu_attention", "gcc with OpenMP (libgomp)", "attention runs in torch")


@pytest.fixture(params=["avx512", "avx2", "portable"])
def isa(request, native):
    """Each compiled variant of the loops (the portable one is what a CPU without AVX2 runs)."""
    try:
        previous = cpu_attention.use_isa(request.param)
    except ValueError:
        pytest.skip(f"this CPU cannot run the {request.param} loops")
    yield request.param
    cpu_attention.use_isa(previous)


@contextlib.contextmanager
def torch_path(monkeypatch):
    """The engine runs its torch code inside, as where the extension is not built."""
    with monkeypatch.context() as patch:
        patch.setattr(cpu_attention, "NATIVE_ATTENTION", False)
        yield


def filled_cache(kv_dtype, num_kv_heads, context_lens, seed=0, shared_first_block=False, num_blocks=NUM_BLOCKS):
    """A pool holding random K/V of sequences of ``context_lens`` tokens, written in 7-token steps
    through the torch path; scattered block ids, tables padded by repeating a block (as the runner
    pads). With ``shared_first_block`` the sequences of 16 tokens or more share their first
    block, as prefix-cached sequences do. Returns (cache, tables int64 [seqs, width])."""
    g = torch.Generator().manual_seed(seed)
    layout = KVBlockLayout(NUM_LAYERS, num_kv_heads, HEAD_DIM, BLOCK_SIZE, kv_dtype)
    cache = PagedKVCache(layout, num_blocks, torch.float32)
    width = max(1, max(-(-n // BLOCK_SIZE) for n in context_lens))
    free = torch.randperm(num_blocks, generator=g).tolist()
    shared, shared_written = free.pop(), False
    tables = torch.zeros(len(context_lens), width, dtype=torch.long)
    for row, length in enumerate(context_lens):
        num_blocks = max(1, -(-length // BLOCK_SIZE))
        own = [free.pop() for _ in range(num_blocks)]
        positions = torch.arange(length)
        if shared_first_block and length >= BLOCK_SIZE:
            own[0] = shared
            if shared_written:  # written by the first sequence that holds it
                positions = positions[BLOCK_SIZE:]
            shared_written = True
        tables[row] = torch.tensor(own + own[:1] * (width - len(own)))
        for pos in positions.split(7):
            k = torch.randn(len(pos), NUM_LAYERS, num_kv_heads, HEAD_DIM, generator=g) * 2
            v = torch.randn(len(pos), NUM_LAYERS, num_kv_heads, HEAD_DIM, generator=g)
            cache.write(k, v, tables[row, pos // BLOCK_SIZE], pos % BLOCK_SIZE)
    return cache, tables


def reference(q, k, v, cache, layer, tables, starts, query_starts):
    """Gather + patch + SDPA per sequence, as the engine's torch path: query token i of sequence s
    at position starts[s] + i sees every position up to its own."""
    out = torch.empty_like(q)
    for s in range(len(starts)):
        rows = slice(int(query_starts[s]), int(query_starts[s + 1]))
        start, n = int(starts[s]), rows.stop - rows.start
        keys, values = cache.gather(layer, tables[s : s + 1])
        keys, values = _widen(keys, start + n), _widen(values, start + n)
        keys[0, :, start : start + n] = k[rows].transpose(0, 1).float()
        values[0, :, start : start + n] = v[rows].transpose(0, 1).float()
        key_positions = torch.arange(keys.shape[2])
        mask = key_positions[None, :] <= torch.arange(start, start + n)[:, None]
        got = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0).float(), keys, values, attn_mask=mask, enable_gqa=True)
        out[rows] = got.squeeze(0).transpose(0, 1).to(q.dtype)
    return out


def _widen(kv, length):
    """Pad the gathered context with zero slots when the step's tokens run past the table's blocks."""
    if kv.shape[2] >= length:
        return kv
    return torch.cat((kv, kv.new_zeros(*kv.shape[:2], length - kv.shape[2], kv.shape[3])), dim=2)


def run_kernel(q, k, v, cache, layer, tables, starts, query_starts):
    sequences = cpu_attention.PagedSequences(tables.numpy(), np.asarray(starts, dtype=np.int64), np.asarray(query_starts, dtype=np.int64))
    return cpu_attention.paged_attention(q, k, v, cache.native, layer, sequences)


def random_rows(num_tokens, num_heads, seed, dtype=torch.float32):
    return torch.randn(num_tokens, num_heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bf16", "fp32"])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_equals_gather_and_sdpa(isa, kv_dtype, group):
    """Sequences of 1, 16, 37 and 50 tokens in one call (one query token each, at the context's
    end), scattered blocks, padded tables, a block shared by three sequences."""
    num_kv_heads = 2
    lens = (1, 16, 37, 50)
    cache, tables = filled_cache(kv_dtype, num_kv_heads, lens, shared_first_block=True)
    starts = [n - 1 for n in lens]  # the step's own token is the last of the context
    q = random_rows(len(lens), num_kv_heads * group, seed=1)
    k, v = random_rows(len(lens), num_kv_heads, seed=2), random_rows(len(lens), num_kv_heads, seed=3)
    for layer in range(NUM_LAYERS):
        got = run_kernel(q, k, v, cache, layer, tables, starts, range(len(lens) + 1))
        expected = reference(q, k, v, cache, layer, tables, starts, range(len(lens) + 1))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp32"])
def test_verification_runs_see_their_own_prefix(isa, kv_dtype):
    """Several query tokens per sequence (a verify chunk of 1 + k drafts): token i sees the context
    and this step's tokens 0 .. i only. Runs of 1, 4 and 3 tokens, one starting at 0 (no pool
    block) and one crossing a block boundary."""
    cache, tables = filled_cache(kv_dtype, 1, (0, 14, 40))
    starts, query_starts = [0, 14, 40], [0, 1, 5, 8]
    tables = torch.cat((tables, tables[:, :1]), dim=1)  # room for the blocks the new tokens reach
    q = random_rows(8, 3, seed=4)
    k, v = random_rows(8, 1, seed=5) * 3, random_rows(8, 1, seed=6)
    got = run_kernel(q, k, v, cache, 1, tables, starts, query_starts)
    expected = reference(q, k, v, cache, 1, tables, starts, query_starts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    later = k.clone()
    later[4] += 100  # the last token of sequence 1: its earlier tokens must not see it
    changed = run_kernel(q, later, v, cache, 1, tables, starts, query_starts)
    torch.testing.assert_close(changed[[0, 1, 2, 3, 5, 6, 7]], got[[0, 1, 2, 3, 5, 6, 7]], rtol=0, atol=0)
    assert not torch.equal(changed[4], got[4])


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bf16", "fp32"])
def test_long_contexts_split_into_parts_match_sdpa(isa, kv_dtype):
    """Contexts of 12 blocks and more are split into parts merged afterwards (split-K): one
    sequence of 250 tokens with an 8-token verify run (24 rows of 3 heads per KV head), and one
    of 200 in decode, beside a short one that is not split."""
    lens = (242, 200, 20)
    cache, tables = filled_cache(kv_dtype, 1, lens, num_blocks=36)
    starts, query_starts = [242, 200, 20], [0, 8, 9, 10]
    q = random_rows(10, 3, seed=21)
    k, v = random_rows(10, 1, seed=22) * 3, random_rows(10, 1, seed=23)
    got = run_kernel(q, k, v, cache, 1, tables, starts, query_starts)
    expected = reference(q, k, v, cache, 1, tables, starts, query_starts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_sequence_gives_the_same_bits_alone_or_batched(native):
    """The fused decoder attends all of a step's sequences in one call where the Python layers make
    one call per group: a sequence's output may not depend on the call's other sequences (nor on
    the thread count), split or not."""
    lens = (240, 100, 30)
    cache, tables = filled_cache("fp8_e4m3", 2, lens, num_blocks=32)
    q, k, v = random_rows(3, 6, seed=24), random_rows(3, 2, seed=25), random_rows(3, 2, seed=26)
    starts = [n - 1 for n in lens]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batched = run_kernel(q, k, v, cache, 0, tables, starts, range(4))
        torch.set_num_threads(1)
        alone = [run_kernel(q[s : s + 1], k[s : s + 1], v[s : s + 1], cache, 0, tables[s : s + 1], starts[s : s + 1], range(2))
                 for s in range(3)]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, torch.cat(alone))


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bf16", "fp32"])
def test_every_isa_agrees_with_the_portable_loops(native, kv_dtype):
    """Each compiled variant (AVX-512's transposed tiles, AVX2) against the portable loops on the
    engine's shapes: decode, verify runs of up to 8 tokens, partial blocks, split contexts."""
    cache, tables = filled_cache(kv_dtype, 2, (230, 61, 17, 3), num_blocks=28)
    starts, query_starts = [222, 61, 12, 3], [0, 8, 9, 14, 15]
    q, k, v = random_rows(15, 6, seed=27), random_rows(15, 2, seed=28), random_rows(15, 2, seed=29)
    previous = cpu_attention.use_isa("portable")
    try:
        portable = run_kernel(q, k, v, cache, 1, tables, starts, query_starts)
        for name in ("avx2", "avx512"):
            try:
                cpu_attention.use_isa(name)
            except ValueError:
                continue  # this CPU cannot run it
            got = run_kernel(q, k, v, cache, 1, tables, starts, query_starts)
            torch.testing.assert_close(got, portable, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    finally:
        cpu_attention.use_isa(previous)


def test_bf16_activations(isa):
    """A bf16 model: queries, K/V rows and the output in bf16, accumulation in float32."""
    cache, tables = filled_cache("fp8_e4m3", 3, (5, 33))
    q = random_rows(2, 9, seed=7, dtype=torch.bfloat16)
    k, v = random_rows(2, 3, seed=8, dtype=torch.bfloat16), random_rows(2, 3, seed=9, dtype=torch.bfloat16)
    got = run_kernel(q, k, v, cache, 0, tables, [4, 32], [0, 1, 2])
    expected = reference(q, k, v, cache, 0, tables, [4, 32], [0, 1, 2])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7)


def test_strided_rows_of_the_qkv_projection(native):
    """q, k and v as the attention layer slices them out of one projection (token stride > heads)."""
    cache, tables = filled_cache("fp8_e4m3", 3, (20, 9))
    qkv = random_rows(2, 15, seed=10)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    got = run_kernel(q, k, v, cache, 1, tables, [19, 8], [0, 1, 2])
    expected = run_kernel(q.contiguous(), k.contiguous(), v.contiguous(), cache, 1, tables, [19, 8], [0, 1, 2])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_engine_decode_uses_the_kernel_and_matches_the_torch_path(native, monkeypatch):
    """PagedAttention._decode with the kernel, and with the flag off (the fallback), agree."""
    cache, tables = filled_cache("fp8_e4m3", 3, (3, 17, 31))
    config = attention_model_config(9, 3, HEAD_DIM, NUM_LAYERS)
    attention = PagedAttention(config, 1, TPShard(config, 0, 1), TPGroup.single())
    positions = torch.tensor([3, 17, 31])
    tables = torch.cat((tables, tables[:, :1]), dim=1)
    mask = (torch.arange(tables.shape[1] * BLOCK_SIZE)[None, :] <= positions[:, None])[:, None, None, :]
    group = DecodeGroup(tokens=slice(0, 3), rows=torch.arange(3), positions=positions, block_tables=tables, mask=mask)
    q, k, v = random_rows(3, 9, seed=11), random_rows(3, 3, seed=12), random_rows(3, 3, seed=13)
    calls = []
    monkeypatch.setattr(cpu_attention._native, "attention", _counting(cpu_attention._native.attention, calls), raising=False)
    got = attention._decode(q, k, v, group, cache)
    assert len(calls) == 1
    with torch_path(monkeypatch):
        fallback = attention._decode(q, k, v, group, cache)
    assert len(calls) == 1
    torch.testing.assert_close(got, fallback, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [5, NATIVE_MAX_CHUNK_TOKENS + 1])
def test_engine_short_prefill_chunks_use_the_kernel(native, monkeypatch, num_tokens):
    """A verify chunk (1 + 4 drafts) runs in the kernel, a longer chunk in torch; both as the torch path."""
    cache, tables = filled_cache("fp8_e4m3", 3, (21,))
    config = attention_model_config(9, 3, HEAD_DIM, NUM_LAYERS)
    attention = PagedAttention(config, 0, TPShard(config, 0, 1), TPGroup.single())
    start, table = 21, torch.cat((tables, tables[:, :1]), dim=1)
    mask = torch.arange(table.shape[1] * BLOCK_SIZE)[None, :] <= torch.arange(start, start + num_tokens)[:, None]
    chunk = PrefillChunk(0, num_tokens, start, table, mask)
    q, k, v = random_rows(num_tokens, 9, seed=29), random_rows(num_tokens, 3, seed=30), random_rows(num_tokens, 3, seed=31)
    calls = []
    monkeypatch.setattr(cpu_attention._native, "attention", _counting(cpu_attention._native.attention, calls), raising=False)
    got = attention._prefill(q, k, v, chunk, cache)
    assert len(calls) == (num_tokens <= NATIVE_MAX_CHUNK_TOKENS)
    with torch_path(monkeypatch):
        fallback = attention._prefill(q, k, v, chunk, cache)
    torch.testing.assert_close(got, fallback, rtol=1e-5, atol=1e-5)


def test_thread_count_does_not_change_a_bit(native):
    """Work is split by (sequence, KV head), each item on one thread: 1 and 2 threads give the same bytes."""
    lens = (60, 50, 40, 30)  # enough work to wake the second thread
    cache, tables = filled_cache("fp8_e4m3", 2, lens)
    q, k, v = random_rows(4, 6, seed=14), random_rows(4, 2, seed=15), random_rows(4, 2, seed=16)
    starts = [n - 1 for n in lens]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_kernel(q, k, v, cache, 0, tables, starts, range(5))
        one_cache = _written_copy(cache, seed=17)
        torch.set_num_threads(2)
        two = run_kernel(q, k, v, cache, 0, tables, starts, range(5))
        two_cache = _written_copy(cache, seed=17)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(one_cache.buffer, two_cache.buffer)


def _written_copy(cache, seed):
    """A copy of ``cache`` after one large FP8 write (enough groups to run on every thread)."""
    copy = PagedKVCache(cache.layout, NUM_BLOCKS, torch.float32)
    copy.buffer.copy_(cache.buffer)
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(NUM_BLOCKS).repeat_interleave(5)
    k = torch.randn(len(ids), NUM_LAYERS, cache.layout.num_kv_heads, HEAD_DIM, generator=g)
    copy.write(k, -k, ids, torch.arange(5).repeat(NUM_BLOCKS))
    return copy


# ---------------------------------------------------------------------------------------------
# FP8 writes, bit for bit


def write_both(monkeypatch, layout, steps, dtype=torch.float32):
    """Apply the same writes to a pool through the kernel and to another through torch."""
    native_cache, torch_cache = PagedKVCache(layout, 8, dtype), PagedKVCache(layout, 8, dtype)
    for k, v, ids, offsets in steps:
        native_cache.write(k.to(dtype), v.to(dtype), ids, offsets)
        with torch_path(monkeypatch):
            torch_cache.write(k.to(dtype), v.to(dtype), ids, offsets)
        assert torch.equal(native_cache.buffer, torch_cache.buffer), _first_difference(native_cache, torch_cache)
    return native_cache


def _first_difference(a, b):
    where = (a.buffer != b.buffer).nonzero()[:3].tolist()
    return f"{len((a.buffer != b.buffer).nonzero())} bytes differ, first at (block, byte) {where}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_write_is_bit_identical_to_torch(native, isa, monkeypatch, dtype):
    """Blocks filled a few tokens at a time (partly filled, requantized as they grow), several
    blocks in one write, a block rolled back, a fully recomputed block, zeros, tiny values (e4m3
    subnormals) and huge ones (scales >= 2**8, dequantize_fp8's two-step rule)."""
    layout = KVBlockLayout(3, 2, HEAD_DIM, BLOCK_SIZE, "fp8_e4m3")
    g = torch.Generator().manual_seed(20)

    def rows(n, magnitude):
        return torch.randn(n, 3, 2, HEAD_DIM, generator=g) * magnitude

    zeros = torch.zeros(4, 3, 2, HEAD_DIM)
    steps = [
        (rows(3, 1.0), rows(3, 1.0), torch.tensor([5, 5, 5]), torch.tensor([0, 1, 2])),
        (rows(4, 1e30), rows(4, 1e-3), torch.tensor([5, 2, 2, 2]), torch.tensor([3, 0, 1, 2])),
        (rows(1, 1.0), rows(1, 1.0), torch.tensor([5]), torch.tensor([1])),  # rolled back (rejected drafts): stale slots 2, 3 become (signed) zeros
        (zeros, zeros, torch.tensor([7, 7, 7, 7]), torch.tensor([0, 1, 2, 3])),
        (rows(2, 1e-6), rows(2, 1e6), torch.tensor([7, 2]), torch.tensor([4, 3])),
        (rows(16, 3.0), rows(16, 1.0), torch.full((16,), 5), torch.arange(16)),
        (rows(1, 1e-30), rows(1, 448.0), torch.tensor([0]), torch.tensor([0])),
    ]
    cache = write_both(monkeypatch, layout, steps, dtype)
    assert torch.all(cache.scales[5] > 0) and cache.scales[3].eq(1).all()  # an untouched block keeps scale 1


def test_a_whole_prompts_write_is_bit_identical(native, monkeypatch):
    """A 512-token prompt written at once (2**20 values: large enough to run without the GIL, on every thread)."""
    layout = KVBlockLayout(4, 4, HEAD_DIM, BLOCK_SIZE, "fp8_e4m3")
    g = torch.Generator().manual_seed(32)
    k, v = torch.randn(512, 4, 4, HEAD_DIM, generator=g), torch.randn(512, 4, 4, HEAD_DIM, generator=g) * 50
    native_cache, torch_cache = PagedKVCache(layout, 40, torch.float32), PagedKVCache(layout, 40, torch.float32)
    ids, offsets = torch.randperm(40, generator=g)[:32].repeat_interleave(BLOCK_SIZE), torch.arange(512) % BLOCK_SIZE
    native_cache.write(k, v, ids, offsets)
    with torch_path(monkeypatch):
        torch_cache.write(k, v, ids, offsets)
    assert torch.equal(native_cache.buffer, torch_cache.buffer), _first_difference(native_cache, torch_cache)


def test_fp8_write_rounds_every_kind_of_value_as_torch(native, isa, monkeypatch):
    """Random float32 bit patterns within +-448 (one value of 448 per group pins the scale to 1, so
    the codes are the cast itself): normals, subnormals, ties, signed zeros; and non-finite rows."""
    layout = KVBlockLayout(1, 1, HEAD_DIM, BLOCK_SIZE, "fp8_e4m3")
    g = np.random.default_rng(21)
    shape = (BLOCK_SIZE, 1, 1, HEAD_DIM)
    exponents = g.integers(0, 136, size=shape, dtype=np.uint32)  # float32 subnormals .. 2**8
    bits = (g.integers(0, 2, size=shape, dtype=np.uint32) << 31) | (exponents << 23) | g.integers(0, 2**23, size=shape, dtype=np.uint32)
    values = torch.from_numpy(bits.view(np.float32).copy())
    values = torch.where(values.abs() <= 448, values, values / 2)
    values[0, 0, 0, 0] = 448.0
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite e4m3 value >= 0
    ties = torch.cat((codes, (codes[1:] + codes[:-1]) / 2, torch.tensor([-0.0])))  # and each midpoint
    ties = torch.cat((ties, -ties)).repeat(3)[: BLOCK_SIZE * HEAD_DIM].view(shape).clone()
    ties[0, 0, 0, 0] = 448.0
    nonfinite = torch.randn(BLOCK_SIZE, 1, 1, HEAD_DIM, generator=torch.Generator().manual_seed(22))
    nonfinite[3, 0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan")])
    offsets = torch.arange(BLOCK_SIZE)
    write_both(monkeypatch, layout, [
        (values, ties, torch.full((BLOCK_SIZE,), 1), offsets),
        (ties, values, torch.full((BLOCK_SIZE,), 2), offsets),
        (nonfinite, nonfinite, torch.full((BLOCK_SIZE,), 3), offsets),
    ])


def test_fallback_runs_without_the_extension(monkeypatch):
    """Without the C module (flag off, module gone) attention and writes run in torch."""
    monkeypatch.setattr(cpu_attention, "NATIVE_ATTENTION", False)
    monkeypatch.setattr(cpu_attention, "_native", None)
    cache, tables = filled_cache("fp8_e4m3", 3, (5, 20))
    config = attention_model_config(9, 3, HEAD_DIM, NUM_LAYERS)
    attention = PagedAttention(config, 0, TPShard(config, 0, 1), TPGroup.single())
    positions = torch.tensor([5, 20])
    tables = torch.cat((tables, tables[:, :1]), dim=1)
    mask = (torch.arange(tables.shape[1] * BLOCK_SIZE)[None, :] <= positions[:, None])[:, None, None, :]
    group = DecodeGroup(tokens=slice(0, 2), rows=torch.arange(2), positions=positions, block_tables=tables, mask=mask)
    q, k, v = random_rows(2, 9, seed=23), random_rows(2, 3, seed=24), random_rows(2, 3, seed=25)
    got = attention._decode(q, k, v, group, cache)
    expected = reference(q, k, v, cache, 0, tables, [5, 20], [0, 1, 2])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_attention_inputs_are_named(native):
    cache, tables = filled_cache("fp8_e4m3", 2, (20,))
    q, k, v = random_rows(1, 4, seed=26), random_rows(1, 2, seed=27), random_rows(1, 2, seed=28)
    cases = [
        ((q[:, :3], k, v, cache, 0, tables, [19], [0, 1]), "query heads"),
        ((q, k, v, cache, 2, tables, [19], [0, 1]), "layer"),
        ((q, k, v, cache, 0, tables, [40], [0, 1]), "starts"),
        ((q, k, v, cache, 0, tables + 100, [19], [0, 1]), "block_tables"),
        ((q, k, v, cache, 0, tables, [19], [0, 2]), "query_starts"),
        ((q, k[:, :1], v, cache, 0, tables, [19], [0, 1]), "k: expected"),
        ((q.half(), k, v, cache, 0, tables, [19], [0, 1]), "q: expected float32 or bfloat16"),
        ((q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cache, 0, tables, [19], [0, 1]), "q: dim 2 must be contiguous"),
        ((q, k.bfloat16(), v, cache, 0, tables, [19], [0, 1]), "k: expected"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            run_kernel(*args)


def test_bad_write_inputs_are_named(native):
    layout = KVBlockLayout(2, 2, HEAD_DIM, BLOCK_SIZE, "fp8_e4m3")
    cache = PagedKVCache(layout, 4, torch.float32)
    k = torch.zeros(2, 2, 2, HEAD_DIM)
    with pytest.raises(ValueError, match="block_ids: token 1 names block 4"):
        cpu_attention.write_fp8(k, k, torch.tensor([0, 4]), torch.tensor([0, 1]), cache.native)
    with pytest.raises(ValueError, match="offsets: token 0 has offset 16"):
        cpu_attention.write_fp8(k, k, torch.tensor([0, 1]), torch.tensor([16, 1]), cache.native)
    with pytest.raises(ValueError, match=r"k, v: expected \[2, 2, 2, 64\]"):
        cpu_attention.write_fp8(k[:, :1], k[:, :1], torch.tensor([0, 1]), torch.tensor([0, 1]), cache.native)
    fp32 = PagedKVCache(KVBlockLayout(2, 2, HEAD_DIM, BLOCK_SIZE, "fp32"), 4, torch.float32)
    with pytest.raises(ValueError, match="fp8_e4m3 pools only"):
        cpu_attention.write_fp8(k, k, torch.tensor([0, 1]), torch.tensor([0, 1]), fp32.native)


def _counting(function, calls):
    def counted(*args):
        calls.append(args)
        return function(*args)

    return counted
