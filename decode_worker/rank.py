"""A follower rank of a tensor-parallel decode replica: its slice of the KV pool receives its KV
heads over NIXL from the prefill ranks that hold them.

The leader (DecodeWorker, rank 0) opens every rank's transport when it starts, publishes all
the endpoints, and during a hand-off asks each rank to wait for its writers' notifications
(``await_kv``) while it waits for its own; the request joins the batch when every rank has its
heads. NIXL writes into a pool complete only while its agent is driven, so each rank polls its
own agent (KVReceiver) while it awaits a hand-off.
"""

from __future__ import annotations

import asyncio

from decode_worker.kv_receiver import KVReceiver
from engine.parallel.follower import TPFollower
from kv_store.keys import KeyNamespace
from kv_transfer.protocol import KVEndpoint
from kv_transfer.registry import open_endpoint


class DecodeRank(TPFollower):
    receiver: KVReceiver | None = None

    async def open_kv(self, transport_name: str, replica_id: str, namespace: KeyNamespace) -> KVEndpoint:
        """Register this rank's pool with a transport agent of its own; its endpoint (``namespace``
        is the leader's, given this rank)."""
        transport, endpoint = open_endpoint(
            transport_name, replica_id, self.runner.kv_cache, self.runner.model.shard.kv_heads, namespace, self.rank % max(1, namespace.tp_size),
            self.runner.model.stage.layers, self.runner.model.config.num_layers,
        )
        self.receiver = KVReceiver(transport, endpoint)
        return endpoint

    async def await_kv(self, notif: bytes, timeout_s: float) -> str:
        """Wait until every writer of hand-off ``notif`` has written into this rank's pool; the
        last writer's agent name. Cancelled or timed out, the hand-off is forgotten here."""
        landed = self.receiver.expect(notif)
        try:
            return await asyncio.wait_for(landed, timeout_s)
        finally:
            self.receiver.forget(notif)

    async def num_stray_notifs(self) -> int:
        return self.receiver.num_stray_notifs if self.receiver else 0

    async def close_kv(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
