"""The decode worker's request plane over real TCP on loopback, with requests that are plain
async generators (the engine behind them is tested elsewhere)."""

from __future__ import annotations

import asyncio
import struct
import time

from decode_worker.request_plane import RequestPlaneServer
from proto import splitserve_pb2 as pb
from proto import worker_pb2 as wpb
from proto.framing import frame, read_frame

TOKEN = b"t" * 32


class Requests:
    """start_request for the server: each request yields ``num_tokens`` responses, one per
    ``step()``, and records whether it ran to the end or was cancelled."""

    def __init__(self, num_tokens: int = 3) -> None:
        self.num_tokens = num_tokens
        self.tick = asyncio.Condition()
        self.num_ticks = 0
        self.started: list[str] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []

    async def step(self) -> None:
        async with self.tick:
            self.num_ticks += 1
            self.tick.notify_all()

    async def __call__(self, submit: wpb.Submit):
        request_id = submit.request.request_id
        if submit.prefill_replica_id == "explode":
            raise RuntimeError("boom")
        start = self.num_ticks
        self.started.append(request_id)
        try:
            for i in range(self.num_tokens):
                async with self.tick:
                    await self.tick.wait_for(lambda: self.num_ticks > start + i)
                last = i == self.num_tokens - 1
                response = pb.GenerateResponse(token_ids=[i], finish_reason=pb.FINISH_REASON_LENGTH if last else None)
                yield wpb.WorkerEvent(response=response)
            self.finished.append(request_id)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise


SILENT_TIMEOUT_S = 0.5
"""The open timeout of the server that waits out a client that says nothing. Every other server
here gives a connection 10 s to open its channel, so that on a busy machine a process descheduled
for a moment still judges what the client sent, not the clock."""


async def serve(requests: Requests, open_timeout_s: float = 10.0) -> tuple[RequestPlaneServer, wpb.RequestPlaneEndpoint]:
    server = RequestPlaneServer("decode-t", TOKEN, requests, open_timeout_s=open_timeout_s)
    return server, await server.start("127.0.0.1", 0)


async def connect(endpoint, token=TOKEN, channel_id="router-0"):
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    writer.write(frame(wpb.RouterMessage(open=wpb.OpenChannel(channel_id=channel_id, token=token))))
    return reader, writer


def submit(writer, request_id: str, prefill: str = "") -> None:
    request = pb.GenerateRequest(request_id=request_id, prompt="hi")
    writer.write(frame(wpb.RouterMessage(submit=wpb.Submit(request=request, prefill_replica_id=prefill))))


async def next_batch(reader) -> wpb.WorkerEventBatch:
    return wpb.WorkerEventBatch.FromString(await asyncio.wait_for(read_frame(reader), 5))


async def until(predicate) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_requests_stream_back_tagged_and_one_frame_per_step():
    async def main():
        requests = Requests(num_tokens=3)
        server, endpoint = await serve(requests)
        reader, writer = await connect(endpoint)
        submit(writer, "a")
        submit(writer, "b")
        await until(lambda: len(requests.started) == 2)
        batches = []
        for _ in range(3):
            await requests.step()
            batches.append(await next_batch(reader))
        assert [[(e.request_id, list(e.response.token_ids)) for e in b.events] for b in batches] == [
            [("a", [0]), ("b", [0])],
            [("a", [1]), ("b", [1])],
            [("a", [2]), ("b", [2])],
        ]
        assert [e.response.finish_reason for e in batches[-1].events] == [pb.FINISH_REASON_LENGTH] * 2
        assert sorted(requests.finished) == ["a", "b"] and requests.cancelled == []
        assert server.stats.num_channels_opened == 1 and server.stats.num_open_channels == 1
        writer.close()
        await until(lambda: server.stats.num_open_channels == 0)
        server.close()

    asyncio.run(main())


def test_the_last_response_reports_the_wait_between_the_submit_frame_and_the_request_starting():
    """The event loop is the request plane's own queue: a request whose start blocks it for 0.3 s
    (standing in for a burst of work) delays the start of the one submitted beside it, and the
    latter's ``request_plane_s`` says so; only the last response carries it."""
    entered_s, hog_done_s = {}, []

    async def start_request(submit: wpb.Submit):
        entered_s[submit.request.request_id] = time.monotonic()
        if submit.request.request_id == "hog":
            time.sleep(0.3)
            hog_done_s.append(time.monotonic())
        for last in (False, True):
            await asyncio.sleep(0.01)
            response = pb.GenerateResponse(token_ids=[1], finish_reason=pb.FINISH_REASON_LENGTH if last else None)
            yield wpb.WorkerEvent(response=response)

    async def main():
        server = RequestPlaneServer("decode-t", TOKEN, start_request)
        endpoint = await server.start("127.0.0.1", 0)
        reader, writer = await connect(endpoint)
        sent_s = time.monotonic()
        writer.write(frame(wpb.RouterMessage(submit=wpb.Submit(request=pb.GenerateRequest(request_id="hog")))) +
                     frame(wpb.RouterMessage(submit=wpb.Submit(request=pb.GenerateRequest(request_id="behind")))))
        events = []
        while len(events) < 4:
            events += (await next_batch(reader)).events
        last = {e.request_id: e.response for e in events if e.response.finish_reason}
        assert [e.response.HasField("timings") for e in events if not e.response.finish_reason] == [False, False]
        # Both frames were read before the hog started: the hog waited at most from their sending to
        # its start, the other at least as long as the hog held the event loop.
        assert 0 <= last["hog"].timings.request_plane_s <= entered_s["hog"] - sent_s
        assert last["behind"].timings.request_plane_s >= hog_done_s[0] - entered_s["hog"]
        writer.close()
        server.close()

    asyncio.run(main())


