"""The RoPE + paged K/V write Triton kernel against its torch reference and against the engine
(``apply_rotary`` and ``PagedKVCache.write``), byte for byte, on fp32, bf16 and FP8 pools.

On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a
CUDA host it compiles and runs on the GPU.
"""

from dataclasses import dataclass

import pytest
import torch

from engine.kernels import rope_kv
from engine.kernels.kv_segments import KVSegments
from engine.kernels.launches import LaunchCounter
from engine.kernels.rope_kv import reference_rope_write_kv, rope_write_kv
from engine.kv_cache import BlockFill, PagedKVCache
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.model_config import RopeConfig
from kv_store.layout import KVBlockLayout
from tests.triton_compile import Launch, compile_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_LAYERS = 2
BLOCK_SIZE = 16
NUM_BLOCKS = 8
MAX_POSITIONS = 64


@dataclass(frozen=True)
class Step:
    """Per-token slots and positions of one step's flat batch."""

    block_ids: list[int]
    offsets: list[int]
    positions: list[int]


STEPS = (
    # Sequence A's first 5 tokens (block 3); B's 19 (block 5 filled exactly, then 3 in block 1).
    Step([3] * 5 + [5] * 16 + [1] * 3, [*range(5), *range(16), 0, 1, 2], [*range(5), *range(19)]),
    # A goes on mid-block in block 3; B one token; a padding row; C's first token (block 6).
    Step([3] * 7 + [1, -1, 6], [*range(5, 12), 3, 0, 0], [*range(5, 12), 19, 0, 0]),
)
CASES = [  # (kv_dtype, model dtype, num_heads, num_kv_heads, head_dim)
    ("fp32", torch.float32, 4, 2, 64),
    ("bf16", torch.bfloat16, 3, 1, 32),
    ("bf16", torch.float32, 4, 2, 32),
    ("fp8_e4m3", torch.bfloat16, 4, 2, 64),
    ("fp8_e4m3", torch.float32, 3, 1, 32),
]


def rope(head_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, MAX_POSITIONS, MAX_POSITIONS)


def random_qkv(num_rows: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, generator) -> torch.Tensor:
    return (torch.randn(num_rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator) * 2).to(dtype)


def kernel(qkv, positions, table, pool, layout, layer, segments_on_host: tuple[list[int], list[int]], num_heads):
    """The kernel on copies on DEVICE; returns (qkv, pool) back on CPU."""
    qkv, positions, pool = qkv.to(DEVICE, copy=True), positions.to(DEVICE), pool.to(DEVICE, copy=True)
    segments = KVSegments.of_slots(*segments_on_host, device=DEVICE)
    rope_write_kv(qkv, positions, table.cos.to(DEVICE), table.sin.to(DEVICE), pool, layout, layer, segments, num_heads)
    return qkv.cpu(), pool.cpu()


@pytest.mark.parametrize(("kv_dtype", "dtype", "num_heads", "num_kv_heads", "head_dim"), CASES)
def test_kernel_equals_reference_and_engine(kv_dtype, dtype, num_heads, num_kv_heads, head_dim):
    layout = KVBlockLayout(NUM_LAYERS, num_kv_heads, head_dim, BLOCK_SIZE, kv_dtype)
    table = rope(head_dim)
    cache = PagedKVCache(layout, NUM_BLOCKS, dtype)  # the engine's pool: fp8 scales start at 1
    kernel_pool, reference_pool = cache.buffer.clone(), cache.buffer.clone()
    g = torch.Generator().manual_seed(0)
    q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
    for step in STEPS:
        positions = torch.tensor(step.positions)
        live = torch.tensor(step.block_ids) >= 0
        for layer in range(NUM_LAYERS):
            qkv = random_qkv(len(positions), num_heads, num_kv_heads, head_dim, dtype, g)
            got_qkv, kernel_pool = kernel(qkv, positions, table, kernel_pool, layout, layer, (step.block_ids, step.offsets), num_heads)
            reference_qkv = qkv.clone()
            segments = KVSegments.of_slots(step.block_ids, step.offsets)
            reference_rope_write_kv(reference_qkv, positions, table.cos, table.sin, reference_pool, layout, layer, segments, num_heads)
            assert torch.equal(got_qkv, reference_qkv)
            assert torch.equal(kernel_pool, reference_pool)

            qk = qkv[:, : q_width + kv_width].view(len(positions), -1, head_dim)
            rotated = apply_rotary(qk, *table.tables(positions, dtype)).flatten(1)
            assert torch.equal(got_qkv[live, : q_width + kv_width], rotated[live])
            assert torch.equal(got_qkv[live, q_width + kv_width :], qkv[live, q_width + kv_width :])
            assert torch.equal(got_qkv[~live], qkv[~live])  # the padding row is left alone
            k = rotated[live, q_width:].view(-1, 1, num_kv_heads, head_dim)
            v = qkv[live, q_width + kv_width :].view(-1, 1, num_kv_heads, head_dim)
            block_ids, offsets = torch.tensor(step.block_ids)[live], torch.tensor(step.offsets)[live]
            fill = BlockFill.of(block_ids, offsets, BLOCK_SIZE)
            cache.write(k, v, block_ids, offsets, slice(layer, layer + 1), fill)
            assert torch.equal(kernel_pool, cache.buffer)
    assert torch.count_nonzero(kernel_pool[[3, 5, 1, 6]]) > 0


