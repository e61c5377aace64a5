"""A small step's decoder layers in one C call (``_cpu_decoder.c``): the CPU's CUDA graph.

On a small model a decode step is mostly Python: SmolLM2 at one sequence spends ~4 ms in its
kernels and ~4 ms in the thirty layers' torch ops and wrapper calls around them. ``FusedLayers``
binds a model's weights once (at load, ``engine/build.py``) and then runs every layer of a step
in C, calling the very kernels the layers call (``engine/quant/native.py``,
``cpu_attention.py``), in the same float32 order: results match the Python path bit for bit but
for SiLU's exp (within an ulp). The Python layers stay the reference and serve every step this
does not cover.

A model qualifies when its layers are exactly what the C side does: one tensor-parallel rank,
float32 activations, a dense gated-SiLU MLP, no biases, no q/k norms, and every projection in a
native Q4/Q8 layout (``--weights native|int4`` on the C kernels). A step qualifies when its
matmuls would take the quantized kernels anyway (at most ``MAX_ROWS`` tokens) and its prefill
chunks are short enough for the C attention (speculative verify chunks).
"""

from __future__ import annotations

import numpy as np
import torch  # first: the extension's kernels run on the libgomp torch loaded

from engine.kernels import cpu_attention
from engine.layers.attention import NATIVE_MAX_CHUNK_TOKENS, AttentionBatch
from engine.layers.mlp import GatedMLP
from engine.quant import kernels as qkernels

try:
    from engine.kernels import _cpu_decoder as _native
except ImportError:  # not built, or _qmatmul / _cpu_attention missing: the layers run in Python
    _native = None

NATIVE_DECODER = _native is not None
"""Whether small steps may run their layers in C (tests switch it off to compare)."""

MAX_ROWS = min(qkernels.INT4_KERNEL_MAX_ROWS, qkernels.GROUP_INT8_KERNEL_MAX_ROWS)
"""Most tokens a fused step takes: past it the layers' matmuls run on the dense bf16 copy."""

_FORMATS = {qkernels.Int4Weight: 0, qkernels.GroupInt8Weight: 1}


class FusedLayers:
    """A model's decoder layers bound for ``_cpu_decoder.run``."""

    def __init__(self, plan: object) -> None:
        self._plan = plan

    @classmethod
    def of(cls, model) -> FusedLayers:
        """``model``'s layers bound; the model must qualify (``unsupported(model)`` is None)."""
        layers, dims = plan_args(model)
        return cls(_native.plan(layers, *dims))

    def covers(self, batch: AttentionBatch, num_tokens: int) -> bool:
        """Whether this step's layers run here: few tokens, short chunks, the switch on."""
        return (
            NATIVE_DECODER
            and 0 < num_tokens <= MAX_ROWS
            and all(chunk.num_tokens <= NATIVE_MAX_CHUNK_TOKENS for chunk in batch.prefill_chunks)
        )

    def run(self, hidden: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Every layer on ``hidden`` [tokens, hidden] (float32; updated in place and returned),
        filling ``batch.new_k`` / ``new_v`` as the layers do."""
        seqs = cpu_attention.PagedSequences.joined([g.sequences for g in batch.decode_groups] + [c.sequences for c in batch.prefill_chunks])
        tokens = hidden.shape[0]
        pool = batch.kv_cache.native
        _native.run(
            self._plan, hidden.numpy(), batch.rope_cos.view(tokens, -1).numpy(), batch.rope_sin.view(tokens, -1).numpy(),
            batch.new_k.numpy(), batch.new_v.numpy(), pool.array, pool.layout_args,
            seqs.block_tables, seqs.starts, seqs.query_starts, torch.get_num_threads(),
        )
        return hidden


def unsupported(model) -> str | None:
    """Why ``model``'s layers cannot run fused, or None when they can."""
    config = model.config
    if not NATIVE_DECODER:
        return "the _cpu_decoder extension is not built"
    if model.shard.size > 1 or model.ep.size > 1:
        return "tensor or expert parallel"
    if config.moe is not None:
        return "a mixture of experts"
    if config.qkv_bias or config.o_bias or config.qk_norm:
        return "QKV/O biases or q/k norms"
    if model.held_layers[0].input_layernorm.weight.dtype != torch.float32:
        return "activations are not float32"
    for index, layer in enumerate(model.held_layers, start=model.stage.layers.start):
        if not isinstance(layer.mlp, GatedMLP) or layer.mlp.gate_up_proj.bias is not None:
            return f"layer {index}'s MLP is not a dense gated SiLU without bias"
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            weight = proj.quantized
            if type(weight) not in _FORMATS or not weight.native:
                return f"layer {index}: a projection is {type(weight).__name__ if weight is not None else 'dense'}, not a native Q4/Q8 weight"
    return None


def plan_args(model) -> tuple[tuple, tuple[int, int, int, int, int, float]]:
    """``_cpu_decoder.plan``'s arguments for ``model``: per layer (input norm, post norm, and the
    QKV, O, gate/up and down projections as (format, packed bytes, out, in, activation planes)), then (heads, KV
    heads, head dim, hidden, intermediate, eps)."""
    layers = tuple(
        (
            layer.input_layernorm.weight.detach().numpy(),
            layer.post_attention_layernorm.weight.detach().numpy(),
            *(_linear(proj) for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)),
        )
        for layer in model.held_layers
    )
    config = model.config
    intermediate = model.held_layers[0].mlp.gate_up_proj.quantized.shape[0] // 2  # the fused gate/up's rows
    return layers, (model.held_layers[0].self_attn.num_heads, model.num_kv_heads, config.head_dim, config.hidden_size, intermediate, config.rms_norm_eps)


def _linear(proj) -> tuple[int, np.ndarray, int, int, int]:
    weight = proj.quantized
    return _FORMATS[type(weight)], weight.packed.numpy(), weight.shape[0], weight.shape[1], weight.act_planes
