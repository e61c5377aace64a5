"""HTTP errors: one exception for the HTTP front ends, and the one mapping from gRPC status codes.

The OpenAI API answers ``{"error": {"message", "type", "param", "code"}}``; KServe v2 answers
``{"error": "message"}``. Both take the same status codes from here.
"""

from __future__ import annotations

import re

import grpc

from router.errors import CallRejected

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}

_FIELD_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")
"""Router and engine messages start with the field they name (``max_tokens: must be >= 1``)."""


class APIError(Exception):
    """A request an HTTP front end refuses: ``status`` is the HTTP status, ``param`` the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def invalid(param: str, message: str) -> APIError:
    """A 400 naming ``param``; the message starts with it, as the gRPC API's do."""
    return APIError(400, f"{param}: {message}", param=param)


def from_rejected(rejected: CallRejected) -> APIError:
    """The HTTP form of a call the router refused (its gRPC status mapped to an HTTP one)."""
    match = _FIELD_PREFIX.match(rejected.message)
    return APIError(_HTTP_STATUS.get(rejected.code, 500), rejected.message, param=match.group(1) if match else None, code=rejected.code.name.lower())


def openai_body(error: APIError) -> dict:
    """OpenAI's error object."""
    kind = _OPENAI_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def grpc_status(error: APIError) -> grpc.StatusCode:
    """The gRPC status of an APIError raised while parsing a KServe request."""
    for code, status in _HTTP_STATUS.items():
        if status == error.status:
            return code
    return grpc.StatusCode.INTERNAL
