"""Reading the paged pool, shared by the decode (``paged_attention.py``) and prefill (``paged_prefill.py``) kernels.

The pool is the engine's KV buffer in its real byte layout (``kv_store/layout.py``), read in
place: ``pool_views`` gives its views and offsets, ``load_kv_tile`` gathers a tile of K and V
from the blocks in a table (FP8 codes widened exactly in registers, ``_widen``), ``check_pool``
makes the checks both kernels make of it. ``dot_types``, ``head_dim_pad`` and ``has_native_fp8``
pick the kernels' dot dtype, padded head size and FP8 conversion: dots run in ``q``'s dtype
with float32 accumulation, float32 queries in IEEE float32; under Triton's interpreter a
bfloat16 dot runs in float32 instead, as the interpreter (3.x) multiplies bfloat16 operands as
their integer bits.

``dequantized_layer`` is reference code (torch's own casts), shared by the two torch
references, never by a kernel.
"""

from __future__ import annotations

import torch

from engine.kernels.triton_common import INTERPRETED
from engine.kv_cache import STORAGE_DTYPES
from kv_store.layout import KVBlockLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # the serving image runs without Triton; only the kernels need it
    triton = None

KV_KINDS = {"fp32": 0, "bf16": 1, "fp8_e4m3": 2}
"""The pool's storage as the kernels' ``KV_KIND`` constant."""
_KV_POINTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": torch.uint8}
MIN_DOT = 16
"""The smallest side of a ``tl.dot`` operand."""
LOG2E = 1.4426950408889634
"""The kernels' softmax runs in base 2: scores are scaled by ``sm_scale * LOG2E``."""
_FLOAT32_FROM_E4M3_MASK = tl.constexpr(0x87F00000 - (1 << 32)) if triton is not None else None
_REBIAS = tl.constexpr(2.0**120) if triton is not None else None

