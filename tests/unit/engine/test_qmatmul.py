"""The native quantized matmul (engine/quant/_qmatmul.c) against a float64 reference of the very
same quantized math: activations quantized per 32-block to two int8 planes (``amax / 127``,
round half to even; the second plane quantizes what the first left over), or to the first plane
alone when asked for one, integer dots, and per block ``d * (sx1 * idot1 + sx2 * idot2) + m * xsum``
(Q4) or without the min term (Q8).

The integer dots are exact, so only float32 rounding separates the kernel from the reference."""

from __future__ import annotations

import pytest
import torch

from engine.quant import native
from engine.quant.kernels import GroupInt8Weight, Int4Weight
from tests.unit.engine.helpers import native_qmatmul  # noqa: F401 (a fixture)

SHAPES = [(40, 32), (40, 576), (24, 1536)]
"""(out, in): 40 and 24 output rows are not whole 16-row tiles."""


def quantized_planes(x: torch.Tensor, num_planes: int = 2) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """``([(xq, sx)] per plane, xsum)`` per 32-block, in float64: codes, scales, exact sums."""
    blocks = x.view(x.shape[0], -1, 32)
    rest, planes = blocks, []
    for _ in range(num_planes):
        scales = rest.abs().amax(-1) / 127
        inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
        codes = (rest * inverse[..., None]).round().clamp(-127, 127)
        planes.append((codes.double(), scales.double()))
        rest = (rest.double() - scales.double()[..., None] * codes.double()).float()  # exact, then rounded once (fmaf)
    return planes, blocks.double().sum(-1)


def reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, num_planes: int = 2) -> torch.Tensor:
    planes, xsum = quantized_planes(x, num_planes)
    weight_codes = codes.double().view(codes.shape[0], -1, 32)
    d = scales.half().double()
    y = sum(torch.einsum("mbi,nbi->mnb", xq, weight_codes) * sx[:, None, :] * d[None] for xq, sx in planes)
    if mins is not None:
        y = y + mins.half().double()[None] * xsum[:, None, :]
    return y.sum(-1)


