"""Put a loaded model's linear layers at the precision ``EngineConfig.weights`` asks for.

``load_weights`` fills every parameter in the model dtype first; this then swaps each linear
layer's dense weight for a kernel-layout one (``engine/quant/kernels.py``) and drops the dense
parameter. Native GGUF blocks are the exception (``load_native``): their layers are built from
the blocks before loading, and the checkpoint's float32 copies of them are never read. The embedding table, the norms and the experts of MoE blocks stay as loaded: a
lookup reads one row per token, and the experts' stacked weights have no quantized kernel here.

``weights``:
- ``native``: a GGUF-sourced model runs its Q4_0/Q4_1/Q8_0 blocks as they are (the C kernel of
  ``quant/native.py``, or torch's int4 kernel where it is not built, Q8_0 then as two 4-bit
  planes), F16/BF16 in bf16, F32 in the model dtype; a safetensors checkpoint as stored (in the
  model dtype).
- ``fp32`` / ``bf16``: dense, in that dtype (``bf16`` in a float32 model runs its matmuls in bf16).
- ``int8``: symmetric per output channel; ``int4``: asymmetric per group of 32 input features,
  except the LM head, which stays int8 (as llama.cpp's 4-bit files keep their output layer at
  6-8 bits), per output channel and run as a group-32 int8 weight (the Q8 kernel).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from engine.errors import UnsupportedModelError
from engine.loader.gguf_native import BLOCK_KINDS, NativeTensor
from engine.loader.weights import checkpoint_target, load_weights
from engine.models.decoder import DecoderModel
from engine.parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.quant.blocks import GROUP_SIZE, BlockQuant
from engine.quant import native as native_kernels
from engine.quant.kernels import DenseWeight, GroupInt8Weight, Int4Weight, Int8Weight, QuantizedWeight, quantize_per_row

SUPPORTED_WEIGHTS = {
    "float32": ("native", "fp32", "bf16", "int8", "int4"),
    "bfloat16": ("native", "bf16", "int8", "int4"),
}
"""Weights each model dtype (the activations') runs with; fp32 weights in a bf16 model would only be rounded."""

Linear = ColumnParallelLinear | RowParallelLinear


def check_weights_dtype(weights: str, dtype: str) -> None:
    """``ValueError`` listing the supported pairs when ``weights`` cannot run with ``dtype``."""
    if weights not in SUPPORTED_WEIGHTS.get(dtype, ()):
        supported = "; ".join(f"dtype {d}: weights {', '.join(w)}" for d, w in SUPPORTED_WEIGHTS.items())
        raise ValueError(f"weights: {weights!r} with dtype {dtype!r} is not supported (supported: {supported})")


def apply_weights(model: DecoderModel, weights: str) -> None:
    """Convert ``model``'s linear layers (already loaded) to ``weights``. ``native`` keeps them as
    loaded: a checkpoint converted from a GGUF loads through ``load_native`` instead."""
    if weights == "native":
        return
    for name, module in linear_layers(model):
        _convert(name, module, weights, lambda: _at_load(module, weights, name == "lm_head"))


def apply_native(model: DecoderModel, native: dict[str, NativeTensor]) -> None:
    """Run ``model``'s linear layers on the GGUF tensors ``native`` (by Hugging Face name), each
    rank on its slice; a slice that cuts a 32-weight block is refused."""
    layers = dict(linear_layers(model))
    _convert_native(layers, list(layers), _sources_by_module(model, native))


def load_native(model: DecoderModel, checkpoint_dir: Path, native: dict[str, NativeTensor]) -> None:
    """Load an empty ``model`` for ``--weights native`` from its converted checkpoint and the
    GGUF tensors ``native`` it was converted from (by Hugging Face name).

    Linear layers whose tensors are GGUF blocks are built from the blocks before anything is
    read, and their float32 copies in the checkpoint are skipped: reading and widening them only
    to drop them doubled start-up time and peak memory. The rest (embedding, norms, biases,
    experts, float-typed GGUF tensors) is read from the checkpoint, then converted as
    ``apply_native`` does.
    """
    sources = _sources_by_module(model, native)
    layers = dict(linear_layers(model))
    # Largest first: the LM head's repacking needs several int32 copies of it for a moment,
    # cheaper before the other layers' kernels are held.
    from_blocks = sorted((name for name in layers if _runs_blocks(sources.get(name, []))), key=lambda name: -layers[name].weight.numel())
    _convert_native(layers, from_blocks, sources)
    load_weights(model, checkpoint_dir, skip=_weight_tensor_names(model, native, set(from_blocks)))
    _convert_native(layers, [name for name in layers if name not in from_blocks], sources)


def _convert_native(layers: dict[str, Linear], names: list[str], sources: dict[str, list[tuple[str | None, NativeTensor]]]) -> None:
    """Convert the layers ``names`` (in that order) to their GGUF tensors in ``sources``."""
    for name in names:
        module = layers[name]
        _convert(name, module, "native", lambda: _native(module, sources.get(name, [])))


def _weight_tensor_names(model: DecoderModel, native: dict[str, NativeTensor], module_names: set[str]) -> frozenset[str]:
    """The checkpoint tensors that fill the ``weight`` of the layers ``module_names``."""
    names = set()
    for hf_name in native:
        module_name, _, attr = checkpoint_target(hf_name, model).param.rpartition(".")
        if attr == "weight" and module_name in module_names:
            names.add(hf_name)
    return frozenset(names)


def _convert(name: str, module: Linear, weights: str, make) -> None:
    try:
        converted = make()
    except ValueError as e:
        raise UnsupportedModelError(f"{name}: cannot hold {weights} weights on this rank ({e}); use --weights bf16 or fp32, or another tp_size") from e
    if converted is not None:
        module.use_weight(converted)


def set_act_planes(model: DecoderModel, planes: int) -> None:
    """Run every layer on the C kernel with ``planes`` int8 planes of activations (EngineConfig.act_planes).
    Raises ValueError for 1 plane when no layer runs the kernel: the setting would change nothing."""
    kernel_weights = [m.quantized for _, m in linear_layers(model) if getattr(m.quantized, "native", False)]
    if planes != 2 and not kernel_weights:
        why = "the C kernel is not built or this CPU lacks AVX2" if not native_kernels.NATIVE_QMATMUL else "its weights are dense"
        raise ValueError(f"act_planes: {planes} sets the quantized C kernel, but no layer of this model runs it ({why}); "
                         "use weights native (a GGUF model), int8 or int4, or act_planes 2")
    for weight in kernel_weights:
        weight.act_planes = planes


def linear_layers(model: DecoderModel) -> Iterator[tuple[str, Linear]]:
    """``(name, module)`` of every column- or row-parallel linear layer, the LM head included."""
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            yield name, module


def _at_load(module: Linear, weights: str, is_lm_head: bool) -> QuantizedWeight | None:
    dense = module.weight.data
    if weights == "int4":
        return GroupInt8Weight.from_dense(dense) if is_lm_head else Int4Weight.from_dense(dense)
    if weights == "int8":  # an int4 LM head cost SmolLM2 ~10% mean error per logit weight: int8 it is
        return _int8(dense)
    if weights == "bf16" and dense.dtype != torch.bfloat16:
        return DenseWeight(dense.to(torch.bfloat16))
    return None


def _int8(dense: torch.Tensor) -> QuantizedWeight:
    """Per-row int8 (``quantize_per_row``). Where the C kernel runs, the same codes and scales go
    to its Q8 tiles, every 32-weight group carrying its row's scale: torch's int8 kernel
    multiplies in bf16, which a CPU without AVX512-BF16/AMX widens on every call. A row that does
    not split into whole groups (a narrow tensor-parallel shard) or a scale fp16 cannot hold
    stays on torch's kernel."""
    codes, scales = quantize_per_row(dense)
    if native_kernels.NATIVE_QMATMUL and dense.shape[1] % GROUP_SIZE == 0:
        try:
            return GroupInt8Weight.from_per_row(codes, scales)
        except ValueError:  # a scale beyond fp16's range
            pass
    return Int8Weight(codes, scales)


def _sources_by_module(model: DecoderModel, native: dict[str, NativeTensor]) -> dict[str, list[tuple[str | None, NativeTensor]]]:
    """Per linear layer, the ``(part, tensor)`` of each GGUF tensor fused into it."""
    sources: dict[str, list[tuple[str | None, NativeTensor]]] = {}
    for hf_name, tensor in native.items():
        target = checkpoint_target(hf_name, model)
        module_name, _, attr = target.param.rpartition(".")
        if attr == "weight":
            sources.setdefault(module_name, []).append((target.part, tensor))
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in native:
        sources["lm_head"] = [(None, native["model.embed_tokens.weight"])]
    return sources


def _runs_blocks(sources: list[tuple[str | None, NativeTensor]]) -> bool:
    """Whether a layer's GGUF tensors are blocks of one kind, which it runs as they are."""
    kinds = {tensor.kind for _, tensor in sources}
    return len(kinds) == 1 and kinds <= set(BLOCK_KINDS)


def _native(module: Linear, sources: list[tuple[str | None, NativeTensor]]) -> QuantizedWeight | None:
    kinds = {tensor.kind for _, tensor in sources}
    if _runs_blocks(sources):
        blocks = _rank_blocks(module, [(part, tensor.blocks) for part, tensor in sources])
        return GroupInt8Weight.from_blocks(blocks) if blocks.kind == "Q8_0" else Int4Weight.from_blocks(blocks)
    if kinds and kinds <= {"F16", "BF16"} or len(kinds) > 1:  # parts of different types fuse only dense
        return DenseWeight(module.weight.data.to(torch.bfloat16))
    return None


def _rank_blocks(module: Linear, parts: list[tuple[str | None, BlockQuant]]) -> BlockQuant:
    """This rank's slice of each part's blocks, laid out where ``weight_slices`` puts its rows
    (rows past a padded vocabulary's end stay zero).

    Column slices (a row-parallel layer's input features) must fall on block boundaries.
    """
    weight = module.weight.data
    rows, cols = weight.shape
    kind = parts[0][1].kind
    codes = torch.zeros(rows, cols, dtype=parts[0][1].codes.dtype)
    scales = torch.zeros(rows, cols // GROUP_SIZE)
    mins = torch.zeros(rows, cols // GROUP_SIZE) if parts[0][1].mins is not None else None
    for part, blocks in parts:
        for dest, index in module.weight_slices("weight", part, blocks.shape):
            first_row = (dest.storage_offset() - weight.storage_offset()) // weight.stride(0)
            piece = blocks.select(index[0], index[1] if len(index) > 1 else slice(None))
            if piece.shape[1] != cols:
                raise ValueError(f"a {piece.shape[1]}-column slice does not fill {cols} columns")
            held = slice(first_row, first_row + piece.shape[0])
            codes[held], scales[held] = piece.codes, piece.scales
            if mins is not None:
                mins[held] = piece.mins
    return BlockQuant(kind, codes, scales, mins)
