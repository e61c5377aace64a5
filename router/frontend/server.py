"""Assemble a router's gRPC server: Generation, Admin, KServe v2 inference, health, reflection, TLS and token auth."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import splitserve_pb2 as pb
from router.config import RouterConfig
from router.frontend.apis import kserve_grpc
from router.frontend.auth import BearerTokenInterceptor, read_token, server_credentials
from router.frontend.service import AdminService, GenerationService

SERVICE_NAMES = tuple(pb.DESCRIPTOR.services_by_name[n].full_name for n in ("Generation", "Admin"))


@dataclass
class RunningServer:
    """A started server and the pieces its owner keeps updating."""

    server: grpc.aio.Server
    port: int
    health: health.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)


async def start_server(config: RouterConfig, generation: GenerationService, admin: AdminService) -> RunningServer:
    interceptors = [BearerTokenInterceptor(read_token(config.token_file))] if config.token_file else []
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
    _add_service(server, "Generation", generation)
    _add_service(server, "Admin", admin)
    kserve_grpc.add_kserve_service(server, generation)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*SERVICE_NAMES, kserve_grpc.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if config.tls is not None:
        port = server.add_secure_port(address, server_credentials(config.tls))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the gRPC server to {address}")
    await server.start()
    running = RunningServer(server, port, health_servicer)
    await running.set_serving(False)
    return running


def _add_service(server: grpc.aio.Server, name: str, servicer) -> None:
    """Serve ``servicer``'s methods of service ``name`` with our own request decoding, so bytes
    that are no valid request get INVALID_ARGUMENT naming the message (grpc's own decoding
    answers them UNKNOWN, before any of our code runs)."""
    service = pb.DESCRIPTOR.services_by_name[name]
    handlers = {}
    for method in service.methods:
        request_class = GetMessageClass(method.input_type)
        serialize = GetMessageClass(method.output_type).SerializeToString
        implementation = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(_streaming(implementation, request_class), response_serializer=serialize)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_unary(implementation, request_class), response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


async def _decode(request_class, data: bytes, context: grpc.aio.ServicerContext):
    try:
        return request_class.FromString(data)
    except DecodeError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid {request_class.DESCRIPTOR.full_name} ({e})")


def _unary(implementation, request_class):
    async def handle(data: bytes, context: grpc.aio.ServicerContext):
        return await implementation(await _decode(request_class, data, context), context)

    return handle


def _streaming(implementation, request_class):
    async def handle(data: bytes, context: grpc.aio.ServicerContext):
        async for response in implementation(await _decode(request_class, data, context), context):
            yield response

    return handle
