"""A follower rank of a tensor-parallel prefill replica: it writes the KV heads it holds straight
into the decode ranks that need them (kv_transfer/handoff.py plans who writes what).

The leader (PrefillWorker, rank 0) computes a prompt with every rank in lockstep, then asks each
rank to post its own writes (``write_kv``) while it posts its own; nothing is gathered on the
leader. A rank first waits until it has run the step that finished the prompt, since it may
still be writing that step's K/V into its pool when the leader already has the token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from engine.parallel.follower import TPFollower
from kv_store.keys import KeyNamespace
from kv_transfer.errors import KVTransferError
from kv_transfer.handoff import HeadWrite, write_rank
from kv_transfer.protocol import KVEndpoint, RankWrite, TransferRequest
from kv_transfer.registry import open_endpoint

_POLL_S = 0.0005


class PrefillRank(TPFollower):
    transport = None
    endpoint: KVEndpoint | None = None

    async def open_kv(self, transport_name: str, replica_id: str, namespace: KeyNamespace) -> KVEndpoint:
        """Register this rank's pool with a transport agent of its own; its endpoint."""
        self.transport, self.endpoint = open_endpoint(
            transport_name, replica_id, self.runner.kv_cache, self.runner.model.shard.kv_heads, namespace, self.rank % max(1, namespace.tp_size),
            self.runner.model.stage.layers, self.runner.model.config.num_layers,
        )
        return self.endpoint

    async def add_kv_peers(self, endpoints: Sequence[KVEndpoint]) -> None:
        for endpoint in endpoints:
            self.transport.add_peer(endpoint.transport_metadata)

    async def remove_kv_peers(self, agent_names: Sequence[str]) -> None:
        for name in agent_names:
            if self.transport.has_peer(name):
                self.transport.remove_peer(name)

    async def write_kv(
        self, transfer: TransferRequest, writes: Sequence[HeadWrite], local_block_ids: Sequence[int], after_runs: int, timeout_s: float
    ) -> tuple[RankWrite, ...]:
        """Post this rank's ``writes`` of ``local_block_ids`` once it has run ``after_runs`` steps;
        KVTransferError if that or the writes take longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.runner.num_runs < after_runs:
            if time.monotonic() > deadline or not self.alive():
                raise KVTransferError(f"rank {self.rank}: step {after_runs} not run within {timeout_s:.1f} s")
            await asyncio.sleep(_POLL_S)
        return await write_rank(self.transport, transfer, writes, self.endpoint, local_block_ids, deadline)

    async def num_open_handles(self) -> int:
        return self.transport.num_open_handles() if self.transport else 0

    async def close_kv(self) -> None:
        if self.transport is not None:
            self.transport.close()
