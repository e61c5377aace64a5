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
