"""RMSNorm in C (engine.kernels._cpu_norm) against float64 arithmetic and torch's own rms_norm."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.layers import norm
from engine.layers.norm import RMSNorm
from tests.native import built_or_skip


@pytest.fixture(scope="module")
def native():
    """The extension (where it is not built torch's rms_norm serves)."""
    return built_or_skip(norm._native, "engine.kernels._cpu_norm", "gcc", "RMSNorm runs in torch")


def _layer(dim: int, seed: int = 0) -> RMSNorm:
    layer = RMSNorm(dim, 1e-5)
    layer.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed))
    return layer


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (2, 3, 576), (512, 576)])
def test_the_c_norm_is_float64_arithmetic_rounded_once_and_agrees_with_torch(native, shape):
    layer = _layer(shape[-1])
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 5
    with torch.inference_mode():
        out = layer(x)
        torch_out = F.rms_norm(x, (shape[-1],), layer.weight, layer.eps)
    exact = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + layer.eps) * layer.weight.double()
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.allclose(out.double(), exact, rtol=1e-6, atol=1e-6)
    assert torch.allclose(out, torch_out, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, torch.zeros_like(out))


def test_rows_are_normalized_independently_and_a_zero_row_stays_finite(native):
    layer = _layer(64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    x[1] = 0
    with torch.inference_mode():
        both = layer(x)
        alone = layer(x[2:].clone())
    assert torch.equal(both[1], torch.zeros(64))
    assert torch.equal(both[2], alone[0])


def test_a_non_contiguous_input_takes_torchs_path_to_the_same_values(native, monkeypatch):
    layer = _layer(64)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(3)).t()  # [4, 64], strided
    called = []
    monkeypatch.setattr(norm, "native_rms_norm", lambda *a: called.append(a))
    with torch.inference_mode():
        out = layer(x)
    assert not called
    assert torch.allclose(out, F.rms_norm(x.contiguous(), (64,), layer.weight, layer.eps))


def test_without_the_extension_torch_normalizes(monkeypatch):
    layer = _layer(64)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(norm, "NATIVE_NORM", False)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.rms_norm(x, (64,), layer.weight, layer.eps))


def test_bad_input_is_refused_naming_it(native):
    x, out, weight = np.ones((2, 8), np.float32), np.empty((2, 8), np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match="x: must be float32"):
        native.rms_norm(x.astype(np.float64), weight, 1e-5, out)
    with pytest.raises(ValueError, match=r"out: must be \[2, 8\] like x"):
        native.rms_norm(x, weight, 1e-5, np.empty((3, 8), np.float32))
    with pytest.raises(ValueError, match="weight: must be 8 float32s"):
        native.rms_norm(x, np.ones(7, np.float32), 1e-5, out)
    with pytest.raises(ValueError, match=r"x: must be \[rows, dim\]"):
        native.rms_norm(np.ones(8, np.float32), weight, 1e-5, out)
    with pytest.raises((ValueError, BufferError)):
        native.rms_norm(np.ones((8, 2), np.float32).T, weight, 1e-5, out)  # not C-contiguous
