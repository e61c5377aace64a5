"""The decode side waits for a notification from every writer of a hand-off, however early they come."""

import asyncio

from decode_worker.kv_receiver import KVReceiver
from kv_store.keys import KeyNamespace
from kv_store.layout import KVBlockLayout
from kv_transfer.protocol import KVEndpoint, TransferRequest


class FakeTransport:
    """Stands in for a NIXL agent's notification queue (what pop_notifs returns)."""

    def __init__(self) -> None:
        self.queued: dict[str, list[bytes]] = {}

    def send(self, sender: str, notif: bytes) -> None:
        self.queued.setdefault(sender, []).append(notif)

    def pop_notifs(self) -> dict[str, list[bytes]]:
        out, self.queued = self.queued, {}
        return out

    def close(self) -> None:
        pass


def _receiver() -> tuple[KVReceiver, FakeTransport, TransferRequest]:
    layout = KVBlockLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, kv_dtype="fp32")
    namespace = KeyNamespace(model_name="m", weights_fingerprint="w", kv_dtype="fp32", block_size=2)
    endpoint = KVEndpoint("d", b"meta", namespace, layout, num_blocks=8, head_start=0, head_end=1)
    transport = FakeTransport()
    return KVReceiver(transport, endpoint, poll_interval_s=0.001), transport, TransferRequest("r1", endpoint, (1,), num_prompt_tokens=2)


def test_the_hand_off_lands_when_every_writer_has_written():
    async def scenario():
        receiver, transport, request = _receiver()
        landed = receiver.expect(request.notif)
        transport.send("p-rank0", request.writer_notif(0, 3))
        transport.send("p-rank2", request.writer_notif(2, 3))
        transport.send("p-rank2", request.writer_notif(2, 3))  # a duplicate does not count twice
        await asyncio.sleep(0.02)
        assert not landed.done()
        transport.send("p-rank1", request.writer_notif(1, 3))
        assert await asyncio.wait_for(landed, 1.0) == "p-rank1"
        assert receiver.num_waiting == 0

    asyncio.run(scenario())


def test_notifications_before_the_wait_are_kept_for_it():
    async def scenario():
        receiver, transport, request = _receiver()
        other = receiver.expect(b"splitserve-kv/1/other")  # keeps the poller running
        transport.send("p-rank0", request.writer_notif(0, 1))
        await asyncio.sleep(0.02)
        landed = receiver.expect(request.notif)
        assert await asyncio.wait_for(landed, 1.0) == "p-rank0"
        receiver.forget(b"splitserve-kv/1/other")
        assert other.cancelled()

    asyncio.run(scenario())
