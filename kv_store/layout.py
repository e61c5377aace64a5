"""Byte layout of one KV block, shared by the GPU pool, the CPU tier, Redis and NIXL.

One block is one contiguous buffer::

    +------------------------------------------------------------+-----------------------+
    | payload  [kv_heads, layers, 2 (K,V), block_size, head_dim]  | scales (fp8 only)     |
    |          element = 4 (fp32) / 2 (bf16) / 1 (fp8_e4m3) bytes | f32 [kv_heads,layers,2]|
    +------------------------------------------------------------+-----------------------+
    ^ 0                                             payload_bytes ^         block_bytes ^

Head-major, so heads [h0, h1) of the payload are one contiguous byte range (a tensor-parallel
rank's slice), and their scales are one contiguous range of the trailer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_store.keys import KV_DTYPES

_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp8_e4m3": 1}
_SCALE_BYTES = 4
_ALIGN_BYTES = 8


@dataclass(frozen=True)
class KVBlockLayout:
    """Shape and byte offsets of one KV block of one model shard."""

    num_layers: int
    """Decoder layers in the model."""
    num_kv_heads: int
    """KV heads held by this shard."""
    head_dim: int
    """Width of one head."""
    block_size: int
    """Tokens per block."""
    kv_dtype: str
    """Storage dtype: one of kv_store.keys.KV_DTYPES."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: {self.kv_dtype!r} is not one of {KV_DTYPES}")

    @property
    def payload_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_kv_heads, self.num_layers, 2, self.block_size, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        return (self.num_kv_heads, self.num_layers, 2)

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self.kv_dtype]

    @property
    def has_scales(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    @property
    def head_bytes(self) -> int:
        """Payload bytes of one KV head (all layers, K and V)."""
        return self.num_layers * 2 * self.block_size * self.head_dim * self.element_bytes

    @property
    def payload_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    @property
    def scales_offset(self) -> int:
        return -(-self.payload_bytes // _ALIGN_BYTES) * _ALIGN_BYTES

    @property
    def scale_bytes(self) -> int:
        return self.num_kv_heads * self.num_layers * 2 * _SCALE_BYTES if self.has_scales else 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block; a multiple of 8 so blocks stay aligned in a pool."""
        end = self.scales_offset + self.scale_bytes
        return -(-end // _ALIGN_BYTES) * _ALIGN_BYTES

    def head_ranges(self, head_start: int, head_end: int) -> tuple[range, range]:
        """Byte ranges (payload, scales) within a block of heads [head_start, head_end)."""
        if not 0 <= head_start < head_end <= self.num_kv_heads:
            raise ValueError(f"heads [{head_start}, {head_end}) outside [0, {self.num_kv_heads})")
        payload = range(head_start * self.head_bytes, head_end * self.head_bytes)
        per_head_scales = self.scale_bytes // self.num_kv_heads
        scales = range(
            self.scales_offset + head_start * per_head_scales,
            self.scales_offset + head_end * per_head_scales,
        )
        return payload, scales
