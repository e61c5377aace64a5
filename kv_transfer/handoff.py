"""Who writes which KV heads in a hand-off between tensor-parallel replicas, and one rank's writes.

A prefill replica of P ranks and a decode replica of D ranks each split the model's KV heads
over their ranks (replicating a head over several ranks when there are fewer heads than ranks).
Every decode rank needs each of its heads from exactly one prefill rank: the lowest-ranked one
that holds it. So each (prefill rank, decode rank) pair that shares heads is one WRITE of those
heads' byte ranges, from the prefill rank's pool straight into the decode rank's (no gather on
any leader)::

    prefill P3 (heads 0|1|2)      decode D1 (heads 0-2): three writes, one per prefill rank
    prefill P1 (heads 0-2)        decode D3 (heads 0|1|2): three writes from rank 0
    prefill P4 (heads 0|0|1|1)    decode D2 (heads 0|1): ranks 0 and 2 write, 1 and 3 hold copies

Each write carries ``TransferRequest.writer_notif(rank, n)``, ``n`` being the number of writers
into that decode rank, which is how the decode rank knows when it has all of its heads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kv_store.layout import KVBlockLayout
from kv_transfer.errors import HandOffError, KVTransferError
from kv_transfer.protocol import KVEndpoint, RankWrite, TransferRequest, TransferState

_POLL_S = 0.0002


@dataclass(frozen=True)
class HeadWrite:
    """Prefill rank ``prefill_rank`` writes model KV heads ``heads`` into decode rank ``decode_rank``."""

    prefill_rank: int
    decode_rank: int
    heads: range
    num_writers: int
    """Prefill ranks that write into ``decode_rank`` (this one included)."""


def plan_head_writes(prefill_heads: Sequence[range], decode_heads: Sequence[range]) -> list[HeadWrite]:
    """Every write of a hand-off, given each prefill rank's and each decode rank's KV heads.

    Raises HandOffError when a decode rank needs a head no prefill rank holds (the replicas
    split different models).
    """
    writes: list[HeadWrite] = []
    for d, wanted in enumerate(decode_heads):
        by_writer: dict[int, list[int]] = {}
        for head in wanted:
            writer = next((p for p, held in enumerate(prefill_heads) if head in held), None)
            if writer is None:
                raise HandOffError(f"KV hand-off impossible: decode rank {d} needs KV head {head}, which no prefill rank holds", {"heads": (head, None)})
            by_writer.setdefault(writer, []).append(head)
        for p, heads in by_writer.items():
            writes.append(HeadWrite(p, d, range(heads[0], heads[-1] + 1), len(by_writer)))
    return writes


def head_byte_ranges(local: KVBlockLayout, local_heads: range, remote: KVBlockLayout, remote_heads: range, heads: range) -> tuple[list[range] | None, list[range] | None]:
    """``(byte_ranges, remote_byte_ranges)`` for ``write_blocks``: model heads ``heads`` within a
    block of each side, whose pools hold ``local_heads`` and ``remote_heads``. ``(None, None)``
    (whole blocks) when both blocks are exactly those heads."""
    if local_heads == heads == remote_heads and local == remote:
        return None, None
    ours = local.head_ranges(heads.start - local_heads.start, heads.stop - local_heads.start)
    theirs = remote.head_ranges(heads.start - remote_heads.start, heads.stop - remote_heads.start)
    pairs = [(a, b) for a, b in zip(ours, theirs) if len(a)]
    return [a for a, _ in pairs], [b for _, b in pairs]


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
            byte_ranges, remote_byte_ranges = head_byte_ranges(endpoint.layout, endpoint.heads, target.layout, target.heads, w.heads)
            handle = transport.write_blocks(
                target.agent_name,
                local_block_ids,
                transfer.block_ids,
                transfer.writer_notif(w.prefill_rank, w.num_writers),
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
