"""Quantized linear weights (engine/quant): GGUF blocks unpacked and repacked for the native kernel
and torch's int4 and int8 CPU kernels, quantization at load, tensor-parallel shards, and what is refused."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.errors import UnsupportedModelError
from engine.loader.gguf_native import NativeTensor, read_native_tensors
from engine.loader.weights import load_weights
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderModel
from engine.parallel.group import TPGroup
from engine.quant.apply import _int8, apply_native, apply_weights, linear_layers
from engine.quant.blocks import unpack_blocks
from engine.quant import native
from engine.quant import kernels
from engine.quant.kernels import GroupInt8Weight, Int4Weight, Int8Weight
from tests.unit.engine.helpers import make_engine, native_qmatmul  # noqa: F401 (a fixture)


def gguf_blocks(kind: str, weight: np.ndarray):
    """``(raw bytes, gguf's own dequantization)`` of ``weight`` quantized by the gguf package."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(weight, qtype)
    return raw, gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_unpacked_blocks_dequantize_bit_for_bit_as_gguf_does(kind):
    weight = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw, expected = gguf_blocks(kind, weight)
    blocks = unpack_blocks(kind, raw, 48, 96)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(expected))


@pytest.fixture(params=["native", "torch"])
def kernel_path(request, monkeypatch):
    """Build weights for the C kernel (skipped where it is not built) or for torch's int4 kernel."""
    if request.param == "native":
        request.getfixturevalue("native_qmatmul")
    else:
        monkeypatch.setattr(native, "NATIVE_QMATMUL", False)
    return request.param


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_native_layout_holds_gguf_blocks_bit_for_bit(native_qmatmul, monkeypatch, kind):
    """fp16 scales and mins, as GGUF stores them: ``d * q + m`` is gguf's own dequantization."""
    monkeypatch.setattr(native, "CPU_BF16", True)  # so that the dense copy for many rows is kept too
    weight = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)  # 40 rows: padded to 48 for the tiles
    raw, expected = gguf_blocks(kind, weight)
    blocks = unpack_blocks(kind, raw, 40, 64)
    kernel = GroupInt8Weight.from_blocks(blocks) if kind == "Q8_0" else Int4Weight.from_blocks(blocks)
    assert kernel.native and kernel.packed.nbytes == 3 * 2 * (544 if kind == "Q8_0" else 320)
    assert torch.equal(kernel.dequantize(), torch.from_numpy(expected))
    assert torch.equal(kernel.dense.float(), torch.from_numpy(expected).bfloat16().float())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_torch_int4_repack_keeps_the_codes_and_rounds_only_the_scales_to_bf16(monkeypatch, kind):
    monkeypatch.setattr(native, "NATIVE_QMATMUL", False)
    weight = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)  # 40 rows: padded to 48 for the packing
    raw, expected = gguf_blocks(kind, weight)
    blocks = unpack_blocks(kind, raw, 40, 64)
    kernel = Int4Weight.from_blocks(blocks)
    # What the kernel computes, from the same codes and its bf16 scale and zero per block.
    scales = blocks.scales.bfloat16().float().repeat_interleave(32, dim=1)
    zeros = (blocks.mins + 8 * blocks.scales if kind == "Q4_1" else torch.zeros_like(blocks.scales)).bfloat16().float()
    recomputed = (blocks.codes.float() - 8) * scales + zeros.repeat_interleave(32, dim=1)
    dequantized = kernel.dequantize()
    assert torch.equal(dequantized, recomputed.bfloat16().float())
    step = blocks.scales.abs().repeat_interleave(32, dim=1)
    reference = torch.from_numpy(expected)
    assert ((dequantized - reference).abs() <= step / 16 + reference.abs() / 128).all()  # far below the quantization step


def test_q8_0_blocks_run_on_torch_as_two_int4_planes_with_their_own_codes_and_scales(monkeypatch):
    monkeypatch.setattr(native, "NATIVE_QMATMUL", False)
    weight = np.random.default_rng(2).standard_normal((40, 64)).astype(np.float32)
    raw, expected = gguf_blocks("Q8_0", weight)
    blocks = unpack_blocks("Q8_0", raw, 40, 64)
    kernel = GroupInt8Weight.from_blocks(blocks)
    exact = (blocks.codes.float().view(40, 2, 32) * blocks.scales.bfloat16().float()[..., None]).view(40, 64)
    assert torch.equal(kernel.dense.float(), exact.bfloat16().float())
    # Each plane's identity matmul comes back rounded to bf16: within a bf16 step of the value.
    assert ((kernel.dequantize() - exact).abs() <= exact.abs() / 128 + blocks.scales.abs().repeat_interleave(32, 1)).all()
    assert ((exact - torch.from_numpy(expected)).abs() <= torch.from_numpy(expected).abs() / 128).all()


