"""Read a GGUF's linear-layer tensors at their own precision, for ``--weights native``.

The converted safetensors checkpoint (``gguf_convert``) holds every tensor dequantized to
float32; it still supplies the norms and the embedding table. This module reads the GGUF's
tensors again (``gguf_tensors``, without parsing its metadata) and returns, per Hugging Face
tensor name, the tensor's GGUF type and, for the block types, its blocks (``BlockQuant``) with
llama.cpp's Q/K row order undone, so the linear layers can run on exactly the shipped codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import UnsupportedModelError
from engine.loader.gguf_convert import hf_tensor_name, unpermute_rope_rows
from engine.loader.gguf_tensors import read_gguf_tensors
from engine.model_config import ModelConfig
from engine.quant.blocks import BlockQuant, unpack_blocks

BLOCK_KINDS = ("Q4_0", "Q4_1", "Q8_0")
"""GGUF types whose blocks run as they are (on the int4 kernel; Q8_0 as two 4-bit planes)."""
NATIVE_TYPES = BLOCK_KINDS + ("F16", "BF16", "F32")
"""GGUF types ``--weights native`` can run."""


@dataclass(frozen=True)
class NativeTensor:
    """One GGUF tensor as native weights see it."""

    kind: str
    """Its GGUF type name (Q4_1, Q8_0, F32, ...)."""
    blocks: BlockQuant | None
    """Its blocks in Hugging Face row order; None for the float types (read from the checkpoint)."""


def read_native_tensors(gguf_path: Path, config: ModelConfig) -> dict[str, NativeTensor]:
    """Every tensor of the GGUF under its Hugging Face name; ``UnsupportedModelError`` naming the
    first tensor whose type the engine cannot run."""
    tensors: dict[str, NativeTensor] = {}
    for tensor in read_gguf_tensors(gguf_path):
        name = hf_tensor_name(tensor.name, gguf_path)
        kind = tensor.kind
        if kind not in NATIVE_TYPES:
            raise UnsupportedModelError(
                f"{gguf_path}: tensor {tensor.name!r} has GGUF type {kind}, which native weights cannot run "
                f"(supported: {', '.join(NATIVE_TYPES)}); load it dequantized with --weights fp32, bf16, int8 or int4"
            )
        blocks = None
        if kind in BLOCK_KINDS:
            cols, rows = tensor.dims
            blocks = unpack_blocks(kind, tensor.data, rows, cols)
            heads = _rope_heads(name, config)
            if heads is not None:
                order = unpermute_rope_rows(np.arange(rows), heads)
                blocks = blocks.permute_rows(torch.from_numpy(np.ascontiguousarray(order)))
        tensors[name] = NativeTensor(kind, blocks)
    return tensors


def _rope_heads(name: str, config: ModelConfig) -> int | None:
    if name.endswith("q_proj.weight"):
        return config.num_heads
    if name.endswith("k_proj.weight"):
        return config.num_kv_heads
    return None
