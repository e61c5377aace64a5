"""The bearer token guards the KServe gRPC service as it guards splitserve's, streams included,
and a bad request on a ModelStreamInfer stream is an error_message, not the end of the stream.
A real grpc.aio server on loopback with the router's interceptor; no worker behind it."""

import asyncio

import grpc
import pytest
from tritonclient.grpc import service_pb2 as kpb
from tritonclient.grpc import service_pb2_grpc as kpb_grpc

from router.config import RouterConfig
from router.frontend.apis.kserve_grpc import add_kserve_service
from router.frontend.auth import BearerTokenInterceptor
from router.frontend.metrics import RouterMetrics
from router.frontend.service import GenerationService
from router.routing.policy import make_policy
from router.routing.prefix_index import PrefixIndex
from router.routing.worker_calls import WorkerChannels
from router.routing.workers import WorkerDirectory

pytestmark = pytest.mark.integration


async def _calls(metadata, requests=("m", "m")) -> list[str]:
    """What a unary call and a ModelStreamInfer stream that sends ``requests`` then half-closes see."""
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor("s3cret")])
    service = GenerationService(RouterConfig(), WorkerDirectory(), RouterMetrics("r0"), make_policy("splitserve", PrefixIndex()), WorkerChannels("r0"))
    add_kserve_service(server, service)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    seen = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = kpb_grpc.GRPCInferenceServiceStub(channel)
            try:
                seen.append(f"live={(await stub.ServerLive(kpb.ServerLiveRequest(), metadata=metadata)).live}")
            except grpc.aio.AioRpcError as e:
                seen.append(f"live: {e.code().name} {e.details()}")
            call = stub.ModelStreamInfer(metadata=metadata)
            try:
                for model in requests:
                    await call.write(kpb.ModelInferRequest(model_name=model))
                if requests:
                    await call.done_writing()
                seen += await asyncio.wait_for(_responses(call), 10)
            except grpc.aio.AioRpcError as e:
                seen.append(f"stream: {e.code().name} {e.details()}")
    finally:
        await server.stop(0)
    return seen


async def _responses(call) -> list[str]:
    return [f"stream: {r.error_message}" async for r in call]


def test_a_wrong_token_is_unauthenticated_on_unary_and_stream_calls():
    """The stream is refused as it opens, before its first message (a refusal shaped as a unary
    handler would wait for one). The client sends none: grpc's aio client reports a write that
    races the refusal as INTERNAL instead of the server's status (grpc/grpc#36066)."""
    assert asyncio.run(_calls((("authorization", "Bearer nope"),), requests=())) == [
        "live: UNAUTHENTICATED missing or invalid bearer token",
        "stream: UNAUTHENTICATED missing or invalid bearer token",
    ]


def test_each_bad_request_on_a_stream_gets_its_own_error():
    assert asyncio.run(_calls((("authorization", "Bearer s3cret"),))) == ["live=True", "stream: no live decode worker", "stream: no live decode worker"]
