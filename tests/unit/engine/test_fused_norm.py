"""The fused residual-add + RMSNorm and SiLU-and-mul Triton kernels against their torch references
and against the model's own layers (``RMSNorm``, ``GatedMLP``'s ``F.silu(gate) * up``).

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); on a
CUDA host they compile and run on the GPU.
"""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import fused_norm
from engine.kernels.fused_norm import add_rms_norm, reference_add_rms_norm, reference_silu_and_mul, silu_and_mul
from engine.kernels.launches import LaunchCounter
from engine.layers.norm import RMSNorm
from tests.triton_compile import Launch, compile_for_sm90

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
HIDDEN_SIZES = (576, 100)  # SmolLM2's width; one that is not a power of two
FP32_RTOL = 1e-6


def rows(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, hidden, generator=g) * 3).to(dtype).to(DEVICE)


def norm_weight(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(DEVICE)


def model_norm(s: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    norm = RMSNorm(s.shape[1], EPS).to(device=s.device, dtype=s.dtype)
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        return norm(s)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps separate each pair of (same-signed or zero) values."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def assert_norm_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        # One float32 ulp of the normalized value (another summation order) can cross a bfloat16 tie.
        assert int(ulps_apart(got, expected).max()) <= 1
    else:
        torch.testing.assert_close(got, expected, rtol=FP32_RTOL, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_add_rms_norm_updates_the_residual_and_normalizes_the_sum(dtype, hidden, num_tokens):
    x, residual, weight = rows(num_tokens, hidden, dtype, 1), rows(num_tokens, hidden, dtype, 2), norm_weight(hidden, dtype)
    x_before, expected_sum = x.clone(), x + residual
    reference_residual = residual.clone()
    with LaunchCounter() as launched:
        out, returned = add_rms_norm(x, residual, weight, EPS)
    assert dict(launched) == {"add_rms_norm": 1}
    assert returned is residual
    assert torch.equal(residual, expected_sum)  # rounded once to the dtype, as torch's add
    assert torch.equal(x, x_before)
    reference_out, _ = reference_add_rms_norm(x, reference_residual, weight, EPS)
    assert torch.equal(reference_residual, expected_sum)
    assert_norm_close(out, reference_out)
    assert_norm_close(out, model_norm(expected_sum, weight))
    assert out.dtype == dtype and out.shape == x.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", HIDDEN_SIZES)
def test_add_rms_norm_without_residual_normalizes_x(dtype, hidden):
    x, weight = rows(7, hidden, dtype, 3), norm_weight(hidden, dtype)
    x_before = x.clone()
    out, returned = add_rms_norm(x, None, weight, EPS)
    assert returned is x
    assert torch.equal(x, x_before)
    assert_norm_close(out, reference_add_rms_norm(x, None, weight, EPS)[0])
    assert_norm_close(out, model_norm(x, weight))


def test_bf16_norm_is_mostly_bit_exact():
    """The one-ulp allowance is for rare ties: nearly every element is the model's bits."""
    x, weight = rows(7, 576, torch.bfloat16, 4), norm_weight(576, torch.bfloat16)
    out, _ = add_rms_norm(x, None, weight, EPS)
    assert int((out != model_norm(x, weight)).sum()) <= 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [1536, 100])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_silu_and_mul_equals_the_mlp(dtype, intermediate, num_tokens):
    gate_up = rows(num_tokens, 2 * intermediate, dtype, 5)
    with LaunchCounter() as launched:
        got = silu_and_mul(gate_up)
    assert dict(launched) == {"silu_and_mul": 1}
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    assert got.shape == (num_tokens, intermediate) and got.dtype == dtype
    assert torch.equal(reference_silu_and_mul(gate_up), expected)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        # float32 exp differs by an ulp between torch's vectorized CPU exp and numpy's (the
        # interpreter's), or the GPU's expf, in about a third of the elements; the SiLU and the
        # product add an ulp each.
        torch.testing.assert_close(got, expected, rtol=FP32_RTOL, atol=0)


def test_bad_inputs_are_refused_by_name():
    x, weight = rows(2, 100, torch.float32, 6), norm_weight(100, torch.float32)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, rows(2, 100, torch.bfloat16, 7), weight, EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, rows(3, 100, torch.float32, 7), weight, EPS)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, norm_weight(100, torch.bfloat16), EPS)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, norm_weight(99, torch.float32), EPS)
    with pytest.raises(ValueError, match="x"):
        add_rms_norm(x.half(), None, weight.half(), EPS)
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(rows(2, 101, torch.float32, 8))
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(rows(2, 100, torch.float16, 8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above compile and run the kernels")
def test_kernels_compile_for_sm90():
    """The interpreter runs the kernels' Python, not Triton's compiler, and never takes the GPU's
    ``libdevice.exp`` branch: compile both kernels for an H100 (no GPU needed)."""
    launches = []
    for dtype in ("fp32", "bf16"):
        variants = {
            "_add_rms_norm_kernel": dict(HAS_RESIDUAL=True, BF16=dtype == "bf16", BLOCK=1024),
            "_silu_and_mul_kernel": dict(BF16=dtype == "bf16", PRECISE_EXP=True, BLOCK=1024),
        }
        for name, constexprs in variants.items():
            scalars = {"eps": "fp32", "hidden": "i32", "intermediate": "i32"}
            arg_names = [arg for arg in getattr(fused_norm, name).arg_names if arg not in constexprs]
            launches.append(Launch(fused_norm.__name__, name, {arg: scalars.get(arg, "*" + dtype) for arg in arg_names}, constexprs))
    compiled = compile_for_sm90(launches)
    assert [c.kernel for c in compiled] == ["_add_rms_norm_kernel", "_silu_and_mul_kernel"] * 2