if triton is not None:

    @triton.jit
    def _widen(raw, KV_KIND: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
        """Stored K/V values as DOT_DTYPE; FP8 stays unscaled (the caller folds the scale in).

        Without a hardware e4m3 conversion (before sm_89) the code's bits are moved into a
        float32 as kv_store/fp8.py does on CPU: exact, a shift, a mask and a multiply.
        """
        if KV_KIND != 2:
            values = raw.to(DOT_DTYPE)
        elif NATIVE_FP8:
            values = raw.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
        else:
            bits = (raw.to(tl.int8, bitcast=True).to(tl.int32) << 20) & _FLOAT32_FROM_E4M3_MASK
            values = (bits.to(tl.float32, bitcast=True) * _REBIAS).to(DOT_DTYPE)
        return values

    @triton.jit
    def load_kv_tile(
        kv_ptr, scale_ptr, table_row_ptr, tokens, token_ok,
        kv_offset, v_offset, block_stride, scale_block_stride, scale_offset,
        KV_KIND: tl.constexpr, NATIVE_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    ):
        """K and V of ``tokens`` (positions ``[TILE]`` of one sequence) for one KV head and layer.

        Returns ``(k, v, k_scale, v_scale)``: ``k``, ``v`` as ``[TILE, HEAD_DIM_PAD]`` in
        DOT_DTYPE, FP8 codes unscaled; the scales ``[TILE]``, each token's block's (1 for
        unscaled pools). Tokens outside ``token_ok`` read nothing and come out as zeros.
        Offsets are in elements of ``kv_ptr``'s type (``scale_*`` in float32s) so that each
        row of ``head_dim`` values is one contiguous, vectorizable load.
        """
        dims = tl.arange(0, HEAD_DIM_PAD)
        block_ids = tl.load(table_row_ptr + tokens // BLOCK_SIZE, mask=token_ok, other=0).to(tl.int64)
        rows = block_ids * block_stride + kv_offset + (tokens % BLOCK_SIZE) * HEAD_DIM
        ptrs = kv_ptr + rows[:, None] + dims[None, :]
        mask = token_ok[:, None] & (dims < HEAD_DIM)[None, :]
        k = _widen(tl.load(ptrs, mask=mask, other=0), KV_KIND, NATIVE_FP8, DOT_DTYPE)
        v = _widen(tl.load(ptrs + v_offset, mask=mask, other=0), KV_KIND, NATIVE_FP8, DOT_DTYPE)
        if KV_KIND == 2:
            scale_ptrs = scale_ptr + block_ids * scale_block_stride + scale_offset
            k_scale = tl.load(scale_ptrs, mask=token_ok, other=0.0)
            v_scale = tl.load(scale_ptrs + 1, mask=token_ok, other=0.0)
        else:
            k_scale = token_ok.to(tl.float32)
            v_scale = k_scale
        return k, v, k_scale, v_scale

    @triton.jit
    def attend_tile(
        q, k, v, k_scale, v_scale, seen, qk_scale, running_max, running_sum, acc,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """One tile of keys (``load_kv_tile``'s) into a flash-attention accumulator, online softmax
        in base 2: scores of ``q`` with each key's block scale folded in (``qk_scale`` carries
        ``sm_scale * log2(e)``), keys not ``seen`` by a row masked out, V's scales folded into the
        weights. The caller guarantees every row sees at least one key in its first tile, so the
        running max is finite from then on. Returns ``(running_max, running_sum, acc)``."""
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (k_scale * qk_scale)[None, :]
        scores = tl.where(seen, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        weights = (probs * v_scale[None, :]).to(DOT_DTYPE)
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision=DOT_PRECISION)
        return new_max, running_sum, acc


def pool_views(pool: torch.Tensor, layout: KVBlockLayout, layer: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """The pool as the kernels read it: ``(kv, scales, strides)``.

    ``kv`` views the bytes as the storage's element (uint8 codes for FP8), ``scales`` as
    float32; ``strides`` are ``load_kv_tile``'s offsets in those units: per block, per KV head,
    ``layer``'s K, K to V; then the scales' per block, per KV head, ``layer``'s K scale.
    """
    element = layout.element_bytes
    tile_elements = layout.block_size * layout.head_dim
    kv = pool.view(_KV_POINTER_DTYPES[layout.kv_dtype])
    strides = (
        layout.block_bytes // element, layout.head_bytes // element, layer * 2 * tile_elements, tile_elements,
        layout.block_bytes // 4, layout.num_layers * 2, layout.scales_offset // 4 + layer * 2,
    )
    return kv, pool.view(torch.float32), strides


def dot_types(q: torch.Tensor) -> tuple:
    """``(DOT_DTYPE, DOT_PRECISION)`` for queries ``q``: its own dtype, float32 in IEEE (module docstring)."""
    if q.dtype == torch.float16:
        return tl.float16, "tf32"
    if q.dtype == torch.bfloat16 and not INTERPRETED:
        return tl.bfloat16, "tf32"
    return tl.float32, "ieee"


def head_dim_pad(head_dim: int) -> int:
    """The kernels' ``HEAD_DIM_PAD``: a power of two, at least a dot's 16."""
    return max(MIN_DOT, triton.next_power_of_2(head_dim))


def has_native_fp8(q: torch.Tensor) -> bool:
    """Whether the device converts e4m3 in hardware (sm_89 and later; the interpreter emulates it)."""
    return q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) >= (8, 9)


def check_pool(pool: torch.Tensor, layout: KVBlockLayout, layer: int) -> None:
    """The checks every paged kernel makes of its pool, layout and layer."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != layout.block_bytes or not pool.is_contiguous():
        raise ValueError(f"pool: expected contiguous uint8 [num_blocks, {layout.block_bytes}], got {pool.dtype} {list(pool.shape)}")
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer: {layer} outside [0, {layout.num_layers})")


def dequantized_layer(blocks: torch.Tensor, layout: KVBlockLayout, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` from whole blocks (``uint8 [n, block_bytes]``) as float32 ``[kv_heads, n * block_size, head_dim]``.

    Reference code (torch's casts), shared by the decode and prefill references, never by a kernel.
    """
    n = blocks.shape[0]
    payload = blocks[:, : layout.payload_bytes].contiguous().view(STORAGE_DTYPES[layout.kv_dtype])
    values = payload.view(n, *layout.payload_shape)[:, :, layer].float()  # [n, kv_heads, 2, block_size, head_dim]
    if layout.has_scales:
        trailer = blocks[:, layout.scales_offset : layout.scales_offset + layout.scale_bytes].contiguous()
        scales = trailer.view(torch.float32).view(n, *layout.scale_shape)[:, :, layer]  # [n, kv_heads, 2]
        values = values * scales[..., None, None]
    per_head = values.permute(1, 2, 0, 3, 4).reshape(layout.num_kv_heads, 2, n * layout.block_size, layout.head_dim)
    return per_head[:, 0], per_head[:, 1]