def test_padding_run_leaves_the_pool_and_rows_untouched():
    layout = KVBlockLayout(NUM_LAYERS, 2, 32, BLOCK_SIZE, "fp8_e4m3")
    table = rope(32)
    pool = torch.randint(0, 256, (NUM_BLOCKS, layout.block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    qkv = random_qkv(2, 4, 2, 32, torch.float32, torch.Generator().manual_seed(2))
    with LaunchCounter() as launched:
        got_qkv, got_pool = kernel(qkv, torch.tensor([7, 0]), table, pool, layout, 1, ([-1, -1], [5, 0]), 4)
    assert dict(launched) == {"rope_write_kv": 1}
    assert torch.equal(got_pool, pool)
    assert torch.equal(got_qkv, qkv)


def e4m3_ties_and_neighbours() -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours (ties), and the float32 values either side of each midpoint."""
    values = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    midpoints = (values[:-1] + values[1:]) / 2
    below, above = torch.nextafter(midpoints, torch.zeros(())), torch.nextafter(midpoints, torch.full((), 448.0))
    magnitudes = torch.cat((values, midpoints, below, above))
    return torch.cat((magnitudes, -magnitudes[1:]))  # no -0: it has a code of its own


def test_e4m3_rounding_matches_torch_at_every_tie():
    """V is written as it is, so a run of V values with amax 448 (scale exactly 1) shows the codes."""
    head_dim = 64
    layout = KVBlockLayout(NUM_LAYERS, 1, head_dim, BLOCK_SIZE, "fp8_e4m3")
    values = e4m3_ties_and_neighbours()
    assert len(values) <= BLOCK_SIZE * head_dim
    v = torch.zeros(BLOCK_SIZE * head_dim)
    v[: len(values)] = values
    qkv = random_qkv(BLOCK_SIZE, 1, 1, head_dim, torch.float32, torch.Generator().manual_seed(3))
    qkv[:, 2 * head_dim :] = v.view(BLOCK_SIZE, head_dim)
    pool = PagedKVCache(layout, 2, torch.float32).buffer.clone()
    _, got_pool = kernel(qkv, torch.arange(BLOCK_SIZE), rope(head_dim), pool, layout, 0, ([1] * BLOCK_SIZE, list(range(BLOCK_SIZE))), 1)
    payload = got_pool[:, : layout.payload_bytes].view(torch.float8_e4m3fn).view(2, *layout.payload_shape)
    scales = got_pool[:, layout.scales_offset : layout.scales_offset + layout.scale_bytes].view(torch.float32)
    assert float(scales.view(2, *layout.scale_shape)[1, 0, 0, 1]) == 1.0
    assert torch.equal(payload[1, 0, 0, 1].reshape(-1).view(torch.uint8), v.to(torch.float8_e4m3fn).view(torch.uint8))


def test_of_slots_splits_where_the_block_changes_or_the_offsets_jump():
    segments = KVSegments.of_slots([3, 3, 3, 5, 5, -1, -1, 2, 7, 7], [4, 5, 6, 0, 1, 0, 0, 0, 9, 10])
    assert segments.block_ids.tolist() == [3, 5, -1, -1, 2, 7]
    assert segments.token_starts.tolist() == [0, 3, 5, 6, 7, 8]
    assert segments.offsets.tolist() == [4, 0, 0, 0, 0, 9]
    assert segments.num_tokens.tolist() == [3, 2, 1, 1, 1, 2]
    assert segments.max_tokens == 3
    assert segments.block_ids.dtype == torch.int32
    empty = KVSegments.of_slots([], [])
    assert (empty.num_segments, empty.max_tokens) == (0, 1)
    with pytest.raises(ValueError, match="block_ids"):
        KVSegments.of_slots([4, 4, 6, 4], [0, 1, 0, 2])
    with pytest.raises(ValueError, match="offsets"):
        KVSegments.of_slots([4, 4], [0])


def test_decode_segments_hold_their_buffers_for_in_place_refills():
    """A CUDA-graph runner builds the segments once and refills its static slot buffers each step."""
    head_dim, num_heads = 32, 2
    layout = KVBlockLayout(NUM_LAYERS, 1, head_dim, BLOCK_SIZE, "fp8_e4m3")
    table = rope(head_dim)
    block_ids = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    offsets = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    positions = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    segments = KVSegments.decode(block_ids, offsets)
    assert segments.block_ids is block_ids and segments.offsets is offsets and segments.max_tokens == 1
    assert segments.token_starts.tolist() == [0, 1, 2] and segments.num_tokens.tolist() == [1, 1, 1]
    pool = PagedKVCache(layout, NUM_BLOCKS, torch.float32).buffer.to(DEVICE)
    reference_pool = pool.cpu()
    g = torch.Generator().manual_seed(4)
    for slots in ([(2, 0, 0), (4, 0, 0), (-1, 0, 0)], [(2, 1, 1), (4, 1, 1), (6, 0, 0)]):
        block_ids.copy_(torch.tensor([s[0] for s in slots]))
        offsets.copy_(torch.tensor([s[1] for s in slots]))
        positions.copy_(torch.tensor([s[2] for s in slots]))
        qkv = random_qkv(3, num_heads, 1, head_dim, torch.bfloat16, g)
        got = qkv.to(DEVICE)
        rope_write_kv(got, positions, table.cos.to(DEVICE), table.sin.to(DEVICE), pool, layout, 1, segments, num_heads)
        cpu_segments = KVSegments.decode(block_ids.cpu(), offsets.cpu())
        reference_rope_write_kv(qkv, positions.cpu(), table.cos, table.sin, reference_pool, layout, 1, cpu_segments, num_heads)
        assert torch.equal(got.cpu(), qkv)
        assert torch.equal(pool.cpu(), reference_pool)
    with pytest.raises(ValueError, match="block_ids"):
        KVSegments.decode(block_ids.long(), offsets)


def test_bad_inputs_are_refused_by_name():
    head_dim, num_heads = 32, 4
    layout = KVBlockLayout(NUM_LAYERS, 2, head_dim, BLOCK_SIZE, "bf16")
    table = rope(head_dim)
    pool = torch.zeros(NUM_BLOCKS, layout.block_bytes, dtype=torch.uint8)
    qkv = random_qkv(2, num_heads, 2, head_dim, torch.float32, torch.Generator().manual_seed(5))
    positions = torch.tensor([0, 1])
    segments = KVSegments.of_slots([1, 1], [0, 1])

    def call(**changes):
        args = dict(qkv=qkv, positions=positions, cos=table.cos, sin=table.sin, pool=pool, layout=layout, layer=0)
        rope_write_kv(**{**args, "segments": segments, "num_heads": num_heads, **changes})

    with pytest.raises(ValueError, match="qkv"):
        call(qkv=qkv[:, :-head_dim].contiguous())
    with pytest.raises(ValueError, match="pool"):
        call(pool=pool.view(torch.int16))
    with pytest.raises(ValueError, match="pool"):
        call(pool=pool[:, :-8].contiguous())
    with pytest.raises(ValueError, match="layer"):
        call(layer=NUM_LAYERS)
    odd_layout = KVBlockLayout(NUM_LAYERS, 2, head_dim, 12, "bf16")
    with pytest.raises(ValueError, match="block_size"):
        call(layout=odd_layout, pool=torch.zeros(NUM_BLOCKS, odd_layout.block_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="num_heads"):
        call(num_heads=3)
    with pytest.raises(ValueError, match="positions"):
        call(positions=torch.tensor([0, MAX_POSITIONS]))
    with pytest.raises(ValueError, match="segments.offsets"):
        call(segments=KVSegments.of_slots([1, 1], [15, 16]))
    with pytest.raises(ValueError, match="segments.block_ids"):
        call(segments=KVSegments.of_slots([NUM_BLOCKS, NUM_BLOCKS], [0, 1]))
    assert torch.count_nonzero(pool) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above compile and run the kernel")
def test_kernel_compiles_for_sm90_without_fused_multiply_adds():
    """The interpreter runs the kernel's Python, not Triton's compiler: compile it for an H100 (no
    GPU needed) to catch what only the compiler refuses, and check no float32 product was fused
    into an FMA, which would round the rotation once instead of three times."""
    kernel = rope_kv._rope_write_kv_kernel
    pointers = {"positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pool_ptr": "*u8", "block_ids_ptr": "*i32",
                "token_starts_ptr": "*i32", "offsets_ptr": "*i32", "num_tokens_ptr": "*i32"}
    variants = (("fp32", "fp32"), ("bf16", "bf16"), ("fp8_e4m3", "fp32"), ("fp8_e4m3", "bf16"))
    launches = []
    for kv_dtype, dtype in variants:
        constexprs = dict(GROUP=4, HEAD_DIM=128, HEAD_DIM_PAD=128, MAX_TOKENS=1, BLOCK_SIZE=16, BF16=dtype == "bf16",
                          KV_KIND=rope_kv.KV_KINDS[kv_dtype], ELEMENT_BYTES={"fp32": 4, "bf16": 2, "fp8_e4m3": 1}[kv_dtype])
        signature = {name: pointers.get(name, "i32") for name in kernel.arg_names if name not in constexprs}
        signature["qkv_ptr"] = "*" + dtype
        launches.append(Launch(rope_kv.__name__, "_rope_write_kv_kernel", signature, constexprs, options=rope_kv.COMPILE_OPTIONS))
    compiled = compile_for_sm90(launches)
    fmas = {f"{kv_dtype} pool, {dtype} model": c.fma_f32 for (kv_dtype, dtype), c in zip(variants, compiled)}
    assert fmas == {
        "fp32 pool, fp32 model": 0, "bf16 pool, bf16 model": 0, "fp8_e4m3 pool, fp32 model": 0, "fp8_e4m3 pool, bf16 model": 0
    }
