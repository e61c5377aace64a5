"""Transport security for the router: TLS credentials and bearer-token auth."""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc

from router.config import TLSConfig

_UNAUTHENTICATED_EXEMPT = ("/grpc.health.v1.Health/",)
"""Health probes (load balancers, kubelets) carry no token."""


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """TLS, and mutual TLS when the config names a client CA."""
    client_ca = Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def read_token(token_file: Path) -> str:
    token = Path(token_file).read_text().strip()
    if not token:
        raise ValueError(f"token_file: {token_file} is empty")
    return token


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call (health checks aside) whose ``authorization`` is not ``Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_UNAUTHENTICATED_EXEMPT):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        refusal = token_refusal(metadata.get("authorization", "").encode(), self._expected)
        return handler if refusal is None else _refusing(handler, refusal)


def token_refusal(presented: bytes, expected: bytes) -> str | None:
    """Why an ``authorization`` value of ``presented`` is refused (None: it is ``expected``,
    ``Bearer <token>``), for every front end that checks the token: gRPC, HTTP."""
    if hmac.compare_digest(presented, expected):
        return None
    return "missing or invalid bearer token" if presented else "missing bearer token"


_HANDLER_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
"""The handler factory for each (request streaming, response streaming)."""


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with UNAUTHENTICATED. The shape
    matters: refused by a unary handler, a client stream stays open until its first message."""

    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    make = _HANDLER_MAKERS[(handler.request_streaming, handler.response_streaming)]
    behaviour = refuse_stream if handler.response_streaming else refuse
    return make(behaviour, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
