"""Assemble a router's gRPC server: Generation, Admin, health, reflection, TLS and token auth."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import splitserve_pb2 as pb
from proto import splitserve_pb2_grpc as pb_grpc
from router.auth import BearerTokenInterceptor, read_token, server_credentials
from router.config import RouterConfig
from router.service import AdminService, GenerationService

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
    pb_grpc.add_GenerationServicer_to_server(generation, server)
    pb_grpc.add_AdminServicer_to_server(admin, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
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
