"""Who writes which KV heads and layers in a hand-off between parallel replicas, and one rank's writes.

A prefill replica of P ranks and a decode replica of D ranks each split the model's KV heads
over their ranks (replicating a head over several ranks when there are fewer heads than ranks).
Every decode rank needs each of its heads from exactly one prefill rank: the lowest-ranked one
that holds it. So each (prefill rank, decode rank) pair that shares heads is one WRITE of those
heads' byte ranges, from the prefill rank's pool straight into the decode rank's (no gather on
any leader)::

    prefill P3 (heads 0|1|2)      decode D1 (heads 0-2): three writes, one per prefill rank
    prefill P1 (heads 0-2)        decode D3 (heads 0|1|2): three writes from rank 0
    prefill P4 (heads 0|0|1|1)    decode D2 (heads 0|1): ranks 0 and 2 write, 1 and 3 hold copies

Pipeline stages split the layers the same way: a rank holds a run of layers as well as a range of
heads, and a decode rank needs each (layer, head) it holds from the lowest prefill rank holding
it. A write is a run of layers times a range of heads (one byte range per head, the block being
head-major, ``kv_store/layout.py``)::

    prefill PP 2 (layers 0-14 | 15-29)      decode PP 1 (layers 0-29): two writes, one per stage
    prefill TP 3 (heads 0|1|2)              decode PP 2: each stage gets three writes, its layers

Each write carries ``TransferRequest.writer_notif(i, n)``: the ``i``-th of the ``n`` writes into
that decode rank, which is how the decode rank knows when it has all of its layers and heads.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kv_store.layout import KVBlockLayout
from kv_transfer.errors import HandOffError, KVTransferError
from kv_transfer.protocol import KVEndpoint, RankWrite, TransferRequest, TransferState

_POLL_S = 0.0002


@dataclass(frozen=True)
class HeadWrite:
    """Prefill rank ``prefill_rank`` writes model KV heads ``heads`` of layers ``layers`` (None:
    every layer, both ranks holding them all) into decode rank ``decode_rank``."""

    prefill_rank: int
    decode_rank: int
    heads: range
    num_writers: int
    """Writes into ``decode_rank`` (this one included)."""
    layers: range | None = None
    writer: int | None = None
    """This write's number among the ``num_writers`` into ``decode_rank`` (None: ``prefill_rank``,
    each prefill rank writing once)."""

    @property
    def writer_id(self) -> int:
        return self.prefill_rank if self.writer is None else self.writer


def plan_head_writes(prefill_heads: Sequence[range], decode_heads: Sequence[range]) -> list[HeadWrite]:
    """Every write of a hand-off between replicas of one stage, given each prefill rank's and each
    decode rank's KV heads (``plan_writes`` with every layer on every rank)."""
    return plan_writes(tuple((None, h) for h in prefill_heads), tuple((None, h) for h in decode_heads))


@functools.lru_cache(maxsize=256)
def plan_writes(
    prefill: tuple[tuple[range | None, range], ...], decode: tuple[tuple[range | None, range], ...], num_layers: int | None = None
) -> list[HeadWrite]:
    """Every write of a hand-off, given each prefill and decode rank's ``(layers, heads)`` (layers
    None: all ``num_layers`` of the model; by default, as many as the stages name, or one when
    none does). Each decode rank gets each (layer, head) it holds from the lowest prefill
    rank holding it; a write is a run of layers by a range of heads. Cached: replicas keep their shape.

    Raises HandOffError when a decode rank needs a layer or head no prefill rank holds (the
    replicas split different models).
    """
    writes: list[HeadWrite] = []
    if num_layers is None:
        num_layers = max([r.stop for r, _ in prefill + decode if r is not None], default=1)

    def holds(layers: range | None, layer: int) -> bool:
        return layers is None or layer in layers

    for d, (wanted_layers, wanted_heads) in enumerate(decode):
        cells: dict[tuple[int, int], list[int]] = {}  # (writer, layer) -> heads
        for layer in wanted_layers if wanted_layers is not None else range(num_layers):
            for head in wanted_heads:
                writer = next((p for p, (layers, heads) in enumerate(prefill) if head in heads and holds(layers, layer)), None)
                if writer is None:
                    what = f"KV head {head}" if all(r is None for r, _ in prefill + decode) else f"layer {layer}'s KV head {head}"
                    raise HandOffError(f"KV hand-off impossible: decode rank {d} needs {what}, which no prefill rank holds", {"heads": (head, None), "layers": (layer, None)})
                cells.setdefault((writer, layer), []).append(head)
        runs: list[tuple[int, range, range]] = []  # (writer, layers, heads): consecutive layers of one writer and heads merged
        for (writer, layer), heads in sorted(cells.items()):
            heads_range = range(heads[0], heads[-1] + 1)
            if runs and runs[-1][0] == writer and runs[-1][2] == heads_range and runs[-1][1].stop == layer:
                runs[-1] = (writer, range(runs[-1][1].start, layer + 1), heads_range)
            else:
                runs.append((writer, range(layer, layer + 1), heads_range))
        whole = wanted_layers is None and all(prefill[w][0] is None for w, _, _ in runs)
        for i, (writer, layers, heads) in enumerate(runs):
            writes.append(HeadWrite(writer, d, heads, len(runs)) if whole else HeadWrite(writer, d, heads, len(runs), layers, i))
    return writes


