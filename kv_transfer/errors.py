"""Errors of kv_transfer. All of them survive pickling, so they cross Ray actor boundaries intact."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """A transfer could not be set up or did not complete; the message says which and why."""


class TransferTimeout(KVTransferError):
    """A transfer or its notification did not complete within the caller's timeout."""


class HandOffError(KVTransferError):
    """Two endpoints cannot hand KV blocks to each other; ``differing`` maps each field to (local, remote)."""

    def __init__(self, message: str, differing: dict[str, tuple[object, object]] | None = None) -> None:
        super().__init__(message)
        self.differing = dict(differing or {})

    def __reduce__(self):
        return (type(self), (self.args[0], self.differing))