def random_weight(kind: str, out_features: int, in_features: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(out_features, in_features // 32, generator=g) * 0.05
    if kind == "q4":
        codes = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
        mins = torch.randn(out_features, in_features // 32, generator=g) * 0.1
        return codes, scales, mins, native.pack_q4(codes, scales, mins).numpy()
    codes = torch.randint(-128, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    return codes, scales, None, native.pack_q8(codes, scales).numpy()


def run(kind: str, x: torch.Tensor, packed, out_features: int, planes: int = 2) -> torch.Tensor:
    return (native.q4_matmul if kind == "q4" else native.q8_matmul)(x, packed, out_features, planes)


def run_on_every_isa(qmatmul, kind: str, x: torch.Tensor, packed, out_features: int, planes: int = 2) -> dict[str, torch.Tensor]:
    """The result of each instruction set this CPU runs (the scalar path always among them)."""
    results = {}
    for isa in qmatmul.isas():
        previous = qmatmul.use_isa(isa)
        try:
            results[isa] = run(kind, x, packed, out_features, planes)
        finally:
            qmatmul.use_isa(previous)
    return results


def assert_the_same_bits(results: dict[str, torch.Tensor]) -> None:
    assert "scalar" in results
    assert len({r.numpy().tobytes() for r in results.values()}) == 1, f"the SIMD and scalar paths disagree in some bit ({list(results)})"


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("num_rows", [1, 3, 16])
@pytest.mark.parametrize("planes", [2, 1])
def test_the_kernel_computes_the_quantized_math_on_every_isa(native_qmatmul, kind, shape, num_rows, planes):
    """With one plane the reference differs from two planes' by ~1e-3 of the result, far outside
    the tolerance: a kernel that ignored ``planes`` fails one of the two."""
    codes, scales, mins, packed = random_weight(kind, *shape, seed=num_rows)
    x = torch.randn(num_rows, shape[1], generator=torch.Generator().manual_seed(7))
    x[0, :32] = 0  # an all-zero block: scale 0, codes 0
    expected = reference(x, codes, scales, mins, planes)
    results = run_on_every_isa(native_qmatmul, kind, x, packed, shape[0], planes)
    for result in results.values():
        assert result.shape == (num_rows, shape[0]) and result.dtype == torch.float32
        # float32 sums of up to 48 blocks: a few ulps of the largest partial sums
        torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert_the_same_bits(results)


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_codes_at_the_ends_of_their_range_give_exact_dots(native_qmatmul, kind):
    """Weight codes only at the ends of their range (Q4 0 and 15, Q8 -128 and 127) against
    activations of one magnitude (every code +-127): the AVX2 path's int16 pair sums (maddubs)
    come near their limit, and would saturate on Q8's stored q + 128 (2 * 255 * 127) or go
    wrong if a code of -128 were negated."""
    low, high = (0, 15) if kind == "q4" else (-128, 127)
    g = torch.Generator().manual_seed(8)
    x = torch.where(torch.rand(4, 64, generator=g) < 0.5, -1.0, 1.0)
    x[1], x[2] = 1.0, -1.0
    codes = torch.where(torch.rand(20, 64, generator=g) < 0.5, low, high)
    codes[0], codes[1] = high, low
    codes[2] = torch.where(x[0] < 0, low, high)  # every product of row 0 of x at its largest
    codes[3] = torch.where(x[0] < 0, high, low)
    scales = torch.full((20, 2), 0.25)
    if kind == "q4":
        mins = torch.full((20, 2), -0.5)
        packed = native.pack_q4(codes.to(torch.uint8), scales, mins).numpy()
    else:
        mins = None
        packed = native.pack_q8(codes.to(torch.int8), scales).numpy()
    expected = reference(x, codes, scales, mins)
    results = run_on_every_isa(native_qmatmul, kind, x, packed, 20)
    for result in results.values():
        torch.testing.assert_close(result.double(), expected, rtol=1e-6, atol=1e-6)
    assert_the_same_bits(results)


@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("planes", [2, 1])
@pytest.mark.parametrize("shape, num_rows", [((520, 576), 5), ((40, 576), 64)], ids=["wide", "many-rows"])
def test_one_and_two_threads_give_the_same_bits(native_qmatmul, kind, planes, shape, num_rows):
    """Past the work that runs in parallel: a wide weight, or a narrow one (40 x 576, alone below
    the limit) times enough rows."""
    codes, scales, mins, packed = random_weight(kind, *shape, seed=1)
    x = torch.randn(num_rows, shape[1], generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(kind, x, packed, shape[0], planes)
        torch.set_num_threads(2)
        two = run(kind, x, packed, shape[0], planes)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    torch.testing.assert_close(one.double(), reference(x, codes, scales, mins, planes), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("planes", [0, 3])
def test_a_plane_count_the_kernel_cannot_run_is_refused_by_name(native_qmatmul, planes):
    _, _, _, packed = random_weight("q4", 40, 64, seed=3)
    with pytest.raises(ValueError, match=f"planes: {planes} activation planes; the kernel runs 1 or 2"):
        native.q4_matmul(torch.randn(2, 64), packed, 40, planes)


def test_bf16_activations_come_back_in_bf16(native_qmatmul):
    codes, scales, mins, packed = random_weight("q4", 40, 64, seed=3)
    x = torch.randn(2, 64).bfloat16()
    y = native.q4_matmul(x, packed, 40)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, native.q4_matmul(x.float(), packed, 40).bfloat16())


@pytest.mark.parametrize("make", [Int4Weight.from_dense, GroupInt8Weight.from_dense], ids=["int4", "group-int8"])
def test_weights_give_the_same_result_with_and_without_the_native_kernel(native_qmatmul, monkeypatch, make):
    """The fallback (torch's int4 kernel, bf16) and the native kernel hold the same weight (up to
    bf16 against fp16 scales) and each answers the matmul of the weight it holds."""
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(4))
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(5))
    ours = make(weight)
    monkeypatch.setattr(native, "NATIVE_QMATMUL", False)
    fallback = make(weight)
    assert ours.native and not fallback.native
    held = ours.dequantize()
    assert ((fallback.dequantize() - held).abs() <= held.abs() / 64 + 1e-2).all()
    for kernel, tolerance in ((ours, 1e-4), (fallback, 0.02)):  # two int8 planes carry about 15 bits of x; bf16 8
        expected = x.double() @ kernel.dequantize().double().t()
        torch.testing.assert_close(kernel.matmul(x).double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_bad_input_is_refused_naming_the_problem(native_qmatmul):
    _, _, _, packed = random_weight("q4", 40, 64, seed=6)
    q4 = native_qmatmul.q4_matmul
    y = torch.empty(2, 40).numpy()
    with pytest.raises(ValueError, match="x: must be float32, got buffer format 'd'"):
        q4(torch.zeros(2, 64, dtype=torch.float64).numpy(), packed, y)
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        q4(torch.zeros(64, 2).t().numpy(), packed, y)
    with pytest.raises(ValueError, match="x: must be 2-D"):
        q4(torch.zeros(64).numpy(), packed, y)
    with pytest.raises(ValueError, match="x: 48 input features are not a positive whole number of 32-blocks"):
        q4(torch.zeros(2, 48).numpy(), packed, y)
    with pytest.raises(ValueError, match=r"packed: 1920 bytes, but 40 x 128 q4 weights take 3840"):
        q4(torch.zeros(2, 128).numpy(), packed, y)
    with pytest.raises(ValueError, match="out: 3 rows for 2 rows of x"):
        q4(torch.zeros(2, 64).numpy(), packed, torch.empty(3, 40).numpy())
    with pytest.raises(ValueError, match="isa: avx9 is not available"):
        native_qmatmul.use_isa("avx9")
    with pytest.raises(ValueError, match="input features in whole groups of 32, got 48"):
        native.pack_q4(torch.zeros(16, 48, dtype=torch.uint8), torch.zeros(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="beyond float16's range"):
        native.pack_q8(torch.zeros(16, 32, dtype=torch.int8), torch.full((16, 1), 1e6))


def test_the_native_kernel_is_built_where_required(native_qmatmul):
    assert native._qmatmul is not None and native_qmatmul.isa() in ("avx512vnni", "avx2", "scalar")
    runnable = native_qmatmul.isas()
    assert runnable[0] == "scalar" and runnable[-1] == native_qmatmul.isa()  # the best one runs
