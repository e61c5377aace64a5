"""Typed errors raised at the engine's edge.

Each error names what is wrong so that the serving layer can turn it into a status code
(``INVALID_ARGUMENT``, ``NOT_FOUND``, ...) in one place without parsing messages.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request field has a value the engine cannot serve.

    ``field`` is the name of the offending field as the user wrote it (``max_tokens``,
    ``prompt``, ...); the message always starts with it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self._message = message

    def __reduce__(self):  # rebuilt from both arguments when it crosses a process (Ray) boundary
        return type(self), (self.field, self._message)


class UnknownModelError(EngineError, LookupError):
    """A model name is neither a bundled model nor a checkpoint directory."""


class UnsupportedModelError(EngineError, ValueError):
    """A checkpoint exists but its architecture or files cannot be served."""


class CheckpointError(EngineError, OSError):
    """A checkpoint is missing a file or a tensor, or a file is unreadable."""


class RequestFailedError(EngineError, RuntimeError):
    """A step raised because of this request alone: retried apart from the others, its tokens
    still raised while theirs computed. It fails, with ``cause`` named; the engine goes on.

    A serving layer reports it as an internal error of this request, never as a dead replica:
    moving the request to another replica would only fail it (or take that one down) again.
    """

    def __init__(self, request_id: str, cause: str) -> None:
        super().__init__(f"request {request_id!r} failed: a step raised {cause} for this request alone; the other requests go on")
        self.request_id = request_id
        self.cause = cause

    def __reduce__(self):  # rebuilt from both arguments when it crosses a process (Ray) boundary
        return type(self), (self.request_id, self.cause)


class AdmissionQueueFull(Exception):
    """More requests are waiting than the worker admits; the caller should back off."""


class EngineLoopFailed(RuntimeError):
    """The engine thread died; every request it held fails with this."""
