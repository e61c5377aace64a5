"""The router's HTTP API: one FastAPI app (OpenAI + KServe v2), served by uvicorn inside the
router actor's own asyncio loop, next to its gRPC server.

Auth is the gRPC API's bearer token: with ``token_file`` set, every path but the health probes
and /metrics needs ``Authorization: Bearer <token>`` (401 otherwise, in the path's error shape).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.config import RouterConfig
from router.frontend.apis.errors import APIError, openai_body
from router.frontend.apis.kserve_http import kserve_router
from router.frontend.apis.openai_api import openai_router
from router.frontend.auth import token_refusal
from router.frontend.metrics import RouterMetrics
from router.frontend.service import GenerationService

_OPEN_PATHS = ("/health", "/metrics", "/v2/health/")
"""Probes and Prometheus carry no token (as the gRPC health service)."""


def build_app(service: GenerationService, metrics: RouterMetrics, token: str | None) -> FastAPI:
    """The ASGI app of one router replica."""
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(openai_router(service))
    app.include_router(kserve_router(service))

    @app.get("/health")
    async def health() -> Response:
        """200 while a decode replica serves a model (as the gRPC health service's SERVING)."""
        return Response(status_code=200 if service.directory.served_models() else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(request.url.path, error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        return error_response(request.url.path, APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}"))

    app.add_middleware(_Guard, metrics=metrics, token=token, max_body_bytes=max_body_bytes(service.config))
    return app


def max_body_bytes(config: RouterConfig) -> int:
    """The largest request body read: room for the longest prompt the router accepts (4 UTF-8
    bytes a character, or 12 JSON bytes a token id) and 1 MiB of the rest. A larger one is a 413
    before it is read, so a huge body cannot fill the router's memory."""
    return max(4 * config.max_prompt_chars, 12 * config.max_prompt_token_ids) + (1 << 20)


def error_response(path: str, error: APIError) -> JSONResponse:
    """OpenAI's error body on /v1, KServe's elsewhere."""
    body = openai_body(error) if path.startswith("/v1/") else {"error": error.message}
    return JSONResponse(body, status_code=error.status)


class _Guard:
    """Bearer-token check and request metrics, as plain ASGI middleware: Starlette's
    BaseHTTPMiddleware would sit between a stream and its ``receive`` channel and hide the
    client's disconnect from the handlers that cancel on it."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self._expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await error_response(scope["path"], refusal)(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.http_finished(scope["method"], route, status[0], time.perf_counter() - start)

    def _refusal(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])
        if self._expected is not None and not scope["path"].startswith(_OPEN_PATHS):
            refusal = token_refusal(headers.get(b"authorization", b""), self._expected)
            if refusal is not None:
                return APIError(401, refusal, code="invalid_api_key")
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return APIError(413, f"request body: {int(length)} bytes exceed the limit of {self.max_body_bytes}", code="request_too_large")
        return None


class _ActorServer(uvicorn.Server):
    """uvicorn without its signal handlers: the Ray actor's process owns its signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """uvicorn serving ``app`` as a task of the running loop; ``port`` is known once started."""

    def __init__(self, app: FastAPI, config: RouterConfig) -> None:
        self._app = app
        self._config = config
        self._server: _ActorServer | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Bind, start serving, return the port. Raises OSError when the address is taken."""
        host, port = self._config.host, self._config.http_port or 0
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            sock.close()
            raise OSError(f"http_port: cannot bind the HTTP server to {host}:{port}: {e}") from e
        self.port = sock.getsockname()[1]
        self._server = _ActorServer(uvicorn.Config(self._app, log_config=None, access_log=False, lifespan="off", **_tls_options(self._config)))
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP server on {host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; streams still open after ``grace_s`` are cut (their calls cancelled)."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = grace_s
        self._server.should_exit = True
        await self._task


def _tls_options(config: RouterConfig) -> dict:
    """The gRPC server's TLS (and mutual TLS) for HTTPS too."""
    if config.tls is None:
        return {}
    options = {"ssl_certfile": str(config.tls.cert_file), "ssl_keyfile": str(config.tls.key_file)}
    if config.tls.client_ca_file is not None:
        options |= {"ssl_ca_certs": str(config.tls.client_ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options
