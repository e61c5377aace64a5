"""RoPE on a layer's q and k, with the step's K/V written straight into the paged pool: one launch.

The step's tokens come as runs (``KVSegments``, in ``kv_segments.py``), each a stretch of
consecutive rows of one sequence that lands in one block at consecutive slots. Grid ``(run, KV head)``: a program
rotates, in place in ``qkv``, its KV head's group of query heads and its k for the run's rows,
and writes that k and v into the pool at layer ``layer``::

    qkv row  | q heads 0 .. num_heads-1 | k heads 0 .. kv-1 | v heads 0 .. kv-1 |
                 ^ program (run, h) rotates heads h*group .. h*group+group-1, and k head h,
                   and writes k head h, v head h to block block_ids[run], slots
                   offsets[run] .. offsets[run] + num_tokens[run] - 1

The pool is ``uint8 [num_blocks, block_bytes]`` in the layout of ``kv_store/layout.py``. An FP8
program requantizes its head's whole block tile as ``PagedKVCache.write`` does: the tokens
already in the block (slots before the run) are dequantized with the old scale, the block's new
scale is ``amax / 448`` over the slots it holds after the write (1 when all are 0), every value
is divided by it, clamped to +-448 and rounded to e4m3, and slots past the run become zero
codes. Each block must appear in at most one run of a call (two programs would race on it).

Rounding is done by hand: e4m3 (``_e4m3_codes``) so that the kernel needs no hardware FP8
conversion and gives torch's codes on every GPU and in the interpreter, bfloat16 with
``round_to_bf16`` (the interpreter truncates). The kernel is compiled without FMA contraction,
so float32 rotation is the model's two rounded products and one rounded sum.

``reference_rope_write_kv`` is the torch reference, one run at a time over the same bytes.
"""

from __future__ import annotations

import torch

from engine.kernels import launches
from engine.kernels.kv_segments import KVSegments
from engine.kernels.paged_kv import KV_KINDS
from engine.kernels.triton_common import check_device
from engine.kv_cache import STORAGE_DTYPES
from kv_store.layout import KVBlockLayout

try:
    import triton
    import triton.language as tl

    from engine.kernels.fused_norm import round_to_bf16
except ImportError:  # the serving image runs without Triton; only the kernel needs it
    triton = None

_SCALE_BYTES = 4
_E4M3_MAX = tl.constexpr(448.0) if triton is not None else None
COMPILE_OPTIONS = {"enable_fp_fusion": False}
"""No FMA contraction: a float32 rotation is two rounded products and a rounded sum, as in torch."""


