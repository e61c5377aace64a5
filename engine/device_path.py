"""What one decode layer launches on the device path: torch's kernels and Triton's, counted.

A step bound by launching kernels (about 55 small torch ops per layer before the fused kernels)
cannot reach the memory roofline, so the count is a budget that a test holds and
``bench.kernels`` reports. Torch's ops are seen by a ``TorchDispatchMode``: every op that runs a
kernel counts (views, allocations and metadata do not); matrix products are listed apart, since
they are the layer's real work. Triton kernels count through ``engine.kernels.launches``.
Left out on CPU, where the tests count: ops that Triton's interpreter runs on its own behalf
(copying arguments in and out), and the kernels' value checks, which read the data only where
it is on the host (``_check*`` / ``check*`` in ``engine.kernels``; on CUDA they would sync).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.kernels.launches import LaunchCounter

aten = torch.ops.aten
_NO_KERNEL = {
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.lift_fresh.default,
    aten.detach.default, aten.set_.source_Storage_storage_offset, aten.resize_.default,
}
_GEMMS = {aten.linear, aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm, aten._int_mm}


@dataclass(frozen=True)
class LayerLaunches:
    """Kernels one decode layer launches, by name."""

    torch_ops: dict[str, int]
    """torch ops that run a kernel, matrix products excluded."""
    gemms: dict[str, int]
    triton: dict[str, int]

    @property
    def num_launches(self) -> int:
        """Launches besides the matrix products': what the fused kernels cut down."""
        return sum(self.torch_ops.values()) + sum(self.triton.values())


class _TorchKernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in _NO_KERNEL and not _not_the_layers():
            self.ops[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def _not_the_layers() -> bool:
    """Whether the op runs inside Triton (its interpreter) or inside a kernel wrapper's host-side check."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("triton."):
            return True
        if module.startswith("engine.kernels.") and frame.f_code.co_name.lstrip("_").startswith("check"):
            return True
        frame = frame.f_back
    return False


@torch.inference_mode()
def count_decode_layer_launches(graphs, num_decodes: int = 1, layer_index: int = 1, num_splits: int | None = None) -> LayerLaunches:
    """Launches of layer ``layer_index`` (one with a residual coming in) in a decode step of
    ``num_decodes`` padding rows of ``graphs`` (an ``engine.graphs.DecodeGraphs``); ``num_splits``
    sets the attention's split-K (a GPU splits long contexts; the CPU does not on its own)."""
    bucket = graphs.bucket(num_decodes)
    graphs._pad(0, bucket)
    batch = graphs.batch(bucket)
    if num_splits is not None:
        batch = replace(batch, device=replace(batch.device, num_splits=num_splits))
    model = graphs.model
    hidden, residual = model.embed_tokens(graphs.input_ids[:bucket]), None
    for layer in model.layers[:layer_index]:
        hidden, residual = layer(hidden, residual, batch)
    with _TorchKernels() as torch_kernels, LaunchCounter() as triton:
        model.layers[layer_index](hidden, residual, batch)
    gemms = {str(op): n for op, n in torch_kernels.ops.items() if op in _GEMMS}
    others = {str(op): n for op, n in torch_kernels.ops.items() if op not in _GEMMS}
    return LayerLaunches(torch_ops=others, gemms=gemms, triton=dict(triton))
