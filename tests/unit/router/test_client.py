"""SplitServeClient against a bare gRPC server on loopback."""

import threading
import time
from concurrent import futures

import grpc
import pytest

from proto import splitserve_pb2 as pb
from proto import splitserve_pb2_grpc as pb_grpc
from router.client import SplitServeClient, build_generate_request


class _Echo(pb_grpc.GenerationServicer):
    """Streams the prompt's tokens back one per response, then finishes."""

    def Generate(self, request, context):
        for token in request.prompt_token_ids:
            yield pb.GenerateResponse(token_ids=[token])
            time.sleep(0.01)
        yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH)


@pytest.fixture(scope="module")
def address():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="echo-server"))
    pb_grpc.add_GenerationServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _client_threads(before: set[threading.Thread]) -> list[str]:
    """Threads started since ``before`` that are not the echo server's."""
    return [t.name for t in threading.enumerate() if t not in before and not t.name.startswith("echo-server")]


def test_a_stream_is_read_on_the_callers_thread(address):
    """No channel polling thread hands the client its messages: one thread wake-up less per
    message. A plain channel, read the same way, starts one, so the check can see it."""
    with SplitServeClient(address) as client:
        before = set(threading.enumerate())
        stream = client.generate([5, 6, 7], max_tokens=3)
        assert list(next(stream).token_ids) == [5]
        assert _client_threads(before) == []
        plain = pb_grpc.GenerationStub(grpc.insecure_channel(address)).Generate(build_generate_request([8, 9], max_tokens=2))
        assert list(next(plain).token_ids) == [8]
        assert len(_client_threads(before)) == 1
        assert [list(r.token_ids) for r in stream] == [[6], [7], []]
        assert [list(r.token_ids) for r in plain] == [[9], []]


def test_streams_of_one_client_run_side_by_side_from_threads(address):
    results: dict[int, list[int]] = {}
    with SplitServeClient(address) as client:

        def run(i: int) -> None:
            results[i] = [t for r in client.generate([i, i + 1, i + 2]) for t in r.token_ids]

        threads = [threading.Thread(target=run, args=(10 * i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert results == {10 * i: [10 * i, 10 * i + 1, 10 * i + 2] for i in range(6)}


def test_a_cancelled_stream_ends_with_cancelled(address):
    with SplitServeClient(address) as client:
        stream = client.generate(list(range(1, 50)))
        next(stream)
        stream.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(stream)
    assert e.value.code() == grpc.StatusCode.CANCELLED