if triton is not None:

    @triton.jit
    def _rope_write_kv_kernel(
        qkv_ptr, positions_ptr, cos_ptr, sin_ptr, pool_ptr,
        block_ids_ptr, token_starts_ptr, offsets_ptr, num_tokens_ptr,
        row_width, num_heads, num_kv_heads, block_bytes, head_bytes, layer_k_bytes, v_offset_bytes,
        layer_scales_offset, scale_head_bytes,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MAX_TOKENS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BF16: tl.constexpr, KV_KIND: tl.constexpr, ELEMENT_BYTES: tl.constexpr,
    ):
        segment = tl.program_id(0)
        kv_head = tl.program_id(1)
        block_id = tl.load(block_ids_ptr + segment).to(tl.int64)
        live = block_id >= 0
        token_start = tl.load(token_starts_ptr + segment)
        offset = tl.load(offsets_ptr + segment)
        num_tokens = tl.where(live, tl.load(num_tokens_ptr + segment), 0)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM

        tokens = tl.arange(0, MAX_TOKENS)
        token_ok = tokens < num_tokens
        tile_ok = token_ok[:, None] & dim_ok[None, :]
        rows = (token_start + tokens).to(tl.int64)
        cos, sin = _tables(positions_ptr, cos_ptr, sin_ptr, rows, token_ok, tile_ok, dims, HEAD_DIM, BF16)
        for i in range(GROUP):
            q_ptrs = qkv_ptr + rows[:, None] * row_width + (kv_head * GROUP + i) * HEAD_DIM
            _rotate(q_ptrs, dims, tile_ok, cos, sin, HEAD_DIM, BF16)

        k_column = (num_heads + kv_head) * HEAD_DIM
        v_column = (num_heads + num_kv_heads + kv_head) * HEAD_DIM
        block_base = pool_ptr + tl.where(live, block_id, 0) * block_bytes  # in bounds for scalar loads
        k_base = block_base + kv_head * head_bytes + layer_k_bytes
        if KV_KIND != 2:
            k = _rotate(qkv_ptr + rows[:, None] * row_width + k_column, dims, tile_ok, cos, sin, HEAD_DIM, BF16)
            v = tl.load(qkv_ptr + rows[:, None] * row_width + v_column + dims[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            slot_bytes = ((offset + tokens)[:, None] * HEAD_DIM + dims[None, :]) * ELEMENT_BYTES
            _store_values(k_base + slot_bytes, k, tile_ok, KV_KIND)
            _store_values(k_base + v_offset_bytes + slot_bytes, v, tile_ok, KV_KIND)
        else:
            # One row per slot of the block: slot s holds the run's token s - offset, if any.
            slots = tl.arange(0, BLOCK_SIZE)
            new_rows_ok = (slots >= offset) & (slots < offset + num_tokens)
            new_ok = new_rows_ok[:, None] & dim_ok[None, :]
            old_ok = (slots < tl.where(live, offset, 0))[:, None] & dim_ok[None, :]
            slot_rows = (token_start + slots - offset).to(tl.int64)
            slot_cos, slot_sin = _tables(positions_ptr, cos_ptr, sin_ptr, slot_rows, new_rows_ok, new_ok, dims, HEAD_DIM, BF16)
            k = _rotate(qkv_ptr + slot_rows[:, None] * row_width + k_column, dims, new_ok, slot_cos, slot_sin, HEAD_DIM, BF16)
            v = tl.load(qkv_ptr + slot_rows[:, None] * row_width + v_column + dims[None, :], mask=new_ok, other=0.0).to(tl.float32)
            scale_ptr = (block_base + layer_scales_offset + kv_head * scale_head_bytes).to(tl.pointer_type(tl.float32))
            code_offsets = slots[:, None] * HEAD_DIM + dims[None, :]
            store_ok = (slots < tl.where(live, BLOCK_SIZE, 0))[:, None] & dim_ok[None, :]
            k_scale = _requantize(k_base + code_offsets, scale_ptr, k, new_ok, old_ok, store_ok)
            v_scale = _requantize(k_base + v_offset_bytes + code_offsets, scale_ptr + 1, v, new_ok, old_ok, store_ok)
            # Masks are compared from live, not and-ed with it: the interpreter turns a scalar & into ints.
            pair = tl.arange(0, 2)  # K's and V's scales in one store: a masked scalar store does not interpret
            tl.store(scale_ptr + pair, tl.where(pair == 0, k_scale, v_scale), mask=pair < tl.where(live, 2, 0))

    @triton.jit
    def _tables(positions_ptr, cos_ptr, sin_ptr, rows, row_ok, tile_ok, dims, HEAD_DIM: tl.constexpr, BF16: tl.constexpr):
        """cos and the rotate-half-signed sin at each row's position, rounded to the model dtype."""
        positions = tl.load(positions_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        offsets = positions[:, None] * HEAD_DIM + dims[None, :]
        cos = tl.load(cos_ptr + offsets, mask=tile_ok, other=0.0)
        sin = tl.load(sin_ptr + offsets, mask=tile_ok, other=0.0)
        sin = tl.where(dims[None, :] < HEAD_DIM // 2, -sin, sin)
        if BF16:
            cos = round_to_bf16(cos)
            sin = round_to_bf16(sin)
        return cos, sin

    @triton.jit
    def _rotate(head_ptrs, dims, mask, cos, sin, HEAD_DIM: tl.constexpr, BF16: tl.constexpr):
        """Rotates one head's rows in place: ``x * cos + roll(x, half) * signed_sin``, each op rounded."""
        x = tl.load(head_ptrs + dims[None, :], mask=mask, other=0.0).to(tl.float32)
        rolled = tl.load(head_ptrs + ((dims + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=mask, other=0.0).to(tl.float32)
        if BF16:
            out = round_to_bf16(round_to_bf16(x * cos) + round_to_bf16(rolled * sin))
        else:
            out = x * cos + rolled * sin
        tl.store(head_ptrs + dims[None, :], out.to(head_ptrs.dtype.element_ty), mask=mask)
        return out

    @triton.jit
    def _store_values(byte_ptrs, values, mask, KV_KIND: tl.constexpr):
        if KV_KIND == 0:
            tl.store(byte_ptrs.to(tl.pointer_type(tl.float32)), values, mask=mask)
        else:
            tl.store(byte_ptrs.to(tl.pointer_type(tl.bfloat16)), round_to_bf16(values).to(tl.bfloat16), mask=mask)

    @triton.jit
    def _requantize(code_ptrs, scale_ptr, new, new_ok, old_ok, store_ok):
        """One head's K (or V) tile of a block: old codes widened, new values in, the codes requantized; returns the new scale."""
        old = _e4m3_values(tl.load(code_ptrs, mask=old_ok, other=0)) * tl.load(scale_ptr)
        values = tl.where(new_ok, new, tl.where(old_ok, old, 0.0))
        amax = tl.max(tl.max(tl.abs(values), axis=1), axis=0)
        scale = tl.where(amax > 0, tl.div_rn(amax, _E4M3_MAX), 1.0)
        scaled = tl.minimum(tl.maximum(tl.div_rn(values, scale), -_E4M3_MAX), _E4M3_MAX)
        tl.store(code_ptrs, _e4m3_codes(scaled), mask=store_ok)
        return scale

    @triton.jit
    def _e4m3_values(codes):
        """e4m3 codes (uint8) as float32, exact, built without subnormal float32 intermediates."""
        bits = codes.to(tl.int32)
        exponent = (bits >> 3) & 0xF
        mantissa = bits & 0x7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormals: m * 2**-9
        return tl.where((bits & 0x80) != 0, -magnitude, magnitude)

    @triton.jit
    def _e4m3_codes(x):
        """float32 in [-448, 448] to e4m3 codes (uint8), rounding to nearest even as torch's cast does.

        Normal range (|x| >= 2**-6): round float32's 23-bit mantissa to 3 bits, carrying into
        the exponent, and rebias the exponent from 127 to 7. Below it e4m3 is fixed-point in
        steps of 2**-9: the 24-bit significand shifted right by ``141 - exponent`` (>= 21),
        rounded to even.
        """
        bits = x.to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        exponent = magnitude >> 23
        normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
        significand = (magnitude & 0x7FFFFF) | 0x800000
        shift = tl.minimum(tl.maximum(141 - exponent, 21), 26)
        quotient = significand >> shift
        remainder = significand & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        round_up = (remainder > half) | ((remainder == half) & ((quotient & 1) == 1))
        subnormal = quotient + round_up.to(tl.int32)
        code = tl.where(exponent >= 121, normal, subnormal) | ((bits >> 24) & 0x80)
        return code.to(tl.uint8)


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: torch.Tensor,
    layout: KVBlockLayout,
    layer: int,
    segments: KVSegments,
    num_heads: int,
) -> None:
    """Rotates q and k of ``segments``' rows in place in ``qkv`` and writes their k, v into ``pool`` at ``layer``.

    ``qkv``: the QKV projection's output ``[tokens, (num_heads + 2 * kv_heads) * head_dim]``,
    contiguous, float32 or bfloat16; ``positions``: ``[tokens]`` int32/int64; ``cos``, ``sin``:
    ``RotaryEmbedding.cos`` / ``.sin`` (float32 ``[max_positions, head_dim]``). The rotation is
    ``apply_rotary``'s in ``qkv``'s dtype, bit for bit. Rows in no run are left as they are.
    Values are checked on CPU only (on CUDA a check would synchronize the device), so the call
    can be captured in a CUDA graph. One launch.
    """
    if triton is None:
        raise RuntimeError("rope_write_kv needs Triton (pip install the test extras, or triton on a GPU host)")
    _check_inputs(qkv, positions, cos, sin, pool, layout, layer, segments, num_heads)
    check_device("rope_write_kv", qkv)
    if segments.num_segments == 0:
        return
    tile_bytes = layout.block_size * layout.head_dim * layout.element_bytes
    launches.record("rope_write_kv")
    _rope_write_kv_kernel[(segments.num_segments, layout.num_kv_heads)](
        qkv, positions, cos, sin, pool,
        segments.block_ids, segments.token_starts, segments.offsets, segments.num_tokens,
        qkv.shape[1], num_heads, layout.num_kv_heads, layout.block_bytes, layout.head_bytes,
        layer * 2 * tile_bytes, tile_bytes, layout.scales_offset + layer * 2 * _SCALE_BYTES, layout.num_layers * 2 * _SCALE_BYTES,
        GROUP=num_heads // layout.num_kv_heads, HEAD_DIM=layout.head_dim, HEAD_DIM_PAD=triton.next_power_of_2(layout.head_dim),
        MAX_TOKENS=triton.next_power_of_2(segments.max_tokens), BLOCK_SIZE=layout.block_size,
        BF16=qkv.dtype == torch.bfloat16, KV_KIND=KV_KINDS[layout.kv_dtype], ELEMENT_BYTES=layout.element_bytes,
        **COMPILE_OPTIONS,
    )


def reference_rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pool: torch.Tensor,
    layout: KVBlockLayout,
    layer: int,
    segments: KVSegments,
    num_heads: int,
) -> None:
    """``rope_write_kv`` in torch, one run at a time: HF's rotate-half in ``qkv``'s dtype, then
    the run's K/V stored through views of the pool's bytes (FP8 blocks requantized whole, with
    torch's own e4m3 casts)."""
    _check_inputs(qkv, positions, cos, sin, pool, layout, layer, segments, num_heads)
    num_kv_heads, head_dim, half = layout.num_kv_heads, layout.head_dim, layout.head_dim // 2
    qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(qkv.shape[0], num_heads + num_kv_heads, head_dim)
    v_all = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(qkv.shape[0], num_kv_heads, head_dim)
    payload = pool[:, : layout.payload_bytes].view(STORAGE_DTYPES[layout.kv_dtype]).view(pool.shape[0], *layout.payload_shape)
    columns = (segments.block_ids, segments.token_starts, segments.offsets, segments.num_tokens)
    for block_id, start, offset, num_tokens in zip(*(column.tolist() for column in columns)):
        if block_id < 0:
            continue
        rows = slice(start, start + num_tokens)
        x = qk[rows]
        cos_rows = cos[positions[rows]].to(qkv.dtype)[:, None]
        sin_rows = sin[positions[rows]].to(qkv.dtype)[:, None]
        qk[rows] = x * cos_rows + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin_rows
        k, v = qk[rows, num_heads:].transpose(0, 1), v_all[rows].transpose(0, 1)  # [kv_heads, tokens, head_dim]
        slots = slice(offset, offset + num_tokens)
        if not layout.has_scales:
            payload[block_id, :, layer, 0, slots] = k.to(payload.dtype)
            payload[block_id, :, layer, 1, slots] = v.to(payload.dtype)
            continue
        trailer = pool[block_id, layout.scales_offset : layout.scales_offset + layout.scale_bytes]
        scales = trailer.view(torch.float32).view(layout.scale_shape)[:, layer]  # [kv_heads, 2]
        codes = payload[block_id, :, layer]  # [kv_heads, 2, block_size, head_dim]
        values = torch.zeros(codes.shape, dtype=torch.float32, device=codes.device)
        values[:, :, :offset] = codes[:, :, :offset].float() * scales[:, :, None, None]
        values[:, 0, slots] = k.float()
        values[:, 1, slots] = v.float()
        amax = values.abs().amax(dim=(2, 3))
        new_scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        codes[:] = (values / new_scales[:, :, None, None]).clamp(-448.0, 448.0).to(codes.dtype)
        scales[:] = new_scales


def _check_inputs(qkv, positions, cos, sin, pool, layout: KVBlockLayout, layer: int, segments: KVSegments, num_heads: int) -> None:
    num_kv_heads, head_dim, block_size = layout.num_kv_heads, layout.head_dim, layout.block_size
    if block_size & (block_size - 1):
        raise ValueError(f"layout.block_size: the kernel needs a power of two, got {block_size}")
    if head_dim % 2:
        raise ValueError(f"layout.head_dim: rotate-half needs an even head_dim, got {head_dim}")
    if num_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads: must be a positive multiple of the pool's {num_kv_heads} KV heads, got {num_heads}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or not qkv.is_contiguous():
        raise ValueError(f"qkv: expected contiguous [tokens, {width}] ((num_heads + 2 * kv_heads) * head_dim), got {list(qkv.shape)}")
    if qkv.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"qkv: dtype must be float32 or bfloat16, got {qkv.dtype}")
    if positions.shape != (qkv.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: expected int32/int64 [{qkv.shape[0]}], got {positions.dtype} {list(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim or table.dtype != torch.float32 or not table.is_contiguous():
            raise ValueError(f"{name}: expected contiguous float32 [max_positions, {head_dim}], got {table.dtype} {list(table.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: shape {list(sin.shape)} differs from cos's {list(cos.shape)}")
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != layout.block_bytes or not pool.is_contiguous():
        raise ValueError(f"pool: expected contiguous uint8 [num_blocks, {layout.block_bytes}], got {pool.dtype} {list(pool.shape)}")
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer: {layer} outside [0, {layout.num_layers})")
    if segments.max_tokens > block_size:
        raise ValueError(f"segments.max_tokens: a run fits in one block of {block_size}, got {segments.max_tokens}")
    tensors = {"qkv": qkv, "positions": positions, "cos": cos, "sin": sin, "pool": pool, "segments": segments.block_ids}
    if len({t.device for t in tensors.values()}) > 1:
        raise ValueError(f"qkv, positions, cos, sin, pool and segments must share one device, got { {k: t.device for k, t in tensors.items()} }")
    if qkv.device.type == "cpu":  # reading values on a GPU would synchronize the device
        _check_values(qkv.shape[0], positions, cos.shape[0], pool.shape[0], block_size, segments)


def _check_values(num_rows: int, positions, num_positions: int, num_blocks: int, block_size: int, segments: KVSegments) -> None:
    runs = zip(*(t.tolist() for t in (segments.block_ids, segments.token_starts, segments.offsets, segments.num_tokens)))
    written = []
    for block_id, start, offset, num_tokens in runs:
        if block_id < 0:
            continue
        if block_id >= num_blocks:
            raise ValueError(f"segments.block_ids: {block_id} outside the pool's {num_blocks} blocks")
        if not 1 <= num_tokens <= segments.max_tokens:
            raise ValueError(f"segments.num_tokens: {num_tokens} outside [1, max_tokens={segments.max_tokens}]")
        if offset < 0 or offset + num_tokens > block_size:
            raise ValueError(f"segments.offsets: slots [{offset}, {offset + num_tokens}) outside a block of {block_size}")
        if start < 0 or start + num_tokens > num_rows:
            raise ValueError(f"segments.token_starts: rows [{start}, {start + num_tokens}) outside the step's {num_rows}")
        if int(positions[start : start + num_tokens].min()) < 0 or int(positions[start : start + num_tokens].max()) >= num_positions:
            raise ValueError(f"positions: rows [{start}, {start + num_tokens}) reach outside the tables' {num_positions} positions")
        written.append(block_id)
    if len(set(written)) != len(written):
        raise ValueError(f"segments.block_ids: each block may be written by one run per call, got {sorted(written)}")
