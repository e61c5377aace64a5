"""The CPU kernels of ``_cpu_attention.c``: paged attention per layer and FP8 KV writes, one C call each.

``engine/layers/attention.py`` and ``engine/kv_cache.py`` call these when the extension is built
(``NATIVE_ATTENTION``) and keep their torch code as the fallback and the reference. The C side
reads the pool's bytes in the layout of ``kv_store/layout.py``; this module only turns tensors
into the numpy views it takes (no copies) and names what it was given.

The sequences of a decode group or a prefill chunk are converted once per step
(``PagedSequences``), not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch  # first: it loads torch's libgomp.so.1, which the extension then shares (one OpenMP pool)

from kv_store.layout import KVBlockLayout

try:
    from engine.kernels import _cpu_attention as _native
except ImportError:  # not built (no compiler at install): attention and writes run in torch
    _native = None

NATIVE_ATTENTION = _native is not None
"""Whether attention and FP8 writes run in C (setup.py builds it; tests require it where
``SPLITSERVE_REQUIRE_NATIVE=1``)."""

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
"""Activation dtypes the kernels take (the engine's model dtypes)."""

_KV_KINDS = {"fp32": 0, "bf16": 1, "fp8_e4m3": 2}


@dataclass(frozen=True)
class NativePool:
    """The pool as the extension reads it: its bytes and the layout's numbers."""

    array: np.ndarray
    """uint8 [num_blocks, block_bytes], the same memory as ``PagedKVCache.buffer``."""
    layout_args: tuple[int, int, int, int, int, int]
    """(num_kv_heads, num_layers, block_size, head_dim, kv kind, scales_offset)."""

    @classmethod
    def of(cls, array: np.ndarray, layout: KVBlockLayout) -> NativePool:
        kind = _KV_KINDS[layout.kv_dtype]
        args = (layout.num_kv_heads, layout.num_layers, layout.block_size, layout.head_dim, kind, layout.scales_offset)
        return cls(array, args)


@dataclass(frozen=True)
class PagedSequences:
    """Sequences attended in one call, each a run of query tokens at consecutive positions.

    Query token i of sequence s sits at position ``starts[s] + i`` and sees positions
    ``0 .. starts[s] + i``: those before ``starts[s]`` from the pool, the rest from this step's
    K/V rows.
    """

    block_tables: np.ndarray
    """int64 [num_seqs, width]; only the blocks before each sequence's start are read."""
    starts: np.ndarray
    """int64 [num_seqs] position of each sequence's first query token."""
    query_starts: np.ndarray
    """int64 [num_seqs + 1] where each sequence's query tokens begin in the call's rows."""

    @classmethod
    def decode(cls, block_tables: torch.Tensor, positions: torch.Tensor) -> PagedSequences:
        """One query token per sequence (a DecodeGroup)."""
        tables = _int64(block_tables)
        return cls(tables, _int64(positions), np.arange(tables.shape[0] + 1, dtype=np.int64))

    @classmethod
    def chunk(cls, block_table: torch.Tensor, start: int, num_tokens: int) -> PagedSequences:
        """One sequence's run of ``num_tokens`` tokens from ``start`` (a PrefillChunk)."""
        return cls(_int64(block_table), np.array([start], dtype=np.int64), np.array([0, num_tokens], dtype=np.int64))

    @classmethod
    def joined(cls, parts: list[PagedSequences]) -> PagedSequences:
        """The sequences of consecutive calls as one call's, in order; tables padded to the
        widest (the pad is never read: a sequence reads only the blocks before its start)."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.block_tables.shape[1] for p in parts)
        tables = np.zeros((sum(p.block_tables.shape[0] for p in parts), width), dtype=np.int64)
        row, query_starts, offset = 0, [np.zeros(1, dtype=np.int64)], 0
        for p in parts:
            tables[row : row + p.block_tables.shape[0], : p.block_tables.shape[1]] = p.block_tables
            row += p.block_tables.shape[0]
            query_starts.append(p.query_starts[1:] + offset)
            offset += int(p.query_starts[-1])
        return cls(tables, np.concatenate([p.starts for p in parts]), np.concatenate(query_starts))


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: NativePool, layer: int, sequences: PagedSequences
) -> torch.Tensor:
    """Causal attention of ``q`` [tokens, heads, head_dim] over the pool and this step's ``k``, ``v``
    [tokens, kv_heads, head_dim] (not yet in the pool), in ``q``'s dtype (float32 or bf16).

    fp32 accumulation and the softmax scale ``1/sqrt(head_dim)``, as SDPA. The head dims must be
    contiguous; the token stride may be anything (views of the QKV projection are fine).
    """
    out = torch.empty(q.shape, dtype=q.dtype)
    _native.attention(
        _array(q, "q"), _array(k, "k"), _array(v, "v"), _array(out, "out"), pool.array, pool.layout_args, layer,
        sequences.block_tables, sequences.starts, sequences.query_starts, torch.get_num_threads(),
    )
    return out


def write_fp8(k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor, pool: NativePool) -> None:
    """``PagedKVCache.write`` for an FP8 pool, bit for bit: ``k``, ``v`` [tokens, layers, kv_heads,
    head_dim] at slots ``(block_ids[i], offsets[i])``, each touched block requantized."""
    _native.write_fp8(
        _array(k.contiguous(), "k"), _array(v.contiguous(), "v"), _int64(block_ids), _int64(offsets),
        pool.array, pool.layout_args, torch.get_num_threads(),
    )


def use_isa(name: str) -> str:
    """Pick the compiled loops ('best', 'avx512', 'avx2' or 'portable'); returns the previous choice. For tests and benchmarks."""
    return _native.use_isa(name)


def _array(tensor: torch.Tensor, name: str) -> np.ndarray:
    """A numpy view of a CPU tensor; bf16 as its int16 bits, which the C side reads as bf16."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()
    if tensor.dtype != torch.float32:
        raise ValueError(f"{name}: expected float32 or bfloat16, got {tensor.dtype}")
    return tensor.numpy()


def _int64(tensor: torch.Tensor) -> np.ndarray:
    return tensor.to(torch.int64).contiguous().numpy()