def test_cancel_stops_one_request_and_the_others_go_on():
    async def main():
        requests = Requests(num_tokens=2)
        server, endpoint = await serve(requests)
        reader, writer = await connect(endpoint)
        submit(writer, "a")
        submit(writer, "b")
        await until(lambda: len(requests.started) == 2)
        writer.write(frame(wpb.RouterMessage(cancel=wpb.Cancel(request_id="a"))))
        writer.write(frame(wpb.RouterMessage(cancel=wpb.Cancel(request_id="never-submitted"))))
        await until(lambda: requests.cancelled == ["a"])
        await requests.step()
        await requests.step()
        ids = []
        while "b" not in requests.finished or len(ids) < 2:
            ids += [e.request_id for e in (await next_batch(reader)).events]
        assert ids == ["b", "b"]
        assert server.stats.num_cancelled == 1
        writer.close()
        server.close()

    asyncio.run(main())


def test_a_closed_connection_cancels_every_request_on_it():
    async def main():
        requests = Requests(num_tokens=100)
        server, endpoint = await serve(requests)
        _, writer = await connect(endpoint)
        for request_id in ("a", "b", "c"):
            submit(writer, request_id)
        await until(lambda: len(requests.started) == 3)
        writer.close()
        await until(lambda: sorted(requests.cancelled) == ["a", "b", "c"])
        assert server.stats.num_open_channels == 0 and server.stats.num_cancelled == 3
        server.close()

    asyncio.run(main())


def test_a_wrong_token_or_no_open_first_is_refused_and_runs_nothing(caplog):
    async def main():
        requests = Requests()
        server, endpoint = await serve(requests)
        reader, writer = await connect(endpoint, token=b"wrong")
        submit(writer, "a")
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without a byte
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        submit(writer, "b")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        writer.write(struct.pack(">I", 1 << 20))  # a big frame before the token: not even read
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert server.stats.num_channels_refused == 3 and server.stats.num_channels_opened == 0
        assert server.stats.num_submitted == 0
        server.close()
        impatient, endpoint = await serve(requests, SILENT_TIMEOUT_S)
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)  # says nothing
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert impatient.stats.num_channels_refused == 1 and impatient.stats.num_channels_opened == 0
        impatient.close()

    asyncio.run(main())
    reasons = [r.getMessage().split(": ", 2)[-1] for r in caplog.records if "refused a connection" in r.getMessage()]
    assert reasons[0] == "channel 'router-0' presented a wrong token"
    assert reasons[1] == "first message is 'submit', not 'open'"
    assert reasons[2].startswith("no OpenChannel (FrameTooLarge('frame of 1048576 bytes is over the limit of 4096'")
    assert reasons[3] == f"no OpenChannel within {SILENT_TIMEOUT_S:g} s"


def test_a_repeated_request_id_is_refused_and_the_first_one_goes_on():
    async def main():
        requests = Requests(num_tokens=1)
        server, endpoint = await serve(requests)
        reader, writer = await connect(endpoint)
        submit(writer, "a")
        submit(writer, "a")
        submit(writer, "")
        first = await next_batch(reader)
        errors = [(e.request_id, e.error.code, e.error.message) for e in first.events]
        assert errors == [
            ("a", wpb.RequestError.INVALID_ARGUMENT, "request_id: 'a' is already running on this channel"),
            ("", wpb.RequestError.INVALID_ARGUMENT, "request_id: is missing"),
        ]
        await requests.step()
        [event] = (await next_batch(reader)).events
        assert event.request_id == "a" and event.response.finish_reason == pb.FINISH_REASON_LENGTH
        writer.close()
        server.close()

    asyncio.run(main())


def test_a_failing_request_ends_with_internal_and_the_channel_stays_open():
    async def main():
        requests = Requests(num_tokens=1)
        server, endpoint = await serve(requests)
        reader, writer = await connect(endpoint)
        submit(writer, "a", prefill="explode")
        [event] = (await next_batch(reader)).events
        assert event.request_id == "a" and event.error.code == wpb.RequestError.INTERNAL and "boom" in event.error.message
        submit(writer, "b")
        await until(lambda: requests.started == ["b"])
        await requests.step()
        [event] = (await next_batch(reader)).events
        assert event.request_id == "b" and event.response.token_ids == [0]
        writer.close()
        server.close()

    asyncio.run(main())


def test_an_oversized_or_garbled_frame_closes_the_channel_and_cancels_its_requests():
    async def main():
        requests = Requests(num_tokens=100)
        server, endpoint = await serve(requests)
        for garbage in (struct.pack(">I", 1 << 31), struct.pack(">I", 3) + b"\xff\xff\xff"):
            reader, writer = await connect(endpoint)
            submit(writer, "a")
            await until(lambda: requests.started == ["a"])
            writer.write(garbage)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            await until(lambda: requests.cancelled.count("a") == 1)
            requests.cancelled.clear()
            requests.started.clear()
            writer.close()
        assert server.stats.num_open_channels == 0
        server.close()

    asyncio.run(main())


def test_server_close_drops_its_channels():
    async def main():
        requests = Requests(num_tokens=100)
        server, endpoint = await serve(requests)
        reader, writer = await connect(endpoint)
        submit(writer, "a")
        await until(lambda: len(requests.started) == 1)
        server.close()
        await until(lambda: requests.cancelled == ["a"])
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()

    asyncio.run(main())