def head_byte_ranges(
    local: KVBlockLayout,
    local_heads: range,
    remote: KVBlockLayout,
    remote_heads: range,
    heads: range,
    layers: range | None = None,
    local_layers: range | None = None,
    remote_layers: range | None = None,
) -> tuple[list[range] | None, list[range] | None]:
    """``(byte_ranges, remote_byte_ranges)`` for ``write_blocks``: model heads ``heads`` of model
    layers ``layers`` (None: every layer) within a block of each side, whose pools hold
    ``local_heads`` / ``remote_heads`` of layers ``local_layers`` / ``remote_layers`` (None: all).
    ``(None, None)`` (whole blocks) when both blocks are exactly those heads and layers."""
    if layers is None:
        if local_heads == heads == remote_heads and local == remote:
            return None, None
        ours = local.head_ranges(heads.start - local_heads.start, heads.stop - local_heads.start)
        theirs = remote.head_ranges(heads.start - remote_heads.start, heads.stop - remote_heads.start)
        pairs = [(a, b) for a, b in zip(ours, theirs) if len(a)]
        return [a for a, _ in pairs], [b for _, b in pairs]
    ours = _layer_head_ranges(local, local_heads, local_layers or range(local.num_layers), heads, layers)
    theirs = _layer_head_ranges(remote, remote_heads, remote_layers or range(remote.num_layers), heads, layers)
    return ours, theirs


def _layer_head_ranges(layout: KVBlockLayout, held_heads: range, held_layers: range, heads: range, layers: range) -> list[range]:
    """Byte ranges of model heads ``heads`` x layers ``layers`` in a block holding ``held_heads``
    x ``held_layers``: per head its layers' payload, then per head its layers' FP8 scales."""
    layer_bytes = layout.head_bytes // layout.num_layers
    first, count = layers.start - held_layers.start, len(layers)
    out = []
    for head in heads:
        start = (head - held_heads.start) * layout.head_bytes + first * layer_bytes
        out.append(range(start, start + count * layer_bytes))
    if layout.has_scales:
        layer_scales = layout.scale_bytes // (layout.num_kv_heads * layout.num_layers)
        for head in heads:
            start = layout.scales_offset + ((head - held_heads.start) * layout.num_layers + first) * layer_scales
            out.append(range(start, start + count * layer_scales))
    return out


async def write_rank(
    transport,
    transfer: TransferRequest,
    writes: Sequence[HeadWrite],
    endpoint: KVEndpoint,
    local_block_ids: Sequence[int],
    deadline: float,
) -> tuple[RankWrite, ...]:
    """Post this rank's ``writes`` (all from ``endpoint``'s pool) and wait for them to complete.

    Raises KVTransferError when a write fails or is not done by ``deadline`` (``time.monotonic``).
    Cancelled or failed, every handle is released on the way out, which aborts a write still in
    flight: after this returns or raises nothing more lands in the decode pools.
    """
    decode = transfer.decode_endpoints
    posted = []
    try:
        for w in writes:
            target = decode[w.decode_rank]
            byte_ranges, remote_byte_ranges = head_byte_ranges(
                endpoint.layout, endpoint.heads, target.layout, target.heads, w.heads, w.layers, endpoint.layers, target.layers
            )
            handle = transport.write_blocks(
                target.agent_name,
                local_block_ids,
                transfer.block_ids,
                transfer.writer_notif(w.writer_id, w.num_writers),
                byte_ranges=byte_ranges,
                remote_byte_ranges=remote_byte_ranges,
            )
            posted.append((w, handle))
        while any(handle.poll() is TransferState.PROC for _, handle in posted):
            if time.monotonic() > deadline:
                raise KVTransferError(f"write not done within {transfer.timeout_s} s")
            await asyncio.sleep(_POLL_S)
        return tuple(
            RankWrite(w.prefill_rank, w.decode_rank, w.heads.start, w.heads.stop, len(local_block_ids), handle.num_bytes) for w, handle in posted
        )
    finally:
        for _, handle in posted:
            handle.release()