@pytest.mark.parametrize("make", [Int4Weight.from_dense, Int8Weight.from_dense, GroupInt8Weight.from_dense], ids=["int4", "int8", "group-int8"])
@pytest.mark.parametrize("num_rows", [1, 3, 40])
def test_quantized_matmul_matches_the_dense_matmul_of_its_dequantized_weight(kernel_path, make, num_rows):
    g = torch.Generator().manual_seed(3)
    kernel = make(torch.randn(80, 128, generator=g))
    x = torch.randn(num_rows, 128, generator=g).bfloat16().float()
    expected = x @ kernel.dequantize().t()
    got = kernel.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (num_rows, 80)
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item())
    limits = ("INT8_KERNEL_MAX_ROWS", "INT4_KERNEL_MAX_ROWS", "GROUP_INT8_KERNEL_MAX_ROWS", "TORCH_INT4_KERNEL_MAX_ROWS")
    assert max(getattr(kernels, name) for name in limits) < 40  # 40 rows ran the dense bf16 copy


def test_int4_at_load_refuses_input_features_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="int4 needs input features in whole groups of 32, got 48"):
        Int4Weight.from_dense(torch.randn(16, 48))


def q4_1_tensors(model_dir) -> dict[str, NativeTensor]:
    """Every 2-D weight of a safetensors checkpoint quantized to Q4_1 by gguf (the norms stay F32)."""
    from safetensors.torch import load_file

    native = {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if tensor.ndim == 2 and "embed" not in name:
            raw, _ = gguf_blocks("Q4_1", tensor.float().numpy())
            native[name] = NativeTensor("Q4_1", unpack_blocks("Q4_1", raw, *tensor.shape))
        else:
            native[name] = NativeTensor("F32", None)
    return native


def rank_model(config: ModelConfig, model_dir, rank: int, size: int) -> DecoderModel:
    model = DecoderModel.empty(config, 64, torch.float32, TPGroup(rank, size))
    load_weights(model, model_dir)
    return model


@pytest.mark.parametrize("weights", ["native", "int4", "int8"])
def test_tp_2_shards_of_quantized_weights_equal_the_slices_of_tp_1(tiny_llama_dir, weights):
    config = ModelConfig.from_dir(tiny_llama_dir)
    native = q4_1_tensors(tiny_llama_dir)
    models = [rank_model(config, tiny_llama_dir, rank, size) for rank, size in ((0, 1), (0, 2), (1, 2))]
    for model in models:
        apply_native(model, native) if weights == "native" else apply_weights(model, weights)
    whole = {name: m.quantized.dequantize() for name, m in linear_layers(models[0])}
    for rank, model in enumerate(models[1:]):
        for name, module in linear_layers(model):
            assert module.weight is None and module.quantized.kind == ("int8" if weights == "int8" or name == "lm_head" and weights == "int4" else "int4")
            if name.endswith(("o_proj", "down_proj")):  # row-parallel: a range of input features
                if weights == "int8":
                    continue  # per-row scales of a shard's columns differ from the whole row's, by design
                expected = whole[name][:, module.columns.start : module.columns.stop]
            else:
                rows = module.quantized.shape[0]
                expected = torch.cat([whole[name][start : start + len(r)] for start, r in _row_runs(models[0], model, name)])
                assert expected.shape[0] == rows
            assert torch.equal(module.quantized.dequantize(), expected), name


def _row_runs(whole: DecoderModel, shard: DecoderModel, name: str):
    """``(first row in the TP 1 weight, rows)`` of each part a column-parallel shard holds."""
    full, part = whole.get_submodule(name), shard.get_submodule(name)
    for key, rows in part.parts.items():
        yield full._offsets[key] + rows.start, rows


def test_a_tp_split_inside_a_32_weight_block_is_refused_naming_the_layer(tiny_llama_dir):
    config = ModelConfig.from_dir(tiny_llama_dir)  # 4 heads of 16: TP 4 gives o_proj 16 input features
    model = rank_model(config, tiny_llama_dir, 0, 4)
    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.self_attn\.o_proj: cannot hold native weights on this rank \(columns 0:16 cut a 32-weight Q4_1 block\)"):
        apply_native(model, q4_1_tensors(tiny_llama_dir))


def test_a_gguf_type_the_engine_cannot_run_is_refused_by_name(tmp_path, tiny_llama_dir):
    path = tmp_path / "q6k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((2, 210), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"tensor 'blk\.0\.attn_q\.weight' has GGUF type Q6_K, which native weights cannot run \(supported: Q4_0, Q4_1, Q8_0, F16, BF16, F32\)"):
        read_native_tensors(path, ModelConfig.from_dir(tiny_llama_dir))


def test_fp32_weights_in_a_bfloat16_model_are_refused_at_start_up_with_the_supported_pairs(tiny_llama_dir):
    with pytest.raises(ValueError) as error:
        make_engine(tiny_llama_dir, dtype="bfloat16", weights="fp32")
    assert str(error.value) == (
        "weights: 'fp32' with dtype 'bfloat16' is not supported (supported: "
        "dtype float32: weights native, fp32, bf16, int8, int4; dtype bfloat16: weights native, bf16, int8, int4)"
    )


def test_native_f16_and_f32_tensors_run_in_bf16_and_as_loaded(tiny_llama_dir):
    config = ModelConfig.from_dir(tiny_llama_dir)
    model = rank_model(config, tiny_llama_dir, 0, 1)
    native = {name: NativeTensor("F16" if "mlp" in name else "F32", None) for name in q4_1_tensors(tiny_llama_dir)}
    apply_native(model, native)
    for name, module in linear_layers(model):
        if ".mlp." in name:
            assert module.quantized.kind == "dense" and module.quantized.weight.dtype == torch.bfloat16, name
        else:
            assert module.quantized is None and module.weight.dtype == torch.float32, name


def test_engines_computing_at_different_precisions_never_share_kv_blocks(tiny_llama_dir):
    """The same checkpoint run as int4 and as fp32 writes different K/V: its key namespace (prefix
    cache, Redis tier, hand-off compatibility) tells them apart; the same precision shares it."""
    fp32 = make_engine(tiny_llama_dir, weights="fp32").namespace
    assert make_engine(tiny_llama_dir, weights="fp32").namespace == fp32
    int4 = make_engine(tiny_llama_dir, weights="int4").namespace
    bf16_model = make_engine(tiny_llama_dir, dtype="bfloat16", weights="bf16").namespace
    assert len({fp32.weights_fingerprint, int4.weights_fingerprint, bf16_model.weights_fingerprint}) == 3
    assert fp32.root_key() != int4.root_key()


def test_int8_weights_run_the_c_kernel_holding_the_very_codes_and_scales_of_torchs_per_row_int8(native_qmatmul, tiny_llama_dir):
    """--weights int8 where the C kernel runs: each layer is Q8 tiles whose 32-groups carry their
    row's scale, dequantizing to exactly what torch's per-row int8 weight holds."""
    model = rank_model(ModelConfig.from_dir(tiny_llama_dir), tiny_llama_dir, 0, 1)
    dense = {name: module.weight.data.clone() for name, module in linear_layers(model)}
    apply_weights(model, "int8")
    for name, module in linear_layers(model):
        assert isinstance(module.quantized, GroupInt8Weight) and module.quantized.native, name
        assert torch.equal(module.quantized.dequantize(), Int8Weight.from_dense(dense[name]).dequantize()), name


def test_int8_weights_stay_on_torchs_kernel_where_the_c_kernel_cannot_take_them(native_qmatmul, monkeypatch):
    g = torch.Generator().manual_seed(3)
    assert isinstance(_int8(torch.randn(16, 64, generator=g)), GroupInt8Weight)
    assert isinstance(_int8(torch.randn(16, 48, generator=g)), Int8Weight)  # 48 input features cut a 32-group
    assert isinstance(_int8(torch.randn(16, 64, generator=g) * 1e9), Int8Weight)  # scales ~1e7: beyond fp16
    monkeypatch.setattr(native, "NATIVE_QMATMUL", False)
    assert isinstance(_int8(torch.randn(16, 64, generator=g)), Int8Weight)


@pytest.mark.parametrize("cpu_bf16", [True, False], ids=["cpu-bf16", "no-bf16"])
@pytest.mark.parametrize("make", [Int4Weight.from_dense, GroupInt8Weight.from_dense], ids=["int4", "group-int8"])
def test_native_weights_keep_a_dense_bf16_copy_for_many_rows_only_where_the_cpu_multiplies_bf16(native_qmatmul, monkeypatch, make, cpu_bf16):
    """Without AVX512-BF16/AMX a bf16 GEMM is slower than the C kernel at any row count: the weight
    keeps no copy (its memory is the packed codes alone) and a prompt-sized matmul runs the kernel."""
    monkeypatch.setattr(native, "CPU_BF16", cpu_bf16)
    g = torch.Generator().manual_seed(5)
    weight = make(torch.randn(48, 64, generator=g))
    x = torch.randn(40, 64, generator=g)  # past both kernels' row limits
    assert (weight.dense is not None) == cpu_bf16
    one_at_a_time = torch.cat([weight.matmul(row[None]) for row in x])  # the kernel's own rows
    if cpu_bf16:
        assert torch.equal(weight.matmul(x), torch.nn.functional.linear(x.bfloat16(), weight.dense).float())
    else:
        assert torch.equal(weight.matmul(x), one_at_a_time)
