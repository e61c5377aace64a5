"""Every way a call can be refused, and its gRPC status: mapped here and nowhere else."""

from __future__ import annotations

import grpc

from proto import worker_pb2 as wpb

_WORKER_CODES = {
    wpb.RequestError.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    wpb.RequestError.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    wpb.RequestError.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    wpb.RequestError.INTERNAL: grpc.StatusCode.INTERNAL,
    wpb.RequestError.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    wpb.RequestError.REPLICA_FAILED: grpc.StatusCode.UNAVAILABLE,
}


class CallRejected(Exception):
    """A call the router refuses; ``code`` is the gRPC status it becomes."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(field: str, message: str) -> CallRejected:
    return CallRejected(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


def from_worker(error: wpb.RequestError) -> CallRejected:
    return CallRejected(_WORKER_CODES.get(error.code, grpc.StatusCode.INTERNAL), error.message)


class PlacementError(RuntimeError):
    """A replica's processes cannot be placed on the cluster; the message says what is needed and what exists."""


def cause_line(error: BaseException) -> str:
    """The first line of what went wrong inside a Ray actor: the innermost ``cause`` of a
    RayTaskError (not Ray's wrapping and traceback), or the error itself."""
    cause = getattr(error, "cause", None) or error
    while getattr(cause, "cause", None) is not None:
        cause = cause.cause
    return str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__


def quoted(value: str, max_chars: int = 64) -> str:
    """``value`` as an error message quotes it: cut to ``max_chars``, so that a huge field cannot
    push the status message past grpc's metadata limit (the client would get RESOURCE_EXHAUSTED)."""
    if len(value) <= max_chars:
        return repr(value)
    return f"{value[:max_chars]!r}... ({len(value)} characters)"
